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
  ``pip install 'trainscale[tensorboard]'``); every metric of :func:`record_metrics` becomes a scalar
  (``<kind>/<name>``, the names trainscale.loggers receive too).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import numbers
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


def flatten(record: dict[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """``{"phase_s": {"data": 1.0}}`` -> ``{"phase_s.data": 1.0}`` (``sep`` joins the keys); other values
    unchanged."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}{sep}", sep))
        else:
            out[f"{prefix}{key}"] = value
    return out


# Record fields that are not metrics: the position (``step`` is passed beside the metrics), labels, the
# wall clock, and ``straggler_ranks`` (a list of rank numbers, not one value per rank).
_NOT_METRICS = frozenset(("kind", "rank", "time", "step", "straggler_ranks"))


def _finite_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: numbers.Real) -> int | float:
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def record_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a telemetry record as flat metrics for a logger or TensorBoard.

    ``{"kind": "step", "step": 8, "epoch": 0, "train_loss": 0.5, "phase_s": {"data": 0.01},
    "peak_memory_bytes": [10, 20], "mfu": None}`` ->
    ``{"epoch": 0, "step/train_loss": 0.5, "step/phase_s/data": 0.01,
    "step/peak_memory_bytes/rank0": 10, "step/peak_memory_bytes/rank1": 20}``.

    Names are ``<kind>/<field>`` (the record's ``kind``, "step" or "epoch", keeps an interval's
    ``train_loss`` apart from an epoch's), nested fields joined by "/", per-rank lists as ``/rank<i>``;
    ``epoch`` is kept as it is. Left out: ``kind``, ``rank``, ``time``, ``step`` (give it beside the
    metrics), ``straggler_ranks``, and every value that is not a finite real number (None, strings,
    NaN, inf; metrics.jsonl keeps them). Integers stay ``int``, other numbers become ``float``.
    """
    kind = record.get("kind", "record")
    out: dict[str, float] = {}
    for key, value in flatten(record, sep="/").items():
        if key in _NOT_METRICS:
            continue
        name = key if key == "epoch" else f"{kind}/{key}"
        pairs = ([(f"{name}/rank{i}", v) for i, v in enumerate(value)] if isinstance(value, (list, tuple))
                 else [(name, value)])
        out.update((n, _number(v)) for n, v in pairs if _finite_number(v))
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
    """Every metric of a record (:func:`record_metrics`: ``<kind>/<name>``, per-rank values as
    ``<kind>/<name>/rank<i>``) as a TensorBoard scalar at the record's ``step``.

    Uses ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package), also the writer
    of ``trainscale.loggers.TensorBoardLogger``. https://pytorch.org/docs/stable/tensorboard.html

    The writer's queue holds ``max_queue`` events (SummaryWriter's default of 10 made the training
    thread wait for the writer thread on every record of ~40 scalars); events reach the file every
    ``flush_secs`` seconds and at :meth:`close`, not at each write (metrics.jsonl is the flushed record).
    """

    def __init__(self, log_dir: str | os.PathLike, flush_secs: float = 10.0, max_queue: int = 1000) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), max_queue=max_queue, flush_secs=flush_secs)

    @staticmethod
    def available() -> bool:
        return importlib.util.find_spec("tensorboard") is not None

    def write(self, record: dict[str, Any]) -> None:
        self.write_scalars(record_metrics(record), int(record.get("step", 0)))

    def write_scalars(self, metrics: dict[str, float], step: int) -> None:
        """One scalar per metric, tagged with its name, at ``step``."""
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


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
