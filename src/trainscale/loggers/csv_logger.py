"""``CSVLogger``: ``metrics.csv`` and ``hparams.json`` in the run directory. Needs nothing beyond Python."""

from __future__ import annotations

import csv
import io
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

from trainscale.loggers.base import check_save_dir, check_status, not_set_up


class CSVLogger:
    """One row per ``log_metrics`` call in ``<dir>/metrics.csv``; hyperparameters in ``<dir>/hparams.json``.

    The columns are ``step`` and then the union of all metric names, in the order they first appeared
    (Lightning's CSVLogger, ``lightning.pytorch.loggers.csv_logs``); a row leaves the metrics it lacks
    empty. When a new name appears, the file is rewritten once with the wider header (a temporary file
    renamed over it); a resumed run appends under the existing header. Rows are buffered and reach the
    file at least every ``flush_secs`` seconds (the first row at once), and at :meth:`finalize`.
    Hyperparameters: one JSON object, nested keys kept, values JSON cannot hold written as strings.

    The Trainer calls a logger on rank zero only (see :class:`trainscale.loggers.Logger`).

    Args:
        save_dir: the directory of the two files; None (the default): the run directory given to
            :meth:`setup`.
        flush_secs: the longest time, in seconds, a row waits in memory; 0 writes each row at once.

    Raises:
        ValueError: a negative ``flush_secs``; a ``save_dir`` that is a file or cannot be written.
    """

    def __init__(self, save_dir: str | os.PathLike | None = None, flush_secs: float = 5.0) -> None:
        if flush_secs < 0:
            raise ValueError(f"CSVLogger(flush_secs={flush_secs!r}): give a number of seconds >= 0")
        self.save_dir = Path(save_dir) if save_dir is not None else None
        check_save_dir("CSVLogger", self.save_dir)
        self.flush_secs = flush_secs
        self.path: Path | None = None  # metrics.csv, known after setup
        self._columns: list[str] = []  # the header the rows need
        self._file_columns: list[str] = []  # the header in the file
        self._rows: list[dict[str, Any]] = []
        self._hparams: dict[str, Any] = {}
        self._flushed = float("-inf")

    def setup(self, run_dir: str | os.PathLike) -> None:
        directory = self.save_dir or Path(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "metrics.csv"
        self._file_columns = _header(self.path)
        self._columns = list(self._file_columns) or ["step"]
        self._rows, self._flushed = [], float("-inf")
        hparams = directory / "hparams.json"
        self._hparams = json.loads(hparams.read_text()) if hparams.is_file() else {}

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        if self.path is None:
            raise not_set_up("CSVLogger")
        self._hparams.update(params)
        _replace(self.path.with_name("hparams.json"), json.dumps(self._hparams, indent=2, default=str) + "\n")

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self.path is None:
            raise not_set_up("CSVLogger")
        row = {"step": step, **metrics}
        self._columns.extend(name for name in row if name not in self._columns)
        self._rows.append(row)
        now = time.monotonic()
        if now - self._flushed >= self.flush_secs:
            self.flush()
            self._flushed = now

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
