"""Where a run's checkpoints live, which one is "last", and the RNG state that goes in them.

Layout of a run directory::

    <default_root_dir>/version_<N>/
        metrics.jsonl  summary.json
        checkpoints/epoch=000002-step=0000000126.pt  (+ .sha256)   written atomically (single, ddp)
        checkpoints/epoch=000002-step=0000000126/                  a sharded DCP directory (fsdp), renamed into place
        checkpoints/last                                     the name of the newest complete one
        job_id                                               the torchrun/SLURM job that made it
        stacks/rank<R>.txt                                   watchdog stack dumps (only after a stall)

"last" is written only after its checkpoint and checksum are on disk, so a crash during a save
leaves the previous checkpoint as "last".
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import re
from pathlib import Path

import numpy as np
import torch

from trainscale.runtime.checkpoint_io import atomic_write_bytes

_VERSION = re.compile(r"^version_(\d+)$")
# Names before 2026-11 had 4 and 6 digits (epoch=0002-step=000126): still parsed and rotated.
_CHECKPOINT = re.compile(r"^epoch=(\d+)-step=(\d+)(?:\.pt)?$")
LAST = "last"
JOB_ID = "job_id"
SCRIPT = "script"
RESUMED_FROM = "resumed_from"


def next_run_dir(root: str | os.PathLike) -> Path:
    """``root/version_N`` with N one more than the largest existing (0 for the first). It claims
    nothing: two runs started together get the same answer; create a run's directory with
    :func:`claim_run_dir`."""
    root = Path(root)
    versions = [int(m.group(1)) for p in (root.iterdir() if root.is_dir() else []) if (m := _VERSION.match(p.name))]
    return root / f"version_{max(versions, default=-1) + 1}"


def claim_run_dir(root: str | os.PathLike) -> Path:
    """Create and return ``root/version_N``, N one more than the largest existing, claimed atomically:
    of several processes or threads racing under one ``root``, each gets its own directory.

    ``mkdir`` without ``exist_ok`` succeeds for exactly one caller (also on NFS v3+ and Lustre, where
    directory creation is atomic on the server); a loser looks again and takes the next number. Each
    retry follows a directory made by another caller, so the loop ends.

    Raises:
        OSError: ``root`` cannot be created (e.g. it is a file, or permission denied).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    while True:
        candidate = next_run_dir(root)
        try:
            candidate.mkdir()
        except FileExistsError:
            continue  # another run took this number between our listing and our mkdir
        return candidate


def _runs(root: Path, job_id: str | None, script: str | None = None) -> list[Path]:
    runs = sorted(((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
                   if (m := _VERSION.match(p.name))), reverse=True)
    return [run for _, run in runs if (job_id is None or _read(run / JOB_ID) == job_id)
            and (script is None or _read(run / SCRIPT) == script)]


def _read(path: Path) -> str | None:
    return path.read_text().strip() if path.is_file() else None


def find_last(root: str | os.PathLike, job_id: str | None = None, script: str | None = None) -> Path | None:
    """The "last" checkpoint of the newest run under ``root`` that has one, or None.
    With ``job_id``, only runs started by that job (the id torchrun or SLURM keeps across restarts);
    with ``script``, only runs of that script (``trainscale.train.runs.script_key``)."""
    for run in _runs(Path(root), job_id, script):
        pointer = run / "checkpoints" / LAST
        if pointer.is_file():
            return run / "checkpoints" / pointer.read_text().strip()
    return None


def find_job_run(root: str | os.PathLike, job_id: str) -> Path | None:
    """The newest run directory started by ``job_id`` (a restarted job keeps its directory)."""
    runs = _runs(Path(root), job_id)
    return runs[0] if runs else None


def write_job_id(run_dir: Path, job_id: str | None) -> None:
    if job_id:
        atomic_write_bytes(run_dir / JOB_ID, job_id.encode() + b"\n")


def write_script(run_dir: Path, script: str) -> None:
    """Record which script made the run (``ckpt_path="last"`` resumes only that script's runs)."""
    atomic_write_bytes(run_dir / SCRIPT, script.encode() + b"\n")


def write_resumed_from(run_dir: Path, checkpoint: Path) -> None:
    """Record the checkpoint (of another run) this run started from."""
    atomic_write_bytes(run_dir / RESUMED_FROM, str(Path(checkpoint).resolve()).encode() + b"\n")


def start_epoch(loader, epoch: int, position: dict | None, world_size: int, saved_world_size: int) -> int:
    """Point ``loader``'s sampler at ``epoch`` and, when resuming that epoch, at its saved position.

    Returns:
        Micro-batches to skip by iterating (only for samplers that cannot start mid-epoch; 0 otherwise).

    Raises:
        ValueError: a mid-epoch position with a sampler that cannot start there on another world size.
    """
    sampler = getattr(loader, "sampler", None)
    resume = position is not None and position["epoch"] == epoch and not position["complete"]
    if hasattr(sampler, "consumed_after"):
        sampler.set_epoch(epoch, position["consumed"] if resume and position["consumed"] is not None else 0)
        if resume and position["consumed"] is None:
            raise ValueError("the checkpoint holds no sample position for this epoch; resume with the loader "
                             "it was written with")
        return 0
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    skip = position["batches"] if resume else 0
    if skip and world_size != saved_world_size:
        raise ValueError(f"resuming mid-epoch on world size {world_size} (saved on {saved_world_size}) needs the "
                         "sampler trainscale injects; let the Trainer shard the DataLoader (no own sampler)")
    return skip


def epoch_batches(fit, state, epoch: int, resume, world_size: int, limit=lambda full: full):
    """Point ``fit``'s training loader at ``epoch`` (at ``resume``, a ``ResumePoint``, when it continues that
    epoch) and return the epoch's batches; set ``fit.epoch_offset`` (micro-batches done before), ``fit.epoch_batches``
    (the epoch's micro-batches in all: ``limit`` of the loader's, ``TrainerConfig.train_batches``) and
    ``state.batches``. trainscale's sampler starts mid-epoch itself (its ``len`` is then what is left); other
    samplers' first batches are skipped by iterating. A mid-epoch checkpoint's RNG states are restored here,
    after the loader's iterator is made, as when it was saved."""
    state.batches = fit.epoch_offset = resume.batches if resume else 0
    skip = start_epoch(fit.train_loader, epoch, resume.position() if resume else None, world_size,
                       resume.world_size if resume else world_size)
    fit.epoch_batches = limit(len(fit.train_loader) + (0 if skip else fit.epoch_offset))
    batches = iter(fit.train_loader)
    if resume is not None and resume.rng is not None:
        set_rng_state(resume.rng)
    return itertools.islice(batches, skip, skip + max(0, fit.epoch_batches - fit.epoch_offset))


def checkpoint_name(epoch: int, step: int, suffix: str = ".pt") -> str:
    """``epoch=EEEEEE-step=SSSSSSSSSS`` + ``suffix`` (".pt" for a file, "" for a directory).

    Zero-padded wide enough (10**6 epochs, 10**10 optimizer steps) that names list in training order;
    rotation does not rely on it (:func:`checkpoint_order`)."""
    return f"epoch={epoch:06d}-step={step:010d}{suffix}"


def checkpoint_order(name: str) -> tuple[int, int] | None:
    """``(epoch, step)`` parsed from a checkpoint's file or directory name (any zero padding), or None
    for a name that is not a checkpoint's."""
    m = _CHECKPOINT.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def mark_last(path: Path, keep_last: int | None) -> None:
    """Point "last" at ``path`` (atomically), then delete all but the ``keep_last`` newest checkpoints."""
    atomic_write_bytes(path.parent / LAST, path.name.encode() + b"\n")
    for stale in path.parent.glob(".*.tmp"):  # left by a process killed while writing (all writes are done here):
        _remove(stale)                         # files, and directories of a killed sharded (fsdp) save
    if keep_last is None:
        return
    # ordered by the parsed (epoch, step), never as text: "step=1000000" < "step=999999" as text
    existing = sorted((order, p) for p in path.parent.iterdir() if (order := checkpoint_order(p.name)))
    existing = [p for _, p in existing]
    for old in existing[:-keep_last] if keep_last > 0 else []:
        if old != path:
            _remove(old)
            Path(f"{old}.sha256").unlink(missing_ok=True)


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy's global generator and torch's (CPU and every CUDA device) with ``seed``.

    ``Trainer.fit`` calls it with ``Trainer(seed=...)`` (default 0) on every rank; in a hand-written
    ``Runtime`` loop, call it yourself (the same seed on every rank, as Lightning's ``seed_everything``).
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _remove(path: Path) -> None:
    """Delete a checkpoint file or a sharded checkpoint directory."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys  # a tensor in checkpoints before 2026-11-22
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
