"""Where metric records go. A sink has two methods: ``write(record)`` and ``close()``.

Only rank zero writes shared sinks, so a file holds one record set per interval, not one per rank.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


class JsonlSink:
    """Append one JSON object per line to ``path`` (created with its parent directory).

    Each line is flushed, so a crashed run keeps every record written before the crash.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
