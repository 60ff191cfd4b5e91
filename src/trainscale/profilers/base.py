"""The ``Profiler`` protocol of Lightning (``lightning/pytorch/profilers/profiler.py``): ``start``/``stop`` an
action by name, ``profile(name)`` as a context, ``setup(stage, local_rank, log_dir)`` before a run, ``describe()``
after it (the summary to ``dirpath/filename`` or printed), ``teardown``; and ``PassThroughProfiler``, the no-op."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Iterator

_NO_PROFILE = contextlib.nullcontext()  # PassThroughProfiler.profile's context: one shared object, no cost per call


class Profiler:
    """Base of every profiler (Lightning's ``Profiler``).

    Args:
        dirpath: where ``filename`` (and a profiler's other files) are written; None: the directory ``setup`` is given
            (the Trainer gives its run directory).
        filename: the summary goes to ``dirpath/<stage>-<filename>[-<rank>].txt``; None: printed on rank zero.
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None) -> None:
        self.dirpath, self.filename = dirpath, filename
        self._stage: str | None = None
        self._local_rank: int | None = None

    def start(self, action_name: str) -> None:
        """Start recording ``action_name``."""
        raise NotImplementedError

    def stop(self, action_name: str) -> None:
        """Stop recording ``action_name``."""
        raise NotImplementedError

    def summary(self) -> str:
        """The report of what was recorded ("" when nothing was)."""
        return ""

    @contextlib.contextmanager
    def profile(self, action_name: str) -> Iterator[str]:
        """``with profiler.profile("name"):`` records the block as one call of the action ``name``."""
        try:
            self.start(action_name)
            yield action_name
        finally:
            self.stop(action_name)

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | Path | None = None) -> None:
        """Before a run: its stage ("fit"), this process's rank (None in a one-process run; the Trainer gives the
        global rank, so that ranks of several nodes sharing a run directory write apart) and the directory to use
        when ``dirpath`` is None."""
        self._stage, self._local_rank = stage, local_rank
        self.dirpath = self.dirpath or log_dir

    def describe(self) -> None:
        """After a run: the summary written to ``dirpath/<stage>-<filename>[-<rank>].txt`` (appended) when both are
        set, otherwise printed on rank zero; then :meth:`teardown`."""
        summary = self.summary()
        if summary and self.filename and self.dirpath:
            Path(self.dirpath).mkdir(parents=True, exist_ok=True)
            with open(Path(self.dirpath) / self._prepare_filename(), "a") as f:
                f.write(summary)
        elif summary and self._local_rank in (None, 0):
            print(summary)
        self.teardown(self._stage)

    def teardown(self, stage: str | None) -> None:
        """Release what the profiler holds (nothing here)."""

    def _prepare_filename(self, action_name: str | None = None, extension: str = ".txt") -> str:
        """Lightning's file name: ``<stage>-<filename>-<rank>-<action><extension>``, each part only when known,
        path-unsafe characters replaced by ``_``."""
        parts = [p for p in (self._stage, self.filename) if p]
        if self._local_rank is not None:
            parts.append(str(self._local_rank))
        if action_name is not None:
            parts.append(action_name)
        base = re.sub(r"_+", "_", re.sub(r"[\\/:*?\"<>|\n\r\t]", "_", "-".join(parts))).strip()
        return (base or "profile") + extension

    def _stats_to_str(self, stats: dict[str, str]) -> str:
        """Lightning's report layout: "<STAGE> Profiler Report", then "Profile stats for: <action> [rank: r]" and
        its text, for each action."""
        lines = [f"{self._stage.upper()} Profiler Report" if self._stage else "Profiler Report"]
        for action, value in stats.items():
            rank = f" rank: {self._local_rank}" if self._local_rank is not None else ""
            lines += [f"Profile stats for: {action}{rank}", value]
        return os.linesep.join(lines)


class PassThroughProfiler(Profiler):
    """Records nothing (the Trainer's profiler when none is asked for): ``profile`` returns one shared no-op
    context, so a region in the step costs a method call."""

    def start(self, action_name: str) -> None:
        pass

    def stop(self, action_name: str) -> None:
        pass

    def profile(self, action_name: str) -> contextlib.nullcontext:
        return _NO_PROFILE
