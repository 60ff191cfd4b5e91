"""``CSVLogger``: ``metrics.csv`` and ``hparams.json`` in the run directory or Lightning's ``save_dir/name/version_N``.
Needs nothing beyond Python."""

from __future__ import annotations

import csv
import io
import json
import os
import time
from argparse import Namespace
from pathlib import Path
from typing import Any, Mapping

from trainscale.loggers.base import check_status, experiment_or_dummy
from trainscale.loggers.log_dirs import VersionedDir, add_prefix


class CSVLogger(VersionedDir):
    """One row per ``log_metrics`` call in ``<log_dir>/metrics.csv``; hyperparameters in ``<log_dir>/hparams.json``.

    Where: with a ``save_dir``, Lightning's ``save_dir/name/version_N`` (``CSVLogger("logs", name="exp")`` writes
    ``logs/exp/version_0``, then ``version_1`` for the next run; see ``trainscale.loggers.log_dirs``); without one
    (the default) the run directory (``runs/version_N``). ``name``, ``version``, ``root_dir``, ``log_dir`` and
    ``save_dir`` are Lightning's properties (paths as strings). A version directory that holds files of another run
    is refused at :meth:`setup` (Lightning deletes that run's ``metrics.csv`` with a warning); a resumed run continues
    in its own.

    The columns are ``step`` and then the union of all metric names, in the order they first appeared
    (Lightning's CSVLogger, ``lightning.pytorch.loggers.csv_logs``, sorts them); a row leaves the metrics it lacks
    empty. When a new name appears, the file is rewritten once with the wider header (a temporary file
    renamed over it); a resumed run appends under the existing header. Rows are buffered and reach the
    file when ``flush_secs`` seconds or ``flush_logs_every_n_steps`` steps have passed since the last write (the
    first row at once), and at :meth:`finalize`. ``prefix`` goes before every metric name as Lightning's
    (``prefix-name``). Hyperparameters: one JSON object, nested keys kept, values JSON cannot hold written as strings
    (Lightning writes ``hparams.yaml``).

    The Trainer calls a logger on rank zero only (see :class:`trainscale.loggers.Logger`).

    Args:
        save_dir: the directory of the experiments; None (the default): the run directory given to :meth:`setup`.
        name: the experiment's directory under ``save_dir`` (None or "": none); needs a ``save_dir``.
        version: None: the next free ``version_N``; an int ``N``: ``version_N``; a string: that directory's name;
            needs a ``save_dir``.
        prefix: put before every metric name, joined by "-" (Lightning's ``LOGGER_JOIN_CHAR``).
        flush_logs_every_n_steps: the most global steps a row waits in memory (Lightning's argument).
        flush_secs: the longest time, in seconds, a row waits in memory; 0 writes each row at once.

    Raises:
        ValueError: a negative ``flush_secs``, a ``flush_logs_every_n_steps`` below 1, a ``name`` or ``version``
            without a ``save_dir``; a ``save_dir`` that is a file or cannot be written.
    """

    def __init__(self, save_dir: str | os.PathLike | None = None, name: str | None = "lightning_logs",
                 version: int | str | None = None, prefix: str = "", flush_logs_every_n_steps: int = 100,
                 flush_secs: float = 5.0) -> None:
        if flush_secs < 0:
            raise ValueError(f"CSVLogger(flush_secs={flush_secs!r}): give a number of seconds >= 0")
        if flush_logs_every_n_steps < 1:
            raise ValueError(f"CSVLogger(flush_logs_every_n_steps={flush_logs_every_n_steps!r}): give a number of "
                             "steps >= 1")
        super().__init__("CSVLogger", save_dir, name, version)
        self.prefix, self.flush_secs, self.flush_logs_every_n_steps = prefix, flush_secs, flush_logs_every_n_steps
        self.path: Path | None = None  # metrics.csv, known after setup
        self._columns: list[str] = []  # the header the rows need
        self._file_columns: list[str] = []  # the header in the file
        self._rows: list[dict[str, Any]] = []
        self._hparams: dict[str, Any] = {}
        self._flushed = float("-inf")  # time.monotonic() of the last write
        self._flushed_step = float("-inf")  # the step of the last row written
        self._logged = 0  # rows logged by this logger object

    @property
    def experiment(self) -> CSVLogger:
        """The logger itself (Lightning's is its ``ExperimentWriter``: ``log_metrics``, ``save``), after setup; on the
        other ranks a no-op ``DummyExperiment``. Read on rank zero before setup, a logger with a ``save_dir`` sets
        itself up there without a run, as Lightning's does at its first use.

        Raises:
            RuntimeError: on rank zero, before setup, without a ``save_dir``.
            FileExistsError: the version directory holds files of another run.
        """
        if self.path is None and self.writes_alone():
            self._open(self.claim(None))
        return experiment_or_dummy(self if self.path is not None else None, "CSVLogger")

    def setup(self, run_dir: str | os.PathLike) -> None:
        """Choose (or continue in) :attr:`log_dir` for the run ``run_dir`` and read what a resumed run wrote there.

        Raises:
            FileExistsError: the version directory holds files of another run (``log_dirs.VersionedDir.claim``).
        """
        self._open(self.claim(run_dir))

    def _open(self, directory: Path) -> None:
        """Write to ``directory`` from now on, under the header of its ``metrics.csv`` if there is one."""
        self.flush()  # rows logged before setup (Lightning's first use) go where they were meant to
        self.path = directory / "metrics.csv"
        self._file_columns = _header(self.path)
        self._columns = list(self._file_columns) or ["step"]
        self._rows, self._flushed, self._flushed_step = [], float("-inf"), float("-inf")
        hparams = directory / "hparams.json"
        self._hparams = json.loads(hparams.read_text()) if hparams.is_file() else {}

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace | None = None) -> None:
        """Merge ``params`` (a dict, an ``argparse.Namespace`` or None, as Lightning's) into ``hparams.json``; nothing
        on a rank other than zero.

        Raises:
            RuntimeError: before setup on rank zero, without a ``save_dir``.
        """
        if self.experiment is not self:  # another rank
            return
        self._hparams.update(vars(params) if isinstance(params, Namespace) else params or {})
        _replace(self.path.with_name("hparams.json"), json.dumps(self._hparams, indent=2, default=str) + "\n")

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """One row: ``step`` (None: the number of rows this logger has logged before, from 0), then ``metrics``, each
        name after ``prefix``; nothing on a rank other than zero.

        Raises:
            RuntimeError: before setup on rank zero, without a ``save_dir``.
        """
        if self.path is None:  # not set up: on another rank nothing (Lightning's loggers log on rank zero only)
            self.experiment  # noqa: B018  (on rank zero: the "not set up" error)
            return
        step = self._logged if step is None else step
        row = {"step": step, **(add_prefix(metrics, self.prefix) if self.prefix else metrics)}
        self._columns.extend(name for name in row if name not in self._columns)
        self._rows.append(row)
        self._logged += 1
        now = time.monotonic()
        if now - self._flushed >= self.flush_secs or step - self._flushed_step >= self.flush_logs_every_n_steps:
            self.flush()
            self._flushed, self._flushed_step = now, step

    def save(self) -> None:
        """Lightning's name for :meth:`flush`."""
        self.flush()

    def flush(self) -> None:
        """Write the buffered rows to metrics.csv now."""
        if not self._rows or self.path is None:
            return
        if self._file_columns and self._columns != self._file_columns:  # a new name: widen the header
            with open(self.path, encoding="utf-8", newline="") as f:
                old = list(csv.DictReader(f))
            _replace(self.path, _csv_text(self._columns, old + self._rows))
        else:
            with open(self.path, "a", encoding="utf-8", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self._columns, restval="")
                if not self._file_columns:
                    writer.writeheader()
                writer.writerows(self._rows)
        self._file_columns, self._rows = list(self._columns), []

    def finalize(self, status: str) -> None:
        check_status(status)
        self.flush()


def _header(path: Path) -> list[str]:
    """The first row of the CSV file at ``path``; [] when it is missing or empty."""
    if not path.is_file():
        return []
    with open(path, encoding="utf-8", newline="") as f:
        return next(csv.reader(f), [])


def _csv_text(columns: list[str], rows: list[Mapping[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, restval="")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8", newline="")
    os.replace(tmp, path)
