"""Numbers and tables as the commands print them."""

from __future__ import annotations

import math

from tabulate import tabulate


def fmt_time(seconds: float | None) -> str:
    """``mm:ss.s`` (e.g. ``01:05.3``); "—" for None."""
    if seconds is None or not math.isfinite(seconds):
        return "—"
    minutes, sec = divmod(seconds, 60.0)
    return f"{int(minutes):02d}:{sec:04.1f}"


def text_table(head: list[str], rows: list[list[str]], align: str = "right") -> str:
    """``rows`` (lists of strings) under ``head``, every column aligned ``align``, a dashed rule under the head:
    tabulate's "simple" format, cells kept as given (no number parsing). A column without a header or any cell
    (an optional note no row has) is left out."""
    keep = [i for i, name in enumerate(head) if name or any(row[i] for row in rows)]
    return tabulate([[row[i] for i in keep] for row in rows], [head[i] for i in keep], tablefmt="simple",
                    disable_numparse=True, colalign=(align,) * len(keep))
