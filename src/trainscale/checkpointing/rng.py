"""The RNG states a checkpoint holds (every generator a training step draws from), and the run's seed."""

from __future__ import annotations

import os
import random
import warnings

import numpy as np
import torch


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's ``random``, numpy's global generator and torch's (CPU and every CUDA device) with ``seed`` and
    make it the seed of every later ``fit`` whose ``Trainer(seed=...)`` is left at None; returns it. As Lightning's
    ``seed_everything``: the seed is kept in the ``PL_GLOBAL_SEED`` environment variable (so a process started by
    ``ddp_spawn`` inherits it), ``workers=True`` sets ``PL_SEED_WORKERS=1``, and without a seed the one in
    ``PL_GLOBAL_SEED`` is taken, else 0 with a warning. ``verbose`` is accepted for Lightning's signature (nothing
    is printed).

    Args:
        seed: an int in [0, 2**32) (numpy's range), or None.
        workers: seed each DataLoader worker of the Trainer's loaders (Python, numpy and torch) from the seed, the
            rank and the worker's id, as Lightning's ``pl_worker_init_function`` (``worker_init``).

    Raises:
        ValueError: a seed (or ``PL_GLOBAL_SEED``) outside [0, 2**32).
    """
    if seed is None:
        seed = _env_seed()
        if seed is None:
            seed = 0
            warnings.warn("seed_everything() got no seed: seed set to 0 (as Lightning's)", UserWarning, stacklevel=2)
    seed = seed_generators(seed)
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    os.environ["PL_SEED_WORKERS"] = str(int(bool(workers)))
    return seed


def seed_generators(seed: int) -> int:
    """Seed Python's ``random``, numpy's global generator and torch's (CPU and every CUDA device) with ``seed``;
    returns it. ``Trainer.fit`` calls it on every rank with :func:`fit_seed`; it records nothing.

    Raises:
        ValueError: a seed outside [0, 2**32) (numpy's range).
    """
    seed = int(seed)
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} must lie in [0, 2**32) (numpy's range)")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed


def fit_seed(seed: int | None) -> int:
    """The seed a ``fit`` seeds with: ``Trainer(seed=...)`` when given, else the last :func:`seed_everything`'s
    (``PL_GLOBAL_SEED``), else 0.

    Raises:
        ValueError: a ``PL_GLOBAL_SEED`` that is not an int in [0, 2**32)."""
    if seed is not None:
        return seed
    env_seed = _env_seed()
    return 0 if env_seed is None else env_seed


def _env_seed() -> int | None:
    """The seed in ``PL_GLOBAL_SEED`` (set by :func:`seed_everything`, or by the user as for Lightning); None when
    it is not set.

    Raises:
        ValueError: a value that is not an int in [0, 2**32), naming the variable."""
    value = os.environ.get("PL_GLOBAL_SEED")
    if value is None:
        return None
    if not value.strip().isdigit() or int(value) >= 2**32:
        raise ValueError(f"PL_GLOBAL_SEED={value!r} must be an int in [0, 2**32) (the seed seed_everything keeps "
                         "there): unset it, or set a valid seed")
    return int(value)


def seeds_workers() -> bool:
    """Whether :func:`seed_everything` was called with ``workers=True`` (``PL_SEED_WORKERS=1``)."""
    return os.environ.get("PL_SEED_WORKERS") == "1"


def worker_init(worker_id: int, rank: int = 0) -> None:
    """A DataLoader worker's ``worker_init_fn`` after ``seed_everything(..., workers=True)``, in the role of
    Lightning's ``pl_worker_init_function``: seeds the worker's torch, Python and numpy generators with
    independent streams derived from the base seed (torch's ``initial_seed()`` less ``worker_id``: PyTorch gives
    worker ``i`` the loader's base seed + ``i``), ``worker_id`` and ``rank`` through numpy's ``SeedSequence``
    (https://numpy.org/doc/stable/reference/random/parallel.html). The streams are not Lightning's bit for bit."""
    base_seed = torch.initial_seed() - worker_id
    state = np.random.SeedSequence([base_seed, worker_id, rank]).generate_state(4)
    torch.manual_seed((int(state[0]) << 32) | int(state[1]))
    random.seed((int(state[2]) << 32) | int(state[3]))
    np.random.seed(state)


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
