"""Where metric records go. A sink has two methods: ``write(record)`` and ``close()``.

Only rank zero writes shared sinks, so a file holds one record set per interval, not one per rank.
Every record carries ``kind`` ("step" at log intervals, "epoch" at epoch ends), ``step``, ``epoch``,
``rank`` (a rank number, or "all" for values reduced over ranks) and ``time`` (Unix seconds).

- :class:`JsonlSink` — ``metrics.jsonl``, always: one JSON object per line, nested values kept.
- :class:`CsvSink` — ``metrics_<kind>.csv``, always: one file per record kind, nested dicts
  flattened (``phase_s.data``), lists written as JSON.

Both write through a buffer that reaches the file at least every ``flush_secs`` seconds (5 by
default), at every epoch record and at ``close()`` (the Trainer closes its sinks also when ``fit``
raises). A process killed outright (SIGKILL, out of memory) loses at most the last ``flush_secs``
seconds of step records. Flushing each record cost ~55 µs per file inside a training step here
(one ``write`` system call with cold caches), paid at every log interval.
- :class:`TensorBoardSink` — event files for TensorBoard, on request (``Trainer(tensorboard=True)``,
  ``pip install 'trainscale[tensorboard]'``); every number becomes a scalar ``<kind>/<name>``.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


_STRICT = json.JSONEncoder(allow_nan=False)  # built once: json.dumps(..., allow_nan=False) builds one per call


def _dumps(value: Any) -> str:
    """JSON text, NaN and inf written as strings; the C encoder alone when there are none (the usual case)."""
    try:
        return _STRICT.encode(value)
    except ValueError:
        return json.dumps(_jsonable(value))


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"phase_s": {"data": 1.0}}`` -> ``{"phase_s.data": 1.0}``; other values unchanged."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class _Buffered:
    """The flush rule of the file sinks: at least every ``flush_secs`` seconds, at each record whose
    ``kind`` is not "step", and at close."""

    flush_secs = 5.0
    # -inf, not 0.0: time.monotonic() counts from an arbitrary point (boot on Linux), so on a machine
    # up for less than flush_secs a 0.0 start would keep the first records buffered.
    _flushed = -math.inf

    def _after_write(self, record: dict[str, Any]) -> None:
        now = time.monotonic()
        if record.get("kind") != "step" or now - self._flushed >= self.flush_secs:
            self.flush()
            self._flushed = now

    def flush(self) -> None:
        """Write the buffered records to the file(s) now."""
        raise NotImplementedError


class JsonlSink(_Buffered):
    """Append one JSON object per line to ``path`` (created with its parent directory).

    Lines reach the file as the module docstring says: at least every ``flush_secs`` seconds, at each
    record whose ``kind`` is not "step", and at :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike, flush_secs: float = 5.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_secs = flush_secs
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(_dumps(record) + "\n")
        self._after_write(record)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class CsvSink(_Buffered):
    """One CSV file per record kind: ``<directory>/<stem>_<kind>.csv``.

    The first record of a kind fixes that file's columns; keys that appear later are dropped
    (their values are still in metrics.jsonl) and missing ones are left empty. Rows reach the file
    as the module docstring says (at least every ``flush_secs`` seconds, at each record whose ``kind``
    is not "step", at close). The files of ``kinds`` are opened here, not at their first record (opening a file and reading
    its header took ~0.2 ms, paid inside a training step); one left empty is removed at :meth:`close`.
    """

    def __init__(self, directory: str | os.PathLike, stem: str = "metrics", kinds: tuple[str, ...] = (),
                 flush_secs: float = 5.0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stem = stem
        self.flush_secs = flush_secs
        self._files: dict[str, tuple[Any, list[str] | None]] = {}  # kind: (file, columns of a resumed file)
        self._writers: dict[str, tuple[Any, list[str]]] = {}  # kind: (csv writer, columns)
        for kind in kinds:
            self._open(kind)

    def _open(self, kind: str) -> None:
        path = self.directory / f"{self.stem}_{kind}.csv"
        file = open(path, "a", encoding="utf-8", newline="")
        fields = None
        if file.tell() > 0:  # a resumed run appends under the existing header
            with open(path, encoding="utf-8", newline="") as f:
                fields = next(csv.reader(f))
        self._files[kind] = (file, fields)

    def write(self, record: dict[str, Any]) -> None:
        kind = str(record.get("kind", "record"))
        row = flatten(record)
        if kind not in self._writers:
            if kind not in self._files:
                self._open(kind)
            file, fields = self._files[kind]
            writer = csv.writer(file)
            if fields is None:
                fields = list(row)
                writer.writerow(fields)
            self._writers[kind] = (writer, fields)
        writer, fields = self._writers[kind]
        values = [row.get(name, "") for name in fields]
        writer.writerow([_dumps(v) if isinstance(v, (list, tuple)) else v for v in values])
        self._after_write(record)

    def flush(self) -> None:
        for file, _ in self._files.values():
            file.flush()

    def close(self) -> None:
        for file, _ in self._files.values():
            empty = file.tell() == 0
            file.close()
            if empty:
                os.remove(file.name)
        self._files, self._writers = {}, {}


class TensorBoardSink:
    """Every finite number of a record as a TensorBoard scalar ``<kind>/<name>`` at ``step``.

    Lists (per-rank values) become ``<kind>/<name>/rank<i>``. Uses
    ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package).
    https://pytorch.org/docs/stable/tensorboard.html

    The writer's queue holds ``max_queue`` events (SummaryWriter's default of 10 made the training
    thread wait for the writer thread on every record of ~40 scalars); events reach the file every
    ``flush_secs`` seconds and at :meth:`close`, not at each write (metrics.jsonl is the flushed record).
    """

    def __init__(self, log_dir: str | os.PathLike, flush_secs: float = 10.0, max_queue: int = 1000) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), max_queue=max_queue, flush_secs=flush_secs)

    @staticmethod
    def available() -> bool:
        return importlib.util.find_spec("tensorboard") is not None

    def write(self, record: dict[str, Any]) -> None:
        kind, step = record.get("kind", "record"), int(record.get("step", 0))
        for key, value in flatten(record).items():
            if key in ("step", "epoch", "time", "kind", "rank"):
                continue
            values = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
            for rank, v in values:
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    tag = f"{kind}/{key}" if rank is None else f"{kind}/{key}/rank{rank}"
                    self._writer.add_scalar(tag, v, global_step=step)

    def close(self) -> None:
        self._writer.close()


class MultiSink:
    """Write each record to several sinks."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def default_sinks(run_dir: str | os.PathLike, tensorboard: bool = False) -> MultiSink:
    """metrics.jsonl and metrics_<kind>.csv in ``run_dir``, plus ``run_dir/tensorboard`` when
    ``tensorboard`` is True (False by default: its imports and writer cost memory and time)."""
    run_dir = Path(run_dir)
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl"), CsvSink(run_dir, kinds=("step", "epoch"))]
    if tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    return MultiSink(sinks)
