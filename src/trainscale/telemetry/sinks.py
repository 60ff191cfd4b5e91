"""The run's own record: ``metrics.jsonl``, one JSON object per line, nested values kept.

Written by rank zero only, so the file holds one record set per interval, not one per rank. Every record
carries ``kind`` ("step" at log intervals, "epoch" at epoch ends, "validation" mid-epoch), ``step``,
``epoch``, ``rank`` (a rank number, or "all" for values reduced over ranks) and ``time`` (Unix seconds).
``trainscale report``, ``check`` and ``bench`` read it; the experiment loggers (``trainscale.loggers``: CSV,
TensorBoard, W&B, MLflow) receive the same records as flat metrics.

Lines go through a buffer that reaches the file at least every ``flush_secs`` seconds (5 by default), at every
record whose ``kind`` is not "step" and at ``close()`` (the Trainer closes it also when ``fit`` raises). A
process killed outright (SIGKILL, out of memory) loses at most the last ``flush_secs`` seconds of step records.
Flushing each record cost ~55 µs inside a training step here (one ``write`` system call with cold caches), paid
at every log interval.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


_STRICT = json.JSONEncoder(allow_nan=False)  # built once: json.dumps(..., allow_nan=False) builds one per call


class JsonlSink:
    """Append one JSON object per line to ``path`` (created with its parent directory); NaN and inf are
    written as strings. Lines reach the file as the module docstring says: at least every ``flush_secs``
    seconds, at each record whose ``kind`` is not "step", and at :meth:`close`."""

    # -inf, not 0.0: time.monotonic() counts from an arbitrary point (boot on Linux), so on a machine
    # up for less than flush_secs a 0.0 start would keep the first records buffered.
    _flushed = -math.inf

    def __init__(self, path: str | os.PathLike, flush_secs: float = 5.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_secs = flush_secs
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        try:  # the C encoder alone when there is no NaN or inf (the usual case)
            line = _STRICT.encode(record)
        except ValueError:
            line = json.dumps(_jsonable(record))
        self._file.write(line + "\n")
        now = time.monotonic()
        if record.get("kind") != "step" or now - self._flushed >= self.flush_secs:
            self.flush()
            self._flushed = now

    def flush(self) -> None:
        """Write the buffered lines to the file now."""
        self._file.flush()

    def close(self) -> None:
        self._file.close()
