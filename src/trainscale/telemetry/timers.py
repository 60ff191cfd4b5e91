"""Step-phase timers: where a training step's wall time goes.

Explicit marks (each mark ends the phase that began at the previous mark, so marks that follow
each other attribute every second of the step)::

    timer = StepTimer(device)
    timer.start()
    for x, y in loader:                      # fetching the batch ...
        x, y = x.to(device), y.to(device)
        timer.mark("data")                   # ... and moving it = data wait
        loss = loss_fn(model(x), y)
        timer.mark("forward")
        loss.backward()
        timer.mark("backward")
        optimizer.step(); optimizer.zero_grad()
        timer.mark("optimizer")
        timer.end_step(samples=len(x))
    steps = timer.collect()                  # at log intervals only: list[StepTime]

or a context manager per phase (only the time inside the ``with`` blocks is attributed)::

    with timer.phase("forward"):
        loss = loss_fn(model(x), y)

On CPU the clock is ``time.perf_counter``. On CUDA each reading is a ``torch.cuda.Event``
recorded on the current stream, resolved in :meth:`StepTimer.collect` (one host sync per call,
none per step): the time between two events is GPU stream time, so a data phase that the GPU
hides behind queued work reads as ~0 and a GPU starved by the data loader reads as the gap.
https://pytorch.org/docs/stable/generated/torch.cuda.Event.html
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

PHASES = ("data", "forward", "backward", "optimizer")


@dataclass
class StepTime:
    """One optimizer step, resolved. Times in seconds.

    Attributes:
        wall_s: from the step's start (``start()`` or the end of the previous step) to ``end_step``.
        phase_s: seconds per phase name (the phases marked in this step).
        comm_s: gradient all-reduce seconds in this step (sum over buckets), or None when not timed.
        samples: samples this rank processed in the step (all micro-batches).
        tokens: tokens this rank processed, or None when batches carry no tokens.
    """

    wall_s: float
    phase_s: dict[str, float] = field(default_factory=dict)
    comm_s: float | None = None
    samples: int = 0
    tokens: int | None = None


class StepTimer:
    """Times the phases of each step; see the module docstring for the two ways to use it.

    Args:
        device: the device the step runs on (``torch.device`` or str); CUDA uses CUDA events.
        time_comm: whether :meth:`record_comm` will be fed (then ``comm_s`` is a number, else None).
    """

    def __init__(self, device: Any = None, time_comm: bool = False) -> None:
        self.cuda = device is not None and str(device).startswith("cuda")
        self.time_comm = time_comm
        self._step_start: Any = None
        self._last: Any = None
        self._marks: list[tuple[str, Any, Any]] = []
        self._comm: list[tuple[Any, Any]] = []
        self._samples = 0
        self._tokens: int | None = None
        self._done: list[tuple] = []

    def clock(self) -> Any:
        """A time reading: seconds (CPU) or a recorded CUDA event."""
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        """Begin a step now (at the top of an epoch, or to leave out time spent between steps)."""
        self._step_start = self._last = self.clock()
        self._marks = []
        self._samples, self._tokens = 0, None

    def mark(self, phase: str) -> None:
        """End phase ``phase`` now; it began at the previous mark (or at the step's start)."""
        now = self.clock()
        if self._last is None:  # no start(): the step begins here
            self._step_start = self._last = now
            return
        self._marks.append((phase, self._last, now))
        self._last = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the time inside the ``with`` block to phase ``name``."""
        if self._step_start is None:
            self.start()
        self._last = self.clock()
        yield
        self.mark(name)

    def count(self, samples: int, tokens: int | None = None) -> None:
        """Add a micro-batch's samples (and tokens) to the current step."""
        self._samples += samples
        if tokens is not None:
            self._tokens = (self._tokens or 0) + tokens

    def record_comm(self, start: Any, end: Any) -> None:
        """One all-reduce's clock readings (called from a DDP comm hook, possibly on another thread)."""
        self._comm.append((start, end))

    def end_step(self) -> None:
        """Close the current step; the next one begins now."""
        now = self.clock()
        comm, self._comm = self._comm, []
        start = self._step_start if self._step_start is not None else now
        self._done.append((start, now, self._marks, comm, self._samples, self._tokens))
        self._step_start = self._last = now
        self._marks = []
        self._samples, self._tokens = 0, None

    def collect(self) -> list[StepTime]:
        """The steps closed since the last call, resolved to seconds (on CUDA: one host sync)."""
        done, self._done = self._done, []
        if self.cuda and done:
            done[-1][1].synchronize()
            for _, _, _, comm, _, _ in done:
                for _, end in comm:
                    end.synchronize()
        out = []
        for start, end, marks, comm, samples, tokens in done:
            phases: dict[str, float] = {}
            for name, a, b in marks:
                phases[name] = phases.get(name, 0.0) + self._elapsed(a, b)
            comm_s = sum(self._elapsed(a, b) for a, b in comm) if self.time_comm else None
            out.append(StepTime(self._elapsed(start, end), phases, comm_s, samples, tokens))
        return out

    def _elapsed(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a
