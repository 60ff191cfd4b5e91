"""Where a run's checkpoints live and which one is "last".

Layout of a run directory::

    <default_root_dir>/version_<N>/
        metrics.jsonl  summary.json
        checkpoints/epoch=2-step=126.ckpt     one file, its SHA-256 inside, written atomically (single, ddp)
        checkpoints/epoch=2-step=126.ckpt/    a sharded DCP directory (fsdp, model_parallel, pp), renamed into place
        checkpoints/last                      the name of the newest complete one
        job_id                                the torchrun/SLURM job that made it
        stacks/rank<R>.txt                    watchdog stack dumps (only after a stall)

Checkpoint names are Lightning's (``epoch=E-step=S.ckpt``, E the epoch being trained, from 0, S the optimizer
steps taken). Runs written before hold ``epoch=EEEEEE-step=SSSSSSSSSS.pt`` files (zero padded, E the epochs
completed) or such directories without a suffix: their "last" still names them, and they still load and resume.

"last" is written only after its checkpoint is on disk, so a crash during a save
leaves the previous checkpoint as "last".
"""

from __future__ import annotations

import os
import shutil
import re
from pathlib import Path

from trainscale.runtime.checkpoint_io import atomic_write_bytes

_VERSION = re.compile(r"^version_(\d+)$")
# Parsed with any zero padding, so the order never depends on the width of the numbers; ".pt" and no suffix: the
# names of the files and directories written before checkpoints took Lightning's extension
_CHECKPOINT = re.compile(r"^epoch=(\d+)-step=(\d+)(?:\.ckpt|\.pt)?$")
EXTENSION = ".ckpt"  # Lightning's ModelCheckpoint.FILE_EXTENSION, of a checkpoint file and a sharded directory alike
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


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is named as a run directory is (``version_N``)."""
    return _VERSION.match(Path(path).name) is not None


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
    with ``script``, only runs of that script (``trainscale.checkpointing.runs.script_key``)."""
    found = find_last_of_run(root, job_id, script)
    return found[0] if found is not None else None


def find_last_of_run(root: str | os.PathLike, job_id: str | None = None,
                     script: str | None = None) -> tuple[Path, Path] | None:
    """As :func:`find_last`, with the run directory whose ``checkpoints/last`` names it: ``(checkpoint, run)``.
    The checkpoint may lie outside the run (a ``ModelCheckpoint(dirpath=...)``: "last" holds its absolute path)."""
    for run in _runs(Path(root), job_id, script):
        pointer = run / "checkpoints" / LAST
        if pointer.is_file():
            return read_last(pointer), run
    return None


def is_last_pointer(path: Path) -> bool:
    """Whether ``path`` is a run's "last" file (a line naming a checkpoint), not a checkpoint itself."""
    path = Path(path)
    return path.name == LAST and path.is_file() and path.stat().st_size < 4096


def read_last(pointer: Path) -> Path:
    """The checkpoint a "last" file names (its name in that directory, or an absolute path).

    Raises:
        FileNotFoundError: "last" is empty or names a checkpoint that is gone; the message lists the intact
            checkpoints beside it and names the newest to pass instead.
    """
    pointer = Path(pointer)
    named = pointer.read_text().strip()
    target = pointer.parent / named if named else None
    if target is not None and target.exists():
        return target
    intact = sorted((p for p in pointer.parent.iterdir() if checkpoint_order(p.name) is not None
                     and (p.is_file() or (p / ".metadata").is_file())),
                    key=lambda p: checkpoint_order(p.name))
    what = f"names {named!r}, which does not exist (deleted or moved)" if named else "is empty"
    instead = (f"the intact checkpoints beside it: {', '.join(p.name for p in intact)}; resume from the newest with "
               f"ckpt_path={str(intact[-1])!r}" if intact else
               "no intact checkpoint is beside it: pass ckpt_path=None to start fresh")
    raise FileNotFoundError(f"{str(pointer)!r} {what}; {instead}")


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


def checkpoint_name(epoch: int, step: int) -> str:
    """``epoch=E-step=S.ckpt``: Lightning's default checkpoint name (``ModelCheckpoint``'s ``"{epoch}-{step}"``
    template + ``FILE_EXTENSION``), ``epoch`` the epoch being trained (``trainer.current_epoch``, from 0), ``step``
    the optimizer steps taken; the same for a file and a sharded directory. Not padded: order by
    :func:`checkpoint_order`, not by name."""
    return f"epoch={epoch}-step={step}{EXTENSION}"


def checkpoint_order(name: str) -> tuple[int, int] | None:
    """``(epoch, step)`` parsed from a checkpoint's file or directory name (any zero padding), or None
    for a name that is not a checkpoint's."""
    m = _CHECKPOINT.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def mark_last(path: Path, last_dir: Path) -> None:
    """Point ``last_dir/last`` at ``path`` atomically (its name when it lies in ``last_dir``, else its absolute
    path), and delete the temporary files of writes that a killed process left in ``path``'s directory."""
    name = path.name if path.parent.resolve() == Path(last_dir).resolve() else str(path.resolve())
    atomic_write_bytes(Path(last_dir) / LAST, name.encode() + b"\n")
    for stale in path.parent.glob(".*.tmp"):  # left by a process killed while writing (all writes are done here):
        remove_checkpoint(stale)               # files, and directories of a killed sharded (fsdp) save


def link_last(path: Path, link: Path) -> None:
    """Make ``link`` (a ``ModelCheckpoint``'s ``last.ckpt``) a symbolic link to checkpoint ``path`` (a file or a
    sharded directory), relative when both lie in one directory; replaced atomically (a new link renamed over it),
    so a reader sees the old or the new target, never none. Lightning's ``save_last="link"``
    (``ModelCheckpoint._link_checkpoint``). Where the file system refuses symbolic links (some FUSE and SMB
    mounts), a copy of the checkpoint takes the link's place, as Lightning's falls back to ``shutil.copy``: a file
    (its SHA-256 inside, so the copy verifies) renamed over the old one atomically; a sharded directory replaces
    the old entry after it is removed.

    Raises:
        OSError: the copy fails too (a full disk).
    """
    link = Path(link)
    target = path.name if path.parent.resolve() == link.parent.resolve() else str(path.resolve())
    tmp = link.parent / f".{link.name}.link.tmp"
    remove_checkpoint(tmp)
    try:
        os.symlink(target, tmp)
    except OSError:
        if path.is_dir():
            shutil.copytree(path, tmp, symlinks=True)
        else:
            shutil.copyfile(path, tmp)
    if tmp.is_dir() and not tmp.is_symlink():  # rename(2) puts a directory only where no entry (or an empty one) is
        remove_checkpoint(link)
    os.replace(tmp, link)


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint file (and the ``.sha256`` file beside it of one written before the digest moved inside)
    or a sharded checkpoint directory."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
        Path(f"{path}.sha256").unlink(missing_ok=True)


