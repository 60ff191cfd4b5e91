"""The RNG states a checkpoint holds (every generator a training step draws from), and the run's seed."""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch


def seed_everything(seed: int | None = None) -> int:
    """Seed Python's ``random``, numpy's global generator and torch's (CPU and every CUDA device) with ``seed``
    (an int in [0, 2**32); None: 0, with a warning, as Lightning's when no seed is found); returns it.

    ``Trainer.fit`` calls it with ``Trainer(seed=...)`` (default 0) on every rank; in a hand-written
    ``Runtime`` loop, call it yourself (the same seed on every rank, as Lightning's ``seed_everything``);
    ``trainscale.seed_everything`` is this function. Unlike Lightning's it reads no ``PL_GLOBAL_SEED``.

    Raises:
        ValueError: a seed outside [0, 2**32) (numpy's range).
    """
    if seed is None:
        seed = 0
        warnings.warn("seed_everything() got no seed: seed set to 0 (as Lightning's)", UserWarning, stacklevel=2)
    seed = int(seed)
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} must lie in [0, 2**32) (numpy's range)")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed

def rng_state() -> dict:
    """This process's RNG states (torch CPU and CUDA, numpy, Python), in types ``weights_only`` loads."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], np_state[1].tolist(), *map(float, np_state[2:])],  # 624 ints (MT19937 keys)
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
        state["cuda_device"] = torch.cuda.current_device()  # the one this rank computes on
    return state

def set_rng_state(state: dict) -> None:
    """Restore states made by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        _set_cuda_rng_state(state["cuda"], state.get("cuda_device"))

def _set_cuda_rng_state(states: list, device: int | None) -> None:
    """Every saved device's state when this process sees as many; else (it sees fewer, e.g. one GPU bound
    per task after a save that saw the whole node) the state of the device the rank computed on, restored
    into its current device (the first ones for checkpoints saved without ``cuda_device``)."""
    visible = torch.cuda.device_count()
    if len(states) <= visible:
        torch.cuda.set_rng_state_all(states)
    elif device is not None and device < len(states):
        torch.cuda.set_rng_state(states[device], torch.cuda.current_device())
    else:
        torch.cuda.set_rng_state_all(states[:visible])
