"""Which checkpoint a ``fit`` resumes and which run directory it writes to.

Rules (docs/fault-tolerance.md): "last" is the newest checkpoint of *this script's* newest run under
``default_root_dir`` (a first run warns and starts fresh, as Lightning does); after a torchrun restart
or a SLURM requeue, this job's "last". A run continues in its own directory only when it resumes that
run's newest checkpoint; resuming any other checkpoint starts a new ``version_N`` under
``default_root_dir`` and records where it came from, so no file of another run is ever overwritten.
Rank zero holds an advisory lock (``fcntl.flock`` on ``<run>/.lock``) on the run directory it writes to
for the whole ``fit``: a second process that would continue the same run (two ``ckpt_path="last"`` started
together) finds it held and starts a new ``version_N`` instead. The kernel drops the lock when the process
dies, so a restart after a crash continues in place.
"""

from __future__ import annotations

import fcntl
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainscale.runtime.checkpoint_io import refuse_url
from trainscale.checkpointing import run_dirs as ckpt

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime


def script_key() -> str:
    """What ties a run to the program that made it: the absolute path of the running script."""
    return str(Path(sys.argv[0]).resolve()) if sys.argv and sys.argv[0] else "<interactive>"


def as_ckpt_path(path: Path | None) -> str | None:
    """A checkpoint's path as Lightning's ``trainer.ckpt_path`` holds it: a str, None for none."""
    return None if path is None else str(path)


def resolve_ckpt_path(runtime: Runtime, ckpt_path: Any, root: Path) -> tuple[Path | None, Path | None]:
    """The checkpoint to resume from, and the run directory continued in place (None: a new ``version_N``).

    Raises:
        FileNotFoundError: an explicit ``ckpt_path`` that does not exist (checked on every rank).
        ValueError: ``ckpt_path`` of another type, or a URL (``s3://...``: local files only).
    """
    world = runtime.world
    if ckpt_path is None and world.restart_count > 0:
        if world.job_id in (None, "", "none"):  # any run would match: never resume another job's "last"
            runtime.print("trainscale: restarted without a job id (pass --rdzv-id): starting over")
            return None, None
        found = ckpt.find_last_of_run(root, job_id=world.job_id)
        runtime.print(f"trainscale: restart {world.restart_count} of job {world.job_id}: "
                      + (f"resuming from {found[0]}" if found else "no checkpoint yet, starting over"))
        return found if found is not None else (None, None)
    if ckpt_path is None:
        return None, None
    if ckpt_path == "last":
        found = ckpt.find_last_of_run(root, script=script_key())
        if found is None:
            warnings.warn(f"ckpt_path='last' but no run of {script_key()} under {str(root)!r} has a checkpoint; "
                          "starting fresh. No checkpoint will be loaded: pass a checkpoint file to resume from one",
                          stacklevel=4)
        return found if found is not None else (None, None)
    if not isinstance(ckpt_path, (str, Path)):
        raise ValueError(f"ckpt_path={ckpt_path!r}; pass a checkpoint path, 'last', or None")
    refuse_url("ckpt_path", ckpt_path)
    path = Path(ckpt_path)
    if path.is_symlink():  # a ModelCheckpoint's last.ckpt: the checkpoint it names (its run continues in place)
        path = path.resolve()
    if ckpt.is_last_pointer(path):  # <run>/checkpoints/last: the checkpoint it names
        path = ckpt.read_last(path)
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={str(path)!r} does not exist; pass an existing checkpoint file, 'last', "
                                "or None to start fresh")
    return path, path.parent.parent if _is_newest_of_its_run(path, root) else None


def _is_newest_of_its_run(path: Path, root: Path) -> bool:
    run = path.parent.parent
    if path.parent.name != "checkpoints" or run.parent.resolve() != root.resolve():
        return False
    pointer = path.parent / ckpt.LAST
    return pointer.is_file() and pointer.read_text().strip() == path.name


def run_of(path: Path) -> Path | None:
    """The run directory ``path`` lies in (the nearest parent ``version_N`` holding a run's lock file or the
    script that made it), or None outside every run."""
    for parent in Path(path).resolve().parents:
        if ckpt.is_run_dir(parent) and ((parent / RunLock.FILE).is_file() or (parent / ckpt.SCRIPT).is_file()):
            return parent
    return None


def overwrite_refusal(target: Path, own_run: Path | None, overwrite: bool) -> str | None:
    """Why ``trainer.save_checkpoint(target)`` must not write, or None when it may.

    A checkpoint (or its ``.sha256``) that already exists is replaced only with ``overwrite=True``; one that belongs
    to another run's directory never is (that run's "best", "last" and resumes would load foreign weights that
    still verify)."""
    existing = [p for p in (Path(target), Path(f"{target}.sha256")) if p.exists() or p.is_symlink()]
    if not existing:
        return None
    owner = run_of(existing[0])
    if owner is not None and (own_run is None or owner != Path(own_run).resolve()):
        return (f"save_checkpoint: {existing[0]} belongs to another run ({owner}) and is never overwritten; save to a "
                f"path of this run's own (e.g. trainer.run_dir / 'checkpoints' / 'final.ckpt') or a new file")
    if not overwrite:
        return (f"save_checkpoint: {existing[0]} already exists; pass overwrite=True to replace it, or choose a new "
                "path")
    return None


class RunLock:
    """Rank zero's advisory lock on a run directory (``fcntl.flock`` of ``<run>/.lock``), held until
    :meth:`release` or the process's end. The lock file stays (removing it would let two holders lock two
    different files)."""

    FILE = ".lock"

    def __init__(self, fd: int | None = None) -> None:
        self._fd = fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock | None:
        """The lock of ``run_dir``, or None when another process holds it."""
        fd = os.open(run_dir / cls.FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return cls(fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def choose_run_dir(runtime: Runtime, root: Path, resume_from: Path | None,
                   in_place: Path | None) -> tuple[Path, RunLock]:
    """The run directory (same on every rank; made by rank 0) and rank zero's lock on it (an unheld
    :class:`RunLock` on other ranks): ``in_place`` (the resumed run's own directory) when given, a restarted job's directory, or
    a new ``version_N`` claimed atomically. A run whose lock another process holds is not continued: a new
    ``version_N`` records ``resumed_from`` instead. A collective."""
    rt = runtime
    run_dir, lock = None, RunLock()
    if rt.is_rank_zero:
        if in_place:
            run_dir = in_place
        elif rt.world.restart_count > 0 and rt.world.job_id:
            run_dir = ckpt.find_job_run(root, rt.world.job_id)
        if run_dir is not None and (lock := RunLock.acquire(run_dir)) is None:
            rt.print(f"trainscale: {run_dir} is in use by another process (it holds {run_dir / RunLock.FILE}); "
                     "continuing in a new run directory")
            run_dir, in_place = None, None
        if run_dir is None:
            run_dir = ckpt.claim_run_dir(root)
            lock = RunLock.acquire(run_dir)  # a directory just made: no other process holds it
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        ckpt.write_job_id(run_dir, rt.world.job_id)
        ckpt.write_script(run_dir, script_key())
        if resume_from is not None and not in_place:
            ckpt.write_resumed_from(run_dir, resume_from)
    return Path(rt.broadcast_object(str(run_dir) if run_dir is not None else None)), lock
