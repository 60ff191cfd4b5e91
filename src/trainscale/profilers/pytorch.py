"""``PyTorchProfiler``: ``torch.profiler`` over the Trainer's regions, Lightning's
``lightning/pytorch/profilers/pytorch.py`` without its NVTX and schedule-override machinery."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from trainscale.profilers.base import Profiler

TRACE_SUFFIX = ".pt.trace.json"  # the Chrome/Perfetto trace files this profiler writes (`trainscale report` lists them)


class PyTorchProfiler(Profiler):
    """``torch.profiler.profile`` running from the first action to :meth:`describe`; each action is a
    ``torch.profiler.record_function`` range of that name, so the trace shows the Trainer's regions
    (``training_step_and_backward``, ``optimizer_step``, ...) above the operators they ran.

    The schedule (``torch.profiler.schedule``) advances at the end of each ``training_step_and_backward`` (one
    micro-batch, as Lightning's advances at each ``training_step``). Default: Lightning's ``wait=1, warmup=1,
    active=3``, once (``repeat=1``): the 3rd to 5th micro-batches are recorded, the rest of the run costs a
    ``record_function`` per region. A run that ends inside the active steps keeps what it recorded; one shorter than
    3 micro-batches records nothing (pass ``schedule=None`` to record the whole run).

    Files, in ``dirpath`` (the Trainer's run directory unless given), named as Lightning names profiler files
    (``<stage>-<filename>-<rank>``, each part only when known; the rank in runs of several processes):

    - ``fit-<rank>.pt.trace.json`` (one per active window; ``-step<N>`` added after the first): the Chrome trace
      (``export_chrome_trace``), opened by https://ui.perfetto.dev or ``chrome://tracing``;
    - ``fit-<rank>-ops.txt``: the operator table (``key_averages().table``) sorted by ``sort_by_key`` (default
      ``cuda_time_total`` where CUDA is profiled, else ``cpu_time_total``), ``row_limit`` rows; rank zero also prints
      it unless ``filename`` is given.

    Args:
        export_to_chrome: write the traces (False: the table only).
        row_limit: rows of the table (-1: all).
        sort_by_key: the table's sort key (``torch.autograd.profiler_util.EventList.table``'s ``sort_by``).
        schedule: a ``torch.profiler.schedule`` (or None: every step recorded); default as above.
        **profiler_kwargs: passed to ``torch.profiler.profile`` (``activities``, ``record_shapes``,
            ``profile_memory``, ``with_stack``, ``with_flops``, ``with_modules``). ``activities`` default: CPU, and
            CUDA when a GPU is present.

    Raises:
        ValueError: ``on_trace_ready`` given (this profiler writes the traces itself).
    """

    STEP_ACTIONS = ("training_step_and_backward",)  # the actions whose end advances the schedule

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None, export_to_chrome: bool = True,
                 row_limit: int = 20, sort_by_key: str | None = None, schedule: Any = "default",
                 **profiler_kwargs: Any) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        if "on_trace_ready" in profiler_kwargs:
            raise ValueError("PyTorchProfiler writes the traces itself (export_to_chrome); drop on_trace_ready, or "
                             "use torch.profiler.profile directly")
        self.export_to_chrome, self.row_limit, self.sort_by_key = export_to_chrome, row_limit, sort_by_key
        self._schedule, self._kwargs = schedule, profiler_kwargs
        self._profiler: Any = None
        self._ranges: dict[str, Any] = {}
        self._events: Any = None
        self.trace_paths: list[Path] = []  # the traces written, in order

    def _start_profiler(self) -> None:
        import torch

        activities = self._kwargs.pop("activities", None) or [
            torch.profiler.ProfilerActivity.CPU,
            *([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
        self._cuda = torch.profiler.ProfilerActivity.CUDA in activities
        schedule = (torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1) if self._schedule == "default"
                    else self._schedule)
        self._profiler = torch.profiler.profile(activities=activities, schedule=schedule,
                                                on_trace_ready=self._write_trace, **self._kwargs)
        self._profiler.start()

    def _write_trace(self, profiler: Any) -> None:
        """torch's ``on_trace_ready``: the window just recorded, as a Chrome trace file."""
        if not self.export_to_chrome:
            return
        if self.dirpath is None:
            warnings.warn("PyTorchProfiler has no dirpath (and no run directory was given): its trace is not written",
                          stacklevel=2)
            return
        name = self._prepare_filename(f"step{profiler.step_num}" if self.trace_paths else None, TRACE_SUFFIX)
        Path(self.dirpath).mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(Path(self.dirpath) / name))
        self.trace_paths.append(Path(self.dirpath) / name)

    def start(self, action_name: str) -> None:
        import torch

        if self._profiler is None:
            self._start_profiler()
        self._ranges[action_name] = torch.profiler.record_function(action_name).__enter__()

    def stop(self, action_name: str) -> None:
        ranged = self._ranges.pop(action_name, None)
        if ranged is not None:
            ranged.__exit__(None, None, None)
        if self._profiler is not None and action_name in self.STEP_ACTIONS:
            self._profiler.step()

    def _stop_profiler(self) -> None:
        if self._profiler is not None:
            self._profiler.stop()  # a window still recording is written here (torch's RECORD -> None transition)
            self._events = self._profiler.key_averages() if self._profiler.profiler is not None else None
            self._profiler = None

    def summary(self) -> str:
        """The operator table of what was recorded ("" when nothing was)."""
        self._stop_profiler()
        if not self._events:
            return ""
        sort_by = self.sort_by_key or ("cuda_time_total" if self._cuda else "cpu_time_total")
        return self._stats_to_str({"records": self._events.table(sort_by=sort_by, row_limit=self.row_limit)})

    def describe(self) -> None:
        """The table written to ``<dirpath>/<stage>-<rank>-ops.txt`` (every rank), then :meth:`Profiler.describe`
        (printed on rank zero, or to ``filename``'s file)."""
        summary = self.summary()
        if summary and self.dirpath:
            Path(self.dirpath).mkdir(parents=True, exist_ok=True)
            (Path(self.dirpath) / self._prepare_filename("ops")).write_text(summary)
        super().describe()

    def teardown(self, stage: str | None) -> None:
        for action in list(self._ranges):
            self.stop(action)
        self._stop_profiler()
