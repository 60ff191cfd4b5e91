"""Numbers as the commands print them."""

from __future__ import annotations

import math


def fmt_time(seconds: float | None) -> str:
    """``mm:ss.s`` (e.g. ``01:05.3``); "—" for None."""
    if seconds is None or not math.isfinite(seconds):
        return "—"
    minutes, sec = divmod(seconds, 60.0)
    return f"{int(minutes):02d}:{sec:04.1f}"
