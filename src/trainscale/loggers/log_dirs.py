"""Where a file logger (CSV, TensorBoard) writes: Lightning's ``save_dir/name/version_N`` layout, or the run directory.

Lightning's rules (``lightning.fabric.loggers.csv_logs`` and ``tensorboard``, ``_get_next_version``): a logger given a
``save_dir`` writes to ``save_dir/name/version_N``, where ``version=None`` takes one more than the largest ``N`` of the
``version_N`` directories there (0 when none), an int ``N`` means ``version_N`` and a string is the directory's own
name; ``name`` None or "" puts the versions directly in ``save_dir``. Without a ``save_dir`` (trainscale's default) a
logger writes into the run directory (``<default_root_dir>/version_N``), which is then its ``save_dir/version_N`` with
``name=""``.

What trainscale adds: rank zero chooses the version and every rank takes it (:func:`agree_log_dirs`), so
``logger.version`` and ``trainer.log_dir`` agree on every rank without a collective at each read; a resumed run
continues in the version directory its run recorded (``<run dir>/logger_dirs``); and a version directory that holds
files of another run is refused (Lightning warns and deletes that run's ``metrics.csv``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping

from trainscale.loggers.base import check_save_dir, not_set_up, process_rank

LOGGER_JOIN_CHAR = "-"  # Lightning's: ``prefix-key``
RECORD_FILE = "logger_dirs"  # in the run directory: the version directories this run's loggers wrote, one a line
_LIGHTNING_NAME = "lightning_logs"


def add_prefix(metrics: Mapping[str, Any], prefix: str, sep: str = LOGGER_JOIN_CHAR) -> Mapping[str, Any]:
    """Lightning's ``_add_prefix``: ``{"loss": 1}`` with prefix "train" -> ``{"train-loss": 1}``; no prefix: as given."""
    return {f"{prefix}{sep}{key}": value for key, value in metrics.items()} if prefix else metrics


def next_version(root: Path) -> int:
    """One more than the largest ``N`` of the ``version_N`` directories in ``root``; 0 when there is none or no
    ``root`` (Lightning's ``_get_next_version``, whose rule it copies: the part after the first "_" must be digits)."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return 0
    found = [int(p.name.split("_")[1]) for p in entries
             if p.name.startswith("version_") and p.name.split("_")[1].isdigit() and p.is_dir()]
    return max(found) + 1 if found else 0


def version_of(directory_name: str) -> int | str:
    """``"version_3"`` -> 3; any other directory name is its own version (Lightning's string version)."""
    number = directory_name[len("version_"):]
    return int(number) if directory_name.startswith("version_") and number.isdigit() else directory_name


def recorded_dirs(run_dir: Path) -> list[Path]:
    """The version directories the run ``run_dir`` wrote to (absolute), as recorded in ``run_dir/logger_dirs``."""
    path = run_dir / RECORD_FILE
    return [Path(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def _absolute(path: str | os.PathLike) -> Path:
    """``path`` absolute and normalized ("a/../b" -> "b"), links kept: how the record names directories."""
    return Path(os.path.abspath(path))


def _record_dir(run_dir: Path, directory: Path) -> None:
    if directory in recorded_dirs(run_dir):
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / RECORD_FILE, "a", encoding="utf-8") as f:
        f.write(f"{directory}\n")


class VersionedDir:
    """What CSVLogger and TensorBoardLogger share: Lightning's ``name``, ``version``, ``root_dir``, ``log_dir`` and
    ``save_dir`` (paths as strings, as Lightning's), and the choice of the version directory.

    ``in_run_dir``: the logger's directory inside the run directory when it has no ``save_dir`` ("" for the run
    directory itself); ``sub_dir``: a directory under the version directory (TensorBoard's ``sub_dir``).

    Raises:
        ValueError: a ``version``, or a ``name`` other than Lightning's default, without a ``save_dir`` (they name
            a directory under ``save_dir``); a ``save_dir`` that is a file or cannot be written.
    """

    def __init__(self, owner: str, save_dir: str | os.PathLike | None, name: str | None, version: int | str | None,
                 in_run_dir: str = "", sub_dir: str | os.PathLike | None = None) -> None:
        if save_dir is None and (version is not None or (name or "") not in ("", _LIGHTNING_NAME)):
            raise ValueError(f"{owner}(name={name!r}, version={version!r}) without a save_dir: name and version name "
                             f"a directory under save_dir; pass one ({owner}('logs', name=..., version=...) writes "
                             "logs/<name>/version_<N>), or leave both out to write into the run directory")
        self._owner = owner
        self._save_dir = os.path.expanduser(os.fspath(save_dir)) if save_dir is not None else None
        check_save_dir(owner, Path(self._save_dir) if save_dir is not None else None)
        self._name = (name or "") if save_dir is not None else ""
        self._given_version = version
        self._version = version
        self._in_run_dir, self._sub_dir = in_run_dir, sub_dir
        self._run_dir: Path | None = None  # the run this logger writes for, once known
        self._written: set[Path] = set()  # the version directories this logger object has written to

    @property
    def name(self) -> str:
        """The experiment's name: the directory under ``save_dir`` that holds the versions ("" for none)."""
        return self._name

    @property
    def save_dir(self) -> str | None:
        """The directory given; without one, the directory that holds the run directories (None before a run)."""
        if self._save_dir is not None:
            return self._save_dir
        return str(self._run_dir.parent) if self._run_dir is not None else None

    @property
    def root_dir(self) -> str | None:
        """``save_dir/name``: the directory of the versions (None before a run, without a save_dir)."""
        save_dir = self.save_dir
        return os.path.join(save_dir, self._name) if save_dir is not None and self._name else save_dir

    @property
    def version(self) -> int | str | None:
        """The version: the one given, else the next free one in :attr:`root_dir` (Lightning's, computed at the first
        read and kept); once a fit starts, rank zero's choice on every rank. Without a save_dir: the run directory's
        (``version_3`` -> 3), None before a run."""
        if self._version is None and self._save_dir is not None:
            self._version = next_version(Path(self.root_dir))
        return self._version

    @property
    def log_dir(self) -> str | None:
        """Where the files go: ``root_dir/version_<N>`` (or ``root_dir/<version>`` for a string version), then
        ``sub_dir``; without a save_dir the run directory (and the logger's place in it). None before a run."""
        return self.log_dir_in(self._run_dir)

    def log_dir_in(self, run_dir: str | os.PathLike | None) -> str | None:
        """:attr:`log_dir` in the run ``run_dir``: without a save_dir, ``run_dir`` and the logger's place in it (None
        for ``run_dir`` None); with one, the same whatever ``run_dir``. ``trainer.log_dir`` reads it before the first
        fit, with the run directory that fit will take."""
        if self._save_dir is None:
            if run_dir is None:
                return None
            base = os.path.join(run_dir, self._in_run_dir) if self._in_run_dir else str(run_dir)
        else:
            version = self.version
            base = os.path.join(self.root_dir, version if isinstance(version, str) else f"version_{version}")
        return os.path.join(base, self._sub_dir) if self._sub_dir is not None else base

    def choose_version(self, run_dir: str | os.PathLike) -> int | str:
        """The version this logger takes in the run ``run_dir`` (rank zero decides; :func:`agree_log_dirs`): the one
        given; else the version directory the run recorded (a resumed run continues there); else the one this logger
        has (an earlier fit's, or read before); else the run directory's own when ``root_dir`` is the directory of the
        run directories (``CSVLogger(default_root_dir, name="")`` writes into the run directory); else the next free
        one."""
        run_dir = _absolute(run_dir)
        if self._save_dir is None:
            return version_of(run_dir.name)
        if self._given_version is not None:
            return self._given_version
        root = _absolute(self.root_dir)
        for directory in recorded_dirs(run_dir):
            if directory.parent == root:
                return version_of(directory.name)
        if self._version is None and root == run_dir.parent:
            return version_of(run_dir.name)
        return self.version

    def bind(self, run_dir: str | os.PathLike, version: int | str) -> None:
        """Write for the run ``run_dir`` in ``version`` (every rank, with rank zero's choice)."""
        self._run_dir, self._version = Path(run_dir), version

    def adopt(self, run_dir: str | os.PathLike, version: int | str) -> None:
        """Take the directory this logger's copy wrote to in a spawned rank zero (``ddp_spawn``) as this logger's own:
        ``log_dir`` then names it here, and a later fit with this logger continues there."""
        self.bind(run_dir, version)
        if self._save_dir is not None:
            self._written.add(self._version_dir())

    def claim(self, run_dir: str | os.PathLike | None) -> Path:
        """At ``setup`` (rank zero): bind to ``run_dir`` unless bound to it, refuse a version directory that holds
        another run's files, record it in the run directory and make :attr:`log_dir`. Returns it. ``run_dir`` None:
        the logger is used alone, without a run (Lightning's ``CSVLogger("logs").log_metrics(...)``; needs a
        ``save_dir``): nothing is recorded.

        Raises:
            FileExistsError: the version directory holds files that neither this run nor this logger wrote,
                naming it and the fixes.
        """
        if run_dir is not None and (self._run_dir is None or _absolute(self._run_dir) != _absolute(run_dir)):
            self.bind(run_dir, self.choose_version(run_dir))
        refusal = self.refusal()
        if refusal is not None:
            raise FileExistsError(refusal)
        version_dir = self._version_dir()
        if self._save_dir is not None:
            if self._run_dir is not None and version_dir != _absolute(self._run_dir):
                _record_dir(_absolute(self._run_dir), version_dir)
            self._written.add(version_dir)
        log_dir = Path(self.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        return log_dir

    def _version_dir(self) -> Path:
        log_dir = Path(self.log_dir)
        return _absolute(log_dir.parent if self._sub_dir is not None else log_dir)

    def refusal(self) -> str | None:
        """Why this logger may not write to its version directory, once bound: it holds files of another run (not
        this logger's, not recorded by this run, not the run directory itself); None when it may."""
        if self._save_dir is None:
            return None
        version_dir, run = self._version_dir(), _absolute(self._run_dir) if self._run_dir is not None else None
        if version_dir == run or version_dir in self._written or (run is not None and version_dir in recorded_dirs(run)):
            return None
        if not (version_dir.is_dir() and any(version_dir.iterdir())):
            return None
        return (f"{self._owner}(version={self._version!r}): {version_dir} holds files of another run "
                f"({', '.join(sorted(p.name for p in version_dir.iterdir())[:4])}); trainscale never writes over "
                f"another run's files: pass version=None for the next free version "
                f"(version_{next_version(version_dir.parent)}), another version, or move that directory away")

    def writes_alone(self) -> bool:
        """For a call before ``setup``, as Lightning's loggers take it: True on rank zero with a ``save_dir`` (the
        caller then sets up with ``claim(None)``); False on another rank (Lightning's loggers log on rank zero only).

        Raises:
            RuntimeError: rank zero, without a ``save_dir`` (the run directory is known at ``setup``).
        """
        if process_rank() != 0:
            return False
        if self._save_dir is None:
            raise not_set_up(self._owner)
        return True


def agree_log_dirs(loggers: list, run_dir: str | os.PathLike, broadcast: Callable[[Any], Any],
                   is_rank_zero: bool) -> None:
    """Give every rank's CSV and TensorBoard loggers rank zero's version for the run ``run_dir``: rank zero chooses
    (:meth:`VersionedDir.choose_version`), ``broadcast`` (``Runtime.broadcast_object``) hands the choices to the other
    ranks. A collective when one of them has a ``save_dir`` (every rank holds the same loggers); without one, the
    version is the run directory's, the same on every rank. Lightning broadcasts ``trainer.log_dir`` at each read
    instead.

    Raises:
        FileExistsError: on every rank together, when a version directory holds another run's files
            (:meth:`VersionedDir.refusal`), before anything is written.
    """
    placed = [lg for lg in loggers if isinstance(lg, VersionedDir)]
    local = all(lg._save_dir is None for lg in placed)
    refusal = None
    if is_rank_zero or local:
        versions = [lg.choose_version(run_dir) for lg in placed]
        for lg, version in zip(placed, versions):
            lg.bind(run_dir, version)
        refusal = next((r for r in (lg.refusal() for lg in placed) if r is not None), None)
    if not local:
        versions, refusal = broadcast((versions, refusal) if is_rank_zero else None)
    for lg, version in zip(placed, versions):
        lg.bind(run_dir, version)
    if refusal is not None:
        raise FileExistsError(refusal)


def trainer_log_dir(loggers: list, run_dir: Path | None, root_dir: str | os.PathLike) -> str | None:
    """Lightning's ``trainer.log_dir``: without a logger ``root_dir`` (``default_root_dir``); else the first logger's
    ``log_dir`` (CSV, TensorBoard: with ``sub_dir``; without a ``save_dir``, its place in ``run_dir`` until a fit binds
    it), another first logger's ``save_dir``; where that is None (W&B, MLflow writing into the run directory)
    ``run_dir``. ``run_dir`` None (the run writes no files): None, as Lightning's for its ``DummyLogger``."""
    if not loggers:
        return str(root_dir)
    first = loggers[0]
    if isinstance(first, VersionedDir):  # bound to the last fit's run, else placed in run_dir (before the first fit)
        found = first.log_dir or first.log_dir_in(run_dir)
    else:
        found = getattr(first, "save_dir", None)
    if found is not None:
        return str(found)
    return str(run_dir) if run_dir is not None else None
