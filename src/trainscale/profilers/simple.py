"""``SimpleProfiler``: the seconds each action took, Lightning's ``lightning/pytorch/profilers/simple.py``."""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from pathlib import Path

from trainscale.profilers.base import Profiler


class SimpleProfiler(Profiler):
    """Records each action's durations (``time.perf_counter``, seconds) and reports, per action, the mean duration,
    the number of calls, the total and its percentage of the time since the profiler was made, slowest first
    (``extended=False``: mean and total only), as Lightning's.

    Raises:
        ValueError: an action started while it runs, or stopped without having started.
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None, extended: bool = True) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.current_actions: dict[str, float] = {}
        self.recorded_durations: dict[str, list[float]] = defaultdict(list)
        self.extended = extended
        self.start_time = time.perf_counter()

    def start(self, action_name: str) -> None:
        if action_name in self.current_actions:
            raise ValueError(f"Attempted to start {action_name} which has already started.")
        self.current_actions[action_name] = time.perf_counter()

    def stop(self, action_name: str) -> None:
        end = time.perf_counter()
        if action_name not in self.current_actions:
            raise ValueError(f"Attempting to stop recording an action ({action_name}) which was never started.")
        self.recorded_durations[action_name].append(end - self.current_actions.pop(action_name))

    def summary(self) -> str:
        """The table: ``| Action | Mean duration (s) | Num calls | Total time (s) | Percentage % |`` with a "Total" row
        (the time since the profiler was made), rows by total time, largest first."""
        if not self.recorded_durations:
            return ""
        total = time.perf_counter() - self.start_time
        rows = sorted(((a, math.fsum(d) / len(d), len(d), math.fsum(d), 100.0 * math.fsum(d) / total)
                       for a, d in self.recorded_durations.items()), key=lambda r: r[3], reverse=True)
        width = max(len(a) for a in self.recorded_durations)
        if self.extended:
            header = ("Action", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %")
            body = [("Total", "-", f"{sum(r[2] for r in rows)}", f"{total:.5}", "100 %"), None]
            body += [(a, f"{mean:.5}", f"{n}", f"{t:.5}", f"{p:.5}") for a, mean, n, t, p in rows]
        else:
            header = ("Action", "Mean duration (s)", "Total time (s)")
            body = [(a, f"{mean:.5}", f"{t:.5}") for a, mean, _, t, _ in rows]
        line = "-" * len(_row(header, width).expandtabs())
        out = [f"{self._stage.upper()} Profiler Report" if self._stage else "Profiler Report", line,
               _row(header, width), line]
        out += [line if cells is None else _row(cells, width) for cells in body]
        return os.linesep.join([*out, line, ""])


def _row(cells: tuple, width: int) -> str:
    return f"|  {cells[0]:<{width}s}\t|" + "".join(f"  {c:<15}\t|" for c in cells[1:])
