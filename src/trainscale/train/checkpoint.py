"""Where a run's checkpoints live, which one is "last", and the RNG state that goes in them.

Layout of a run directory::

    <default_root_dir>/version_<N>/
        metrics.jsonl  summary.json
        checkpoints/epoch=0002-step=000126.pt  (+ .sha256)   written atomically (single, ddp)
        checkpoints/epoch=0002-step=000126/                  a sharded DCP directory (fsdp), renamed into place
        checkpoints/last                                     the name of the newest complete one

"last" is written only after its checkpoint and checksum are on disk, so a crash during a save
leaves the previous checkpoint as "last".
"""

from __future__ import annotations

import os
import random
import shutil
import re
from pathlib import Path

import numpy as np
import torch

from trainscale.runtime.checkpoint_io import atomic_write_bytes

_VERSION = re.compile(r"^version_(\d+)$")
LAST = "last"


def next_run_dir(root: str | os.PathLike) -> Path:
    """``root/version_N`` with N one more than the largest existing (0 for the first)."""
    root = Path(root)
    versions = [int(m.group(1)) for p in (root.iterdir() if root.is_dir() else []) if (m := _VERSION.match(p.name))]
    return root / f"version_{max(versions, default=-1) + 1}"


def find_last(root: str | os.PathLike) -> Path | None:
    """The "last" checkpoint of the newest run under ``root`` that has one, or None."""
    root = Path(root)
    runs = sorted(((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
                   if (m := _VERSION.match(p.name))), reverse=True)
    for _, run in runs:
        pointer = run / "checkpoints" / LAST
        if pointer.is_file():
            return run / "checkpoints" / pointer.read_text().strip()
    return None


def checkpoint_name(epoch: int, step: int, suffix: str = ".pt") -> str:
    """``epoch=EEEE-step=SSSSSS`` + ``suffix`` (".pt" for a file, "" for a directory)."""
    return f"epoch={epoch:04d}-step={step:06d}{suffix}"


def mark_last(path: Path, keep_last: int | None) -> None:
    """Point "last" at ``path`` (atomically), then delete all but the ``keep_last`` newest checkpoints."""
    atomic_write_bytes(path.parent / LAST, path.name.encode() + b"\n")
    if keep_last is None:
        return
    existing = sorted(p for p in path.parent.glob("epoch=*-step=*") if p.suffix != ".sha256")
    for old in existing[:-keep_last] if keep_last > 0 else []:
        if old == path:
            continue
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
            Path(f"{old}.sha256").unlink(missing_ok=True)


def rng_state() -> dict:
    """This process's RNG states (torch CPU and CUDA, numpy, Python), in types ``weights_only`` loads."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore states made by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
