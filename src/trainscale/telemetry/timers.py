"""Step-phase timers: where a training step's wall time goes.

Explicit marks (each mark ends the phase that began at the previous mark, so marks that follow
each other attribute every second of the step)::

    timer = StepTimer(device)
    timer.start()
    for x, y in loader:                      # fetching the batch ...
        x, y = x.to(device), y.to(device)
        timer.mark("data", (x, y))           # ... and moving it = data wait; counts the batch's samples
        loss = loss_fn(model(x), y)
        timer.mark("forward")
        loss.backward()
        timer.mark("backward")
        optimizer.step(); optimizer.zero_grad()
        timer.end_step("optimizer")          # ends the "optimizer" phase and the step
    steps = timer.collect()                  # at log intervals only: list[StepTime]

or, with fewer calls per step, readings taken in the loop and passed together (what the Trainer does)::

    x, y = x.to(device), y.to(device)
    t_data = timer.clock()
    loss = loss_fn(model(x), y)
    t_forward = timer.clock()
    loss.backward()
    timer.micro_batch(t_data, t_forward, timer.clock(), samples=len(x))
    # StepTimer(device, running=True) on CPU: running sums only, timer.totals() instead of collect()

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
from dataclasses import dataclass, field
# bound at import: a test that patches ``time.perf_counter`` to drive a callback's clock (Lightning's
# ThroughputMonitor tests do) leaves the step timers' clock alone
from time import perf_counter
from typing import Any, Callable, Iterator

from trainscale.runtime.batch import batch_counts
from trainscale.telemetry.overlap import comm_overlap

PHASES = ("data", "forward", "backward", "optimizer")


def _cuda_event() -> Any:
    """A recorded CUDA event (``torch.cuda.Event(enable_timing=True)``): a time reading resolved later."""
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@dataclass
class StepTime:
    """One optimizer step, resolved. Times in seconds.

    Attributes:
        wall_s: from the step's start (``start()`` or the end of the previous step) to ``end_step``.
        phase_s: seconds per phase name (the phases marked in this step).
        comm_s: gradient all-reduce seconds in this step: the union of the buckets' (ready, done)
            intervals (overlap counted once), or None when not timed.
        exposed_comm_s: the part of ``comm_s`` the step waited for: from the last bucket ready (the last
            gradient produced) to the last all-reduce done (``trainscale.telemetry.overlap``); None when not timed.
        samples: samples this rank processed in the step (all micro-batches).
        tokens: tokens this rank processed, or None when batches carry no tokens.
    """

    wall_s: float
    phase_s: dict[str, float] = field(default_factory=dict)
    comm_s: float | None = None
    samples: int = 0
    tokens: int | None = None
    exposed_comm_s: float | None = None


class StepTimer:
    """Times the phases of each step; see the module docstring for the two ways to use it.

    Args:
        device: the device the step runs on (``torch.device`` or str); CUDA uses CUDA events.
        time_comm: whether :meth:`record_comm` will be fed (then ``comm_s`` is a number, else None).
        running: keep only running sums (CPU clocks only): each reading is added where it is taken, and
            :meth:`totals` returns one row per call instead of one per step; :meth:`collect` is then not
            available. Made for :class:`~trainscale.telemetry.processor.Telemetry`: resolving 50 steps of
            kept readings at a log interval took ~0.2 ms on CPU (cold caches: ~1,000 small objects read
            once), the running sums nothing measurable per step.

    Raises:
        ValueError: ``running`` with a CUDA device (events are resolved after the fact).
    """

    def __init__(self, device: Any = None, time_comm: bool = False, running: bool = False) -> None:
        self.cuda = device is not None and str(device).startswith("cuda")
        if running and self.cuda:
            raise ValueError("StepTimer(running=True) needs CPU clock readings; CUDA events are resolved later")
        self.running = running
        self._phase_sums: dict[str, float] = {}  # running mode: seconds per phase since the last totals()
        self._micro = [0.0, 0.0, 0.0]  # running mode: micro_batch()'s data, forward, backward seconds
        self._sums = [0.0] * 6  # running mode: steps, wall, comm, exposed comm, samples, tokens
        self.time_comm = time_comm
        self._step_start: Any = None
        self._last: Any = None
        self._marks: list[tuple[str, Any, Any]] = []
        self._comm: list[tuple[Any, Any]] = []
        self._samples = 0
        self._tokens: int | None = None
        self._done: list[tuple] = []
        # a time reading: seconds (time.perf_counter on CPU) or a recorded CUDA event
        self.clock: Callable[[], Any] = _cuda_event if self.cuda else perf_counter

    def start(self) -> None:
        """Begin a step now (at the top of an epoch, or to leave out time spent between steps)."""
        self._step_start = self._last = self.clock()
        self._marks = []
        self._samples, self._tokens = 0, None

    def mark(self, phase: str, batch: Any = None) -> None:
        """End phase ``phase`` now; it began at the previous mark (or at the step's start). With
        ``batch`` (at "data"), also count its samples and tokens (as :meth:`count` would)."""
        now = self.clock()
        if batch is not None:
            self.count(*batch_counts(batch))
        if self._last is None:  # no start(): the step begins here
            self._step_start = self._last = now
            return
        if self.running:
            self._phase_sums[phase] = self._phase_sums.get(phase, 0.0) + (now - self._last)
        else:
            self._marks.append((phase, self._last, now))
        self._last = now

    def micro_batch(self, data_end: Any, forward_end: Any, backward_end: Any, samples: int,
                    tokens: int | None = None) -> None:
        """A micro-batch's "data", "forward" and "backward" phases from three :meth:`clock` readings
        the loop took itself (seconds from ``time.perf_counter`` on CPU, recorded CUDA events on CUDA):
        the same as three :meth:`mark` calls at those moments, in one call. ``samples`` and ``tokens``
        are the micro-batch's counts (tokens None: not a token batch). "data" began at the previous
        mark (or the step's start)."""
        last = self._last
        if last is None:  # no start(): the step begins at the end of its data phase
            self._step_start = last = data_end
        if self.running:
            micro = self._micro
            micro[0] += data_end - last
            micro[1] += forward_end - data_end
            micro[2] += backward_end - forward_end
        else:
            self._marks += (("data", last, data_end), ("forward", data_end, forward_end),
                            ("backward", forward_end, backward_end))
        self._last = backward_end
        self._samples += samples
        if tokens is not None:
            self._tokens = (self._tokens or 0) + tokens

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
        """One bucket all-reduce's :meth:`clock` readings: when DDP handed the bucket over (its gradients
        ready) and when the all-reduce completed (called from a DDP comm hook, possibly on another thread;
        DDP's backward returns only after every bucket's future, so all of a step's readings are in by
        :meth:`end_step`)."""
        self._comm.append((start, end))

    def end_step(self, phase: str | None = None) -> None:
        """Close the current step; the next one begins now. With ``phase``, end that phase first
        (the same reading as a :meth:`mark` just before, without a second one)."""
        now = self.clock()
        start = self._step_start if self._step_start is not None else now
        if self.running:  # per step: a few float additions, nothing allocated
            if phase is not None and self._last is not None:
                self._phase_sums[phase] = self._phase_sums.get(phase, 0.0) + (now - self._last)
            sums = self._sums
            sums[0] += 1
            sums[1] += now - start
            if self._comm:
                comm, self._comm = self._comm, []
                union, exposed = comm_overlap(comm)
                sums[2] += union
                sums[3] += exposed
            sums[4] += self._samples
            self._samples = 0
            if self._tokens is not None:
                sums[5] += self._tokens
                self._tokens = None
            self._step_start = self._last = now
            return
        comm, self._comm = self._comm, []
        if phase is not None and self._last is not None:
            self._marks.append((phase, self._last, now))
        self._done.append((start, now, self._marks, comm, self._samples, self._tokens))
        self._step_start = self._last = now
        self._marks = []
        self._samples, self._tokens = 0, None

    def _take(self) -> list[tuple]:
        """Drain the steps closed since the last call (on CUDA: wait for their last events)."""
        done, self._done = self._done, []
        if self.cuda and done:
            done[-1][1].synchronize()
            for _, _, _, comm, _, _ in done:
                for _, end in comm:
                    end.synchronize()
        return done

    def collect(self) -> list[StepTime]:
        """The steps closed since the last call, resolved to seconds (on CUDA: one host sync).

        Raises:
            RuntimeError: a ``running`` timer (it keeps sums, not steps; use :meth:`totals`).
        """
        if self.running:
            raise RuntimeError("a StepTimer(running=True) keeps sums only: call totals(), or build it with running=False")
        out = []
        for start, end, marks, comm, samples, tokens in self._take():
            phases: dict[str, float] = {}
            for name, a, b in marks:
                phases[name] = phases.get(name, 0.0) + self._elapsed(a, b)
            comm_s, exposed_s = self._comm_seconds(start, comm) if self.time_comm else (None, None)
            out.append(StepTime(self._elapsed(start, end), phases, comm_s, samples, tokens, exposed_s))
        return out

    def totals(self, phases: tuple[str, ...] = PHASES) -> list[list[float]]:
        """Drain the steps closed since the last call as rows of sums, for adding up:
        ``[steps, wall_s, seconds of each of phases..., comm_s, exposed_comm_s (both 0.0 when not timed),
        samples, tokens]``.

        A ``running`` timer returns one row for all those steps (none if there was no step); otherwise
        there is one row per step (``steps`` = 1), resolved like :meth:`collect` (on CUDA: one host sync).
        Marks of other phase names are left out.
        """
        if self.running:
            sums, phase_sums = self._sums, dict(self._phase_sums)
            if not sums[0]:
                return []
            for name, seconds in zip(("data", "forward", "backward"), self._micro):
                phase_sums[name] = phase_sums.get(name, 0.0) + seconds
            self._sums, self._phase_sums, self._micro = [0.0] * 6, {}, [0.0, 0.0, 0.0]
            return [[sums[0], sums[1], *(phase_sums.get(p, 0.0) for p in phases), *sums[2:]]]
        column = {name: i for i, name in enumerate(phases, 2)}
        zeros = [0.0] * len(phases)
        out = []
        for start, end, marks, comm, samples, tokens in self._take():
            row = [1.0, self._elapsed(start, end), *zeros, *self._comm_seconds(start, comm),
                   float(samples), float(tokens or 0)]
            for name, a, b in marks:
                i = column.get(name)
                if i is not None:
                    row[i] += self._elapsed(a, b)
            out.append(row)
        return out

    def _comm_seconds(self, start: Any, comm: list[tuple[Any, Any]]) -> tuple[float, float]:
        """(communication, exposed) seconds of a step's all-reduce readings, each resolved against the
        step's start reading (CUDA: events on the device's timeline)."""
        return comm_overlap([(self._elapsed(start, a), self._elapsed(start, b)) for a, b in comm])

    def _elapsed(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a
