"""``AdvancedProfiler``: Python's ``cProfile`` per action, Lightning's ``lightning/pytorch/profilers/advanced.py``."""

from __future__ import annotations

import cProfile
import io
import pstats
from collections import defaultdict
from pathlib import Path

from trainscale.profilers.base import Profiler


class AdvancedProfiler(Profiler):
    """One ``cProfile.Profile`` per action, enabled while the action runs (starting one disables the others, as in
    Lightning); the summary gives each action's functions by cumulative time (``pstats``), limited by
    ``line_count_restriction`` (a count of lines, or a fraction in [0, 1]). ``dump_stats=True`` also writes each
    action's raw stats to ``dirpath/<stage>-<filename>-<rank>-<action>.prof`` (read with ``pstats`` or snakeviz).

    Raises:
        ValueError: an action stopped that never started.
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None,
                 line_count_restriction: float = 1.0, dump_stats: bool = False) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.profiled_actions: dict[str, cProfile.Profile] = defaultdict(cProfile.Profile)
        self.line_count_restriction = line_count_restriction
        self.dump_stats = dump_stats

    def start(self, action_name: str) -> None:
        for profile in self.profiled_actions.values():
            profile.disable()
        self.profiled_actions[action_name].enable()

    def stop(self, action_name: str) -> None:
        profile = self.profiled_actions.get(action_name)
        if profile is None:
            raise ValueError(f"Attempting to stop recording an action ({action_name}) which was never started.")
        profile.disable()

    def summary(self) -> str:
        stats = {}
        for action, profile in self.profiled_actions.items():
            if self.dump_stats and self.dirpath:
                Path(self.dirpath).mkdir(parents=True, exist_ok=True)
                profile.dump_stats(Path(self.dirpath) / self._prepare_filename(action, ".prof"))
            text = io.StringIO()
            pstats.Stats(profile, stream=text).strip_dirs().sort_stats("cumulative").print_stats(
                self.line_count_restriction)
            stats[action] = text.getvalue()
        return self._stats_to_str(stats) if stats else ""

    def teardown(self, stage: str | None) -> None:
        self.profiled_actions.clear()
