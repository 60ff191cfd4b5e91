"""Telemetry: one small processor that turns timers, counters and samplers into fixed numbers.

The Trainer uses it; a hand-written Runtime loop can too::

    from trainscale.telemetry import Telemetry
    tele = Telemetry(rt)
    tele.attach(model)                                   # parameter count, declared FLOPs per token (after rt.setup)
    if rt.world_size > 1:                                # DDP's all-reduce timed by a comm hook (False: not timed)
        tele.comm_timed = rt.strategy.time_allreduce(model, tele.clock, tele.record_comm)
    tele.start()
    for step, batch in enumerate(loader, 1):
        batch = rt.to_device(batch)
        tele.mark("data", batch)
        with tele.count_flops(batch):                    # first call only; on CUDA, or Telemetry(count_flops=True)
            with rt.autocast():
                loss = loss_fn(model(batch[0]), batch[1])
            tele.mark("forward")
            rt.backward(loss)
        tele.mark("backward")
        rt.step(optimizer); optimizer.zero_grad(set_to_none=True)
        tele.end_step()                                  # marks "optimizer" and closes the step
        if step % 50 == 0:
            record = tele.log(step, epoch, loss)         # collective: every rank calls it
    summary = tele.summary()                             # collective

Numbers (all defined in docs/telemetry.md): per-rank step time split into data, forward,
backward, optimizer; gradient communication time and the exposed part of it that the step waits for
(``trainscale.telemetry.overlap``); samples/s and tokens/s; FLOPs per sample, achieved FLOP/s
and MFU; peak memory per rank; GPU utilisation per device; straggler ranks. Per-rank sums are
gathered with one ``all_gather_single`` of a small tensor (one host copy) per log interval (and one at the end) — no
collective and no host sync per step. The first ``warmup_steps`` steps are left out of the
summary's means (they include one-off costs: allocator growth, FLOP counting, kernel selection).
"""

from __future__ import annotations

import contextlib
import math
import time
from statistics import fmean, median
from typing import TYPE_CHECKING, Any, Callable

import torch

from trainscale.runtime.batch import batch_counts
from trainscale.runtime.precision import tf32_enabled
from trainscale.telemetry.flops import (ANALYTIC, DECLARED, MFU_ERROR, FlopCountError, FlopsPerSample,
                                        declared_flops_per_token, mfu, peak_flops_per_s, resolve_count_flops)
from trainscale.telemetry.memory import PeakMemory
from trainscale.telemetry.nvml import GpuSampler
from trainscale.telemetry.stragglers import compute_per_step, find_stragglers
from trainscale.telemetry.timers import PHASES, StepTimer

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime

# The per-rank vector gathered at log intervals (float64, NaN = not available).
_FIELDS = ("steps", "wall", *PHASES, "comm", "exposed_comm", "samples", "tokens")
_EXTRA = ("loss", "memory", "memory_reserved", "gpu_util", "gpu_memory")
_IDX = {name: i for i, name in enumerate(_FIELDS + _EXTRA)}
# Every number a step record of :meth:`Telemetry.log` (and the epoch record, and summary.json) may hold: names a
# module's ``self.log`` may not take (``lightning.metrics.RESERVED``), or it would replace them.
RECORD_FIELDS = ("step_time_s", "phase_s", "phase_share", "comm_s", "exposed_comm_s", "exposed_comm_share",
                 "samples", "steps", "samples_per_s", "samples_per_s_per_device", "tokens_per_s",
                 "tokens_per_s_per_device", "achieved_flops_per_s", "flops_method", "flops_per_sample", "mfu",
                 "mfu_error", "peak_memory_bytes", "peak_memory_kind", "peak_memory_reserved_bytes", "gpu_utilization",
                 "gpu_memory_used_bytes", "slowest_rank", "straggler_ranks", "rank_step_time_s", "rank_compute_s",
                 "rank_phase_s", "rank_comm_s", "rank_exposed_comm_s")
_NAN = float("nan")
_NO_COUNT = contextlib.nullcontext()  # stateless and reentrant: one instance serves every step


class Telemetry:
    """Measure a training loop on every rank; reduce at log intervals.

    Args:
        runtime: the :class:`trainscale.runtime.runtime.Runtime` (device, world size, precision).
        count_flops: count the FLOPs of the first micro-batch (for achieved FLOP/s and MFU); None: on
            CUDA devices only, never under ``torch.compile`` (``trainscale.telemetry.flops.resolve_count_flops``).
            Where nothing is counted (or counting failed), a model that declares ``flops_per_token`` (as
            ``trainscale.models.GPT`` does) gives the FLOPs per sample instead (``flops.declared_flops_per_token``).
        warmup_steps: first steps left out of :meth:`summary` (all steps are used if no others exist).
        straggler_margin: a rank computing longer per step than the median rank by this fraction is a
            straggler (compute time: step time less exposed communication; ``telemetry.stragglers``).
        gpu_sample_interval_s: seconds between NVML samples (CUDA only).
        peak_flops: peak FLOP/s of one device for MFU, instead of trainscale's table
            (``trainscale.telemetry.flops.PEAK_FLOPS``); for devices missing from it or other clocks.

    Raises:
        ValueError: a negative ``straggler_margin``; ``count_flops=True`` under ``torch.compile``; a
            ``peak_flops`` that is not a positive number.
    """

    def __init__(self, runtime: Runtime, *, count_flops: bool | None = None,
                 warmup_steps: int = 2, straggler_margin: float = 0.2, gpu_sample_interval_s: float = 0.5,
                 peak_flops: float | None = None) -> None:
        if straggler_margin < 0:
            raise ValueError(f"straggler_margin={straggler_margin!r} must be >= 0 (0.2 means 20 % over the median)")
        if peak_flops is not None and (isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float))
                                       or not peak_flops > 0):
            raise ValueError(f"peak_flops={peak_flops!r} must be a positive number of FLOP/s per device "
                             "(e.g. 989e12 for an H100 SXM in bf16), or None for trainscale's table")
        self.rt = runtime
        # ranks that read each sample: 1, or under tensor parallelism the tp ranks of a group (same batches)
        self._copies = runtime.world_size / runtime.data_parallel_size
        self._devices_per_process = runtime.config.devices_per_process  # dp drives all its GPUs from one rank
        self.warmup_steps = warmup_steps
        self.straggler_margin = straggler_margin
        device = runtime.device
        self.timer = StepTimer(device, running=device.type != "cuda")  # CUDA: events, resolved at log intervals
        self.clock = self.timer.clock  # the loop's clock for micro_batch(): perf_counter, or a recorded CUDA event
        # (ready, done) readings of each gradient bucket's all-reduce, fed by the hook Strategy.time_allreduce installs
        self.record_comm = self.timer.record_comm
        self.memory = PeakMemory(device)
        self.memory.reset()  # CUDA: this run's peak, not that of an earlier fit in the same process
        self.flops = FlopsPerSample(warn=runtime.is_rank_zero)  # a fallback is said once, on rank zero
        compiled = runtime.config.compile is not None
        self.flops.done = not resolve_count_flops(count_flops, device.type, compiled)
        cuda = device.type == "cuda"
        self.gpu = GpuSampler(device.index if cuda else None, gpu_sample_interval_s)
        self.gpu.start()
        self._device_name = torch.cuda.get_device_name(device) if cuda else None
        self.peak_flops = peak_flops  # the user's figure, or None: the table's (peak_flops_per_device)
        self._mfu_error_said = False
        self._flops_per_token = None  # the model's declared FLOPs per token (attach), used when nothing was counted
        self._interval = [0.0] * len(_FIELDS)  # per-rank sums of _FIELDS since the last log
        self._timed = [0.0] * len(_FIELDS)  # since the end of warm-up
        self._all = [0.0] * len(_FIELDS)
        self._steps = 0
        self._stragglers: list[int] = []
        self._util_sum, self._util_n = 0.0, 0  # GPU utilisation over the whole run

    # -- the hot path: no host sync, no collective ------------------------------------------
    def attach(self, module: Any) -> None:
        """What MFU needs of ``module`` (the wrapped module): its parameter count serves the analytic FLOP
        estimate if counting fails, and its (or a submodule's) ``flops_per_token`` the FLOPs where nothing is
        counted (not under pipeline stages, which hold part of the model each)."""
        if not self.flops.done:
            self.flops.parameters = sum(p.numel() for p in module.parameters())
        if not self.rt.strategy.pipelined:  # a pipeline stage holds part of the model
            self._flops_per_token = declared_flops_per_token(module)

    @property
    def comm_timed(self) -> bool:
        """Whether the gradient all-reduce is timed (then ``comm_s`` is a number, else None): set it to what
        ``Strategy.time_allreduce(module, tele.clock, tele.record_comm)`` returns, which installs the timing hook
        (DDP's) or returns False (single, dp, fsdp: nothing timed)."""
        return self.timer.time_comm

    @comm_timed.setter
    def comm_timed(self, value: bool) -> None:
        self.timer.time_comm = bool(value)

    def start(self) -> None:
        """Begin timing now (top of each epoch; time between epochs is left out)."""
        self.timer.start()

    def mark(self, phase: str, batch: Any = None) -> None:
        """End ``phase`` now; with ``batch`` (at "data"), count its samples and tokens."""
        self.timer.mark(phase, batch)

    def micro_batch(self, data_end: Any, forward_end: Any, backward_end: Any, samples: int,
                    tokens: int | None = None) -> None:
        """A micro-batch's data, forward and backward phases from three readings of ``self.clock()`` taken
        in the loop (seconds on CPU, recorded CUDA events on CUDA), and its samples and tokens (counts)."""
        self.timer.micro_batch(data_end, forward_end, backward_end, samples, tokens)

    def phase(self, name: str):
        """Context manager: attribute the time inside the block to ``name``."""
        return self.timer.phase(name)

    def count_flops(self, batch: Any):
        """Context manager around the first micro-batch's forward and backward: counts FLOPs once.

        Counting never changes the step; when it fails, one warning and an analytic estimate or no
        FLOPs (``trainscale.telemetry.flops.FlopsPerSample``).

        Raises:
            trainscale.telemetry.flops.FlopCountError: the micro-batch raised while counted (from its error);
                run it again outside this context.
        """
        if self.flops.done:
            return _NO_COUNT
        try:
            samples, tokens = batch_counts(batch)
        except ValueError:  # no tensor with a batch dimension: nothing to divide by
            self.flops.done = True
            return _NO_COUNT
        return self.flops.measure(samples, tokens)

    @property
    def counting_flops(self) -> bool:
        """True until the run's FLOPs per sample are known (counted on the first micro-batch)."""
        return not self.flops.done

    def count_flops_of(self, forward_backward: Callable[[], Any], module: Any, batch: Any) -> Any:
        """``forward_backward()`` (one micro-batch's forward and backward) with its FLOPs counted: returns what it
        returns. A model that fails only while counted (e.g. a compiled region such as eager ``flex_attention``)
        runs again uncounted after ``module``'s gradients are cleared, and MFU falls back to the analytic
        estimate (one warning)."""
        try:
            with self.count_flops(batch):
                return forward_backward()
        except FlopCountError:
            module.zero_grad(set_to_none=True)
            return forward_backward()

    def end_step(self) -> None:
        """Mark "optimizer" and close the optimizer step."""
        self.timer.end_step("optimizer")
        self._steps += 1
        if self._steps == self.warmup_steps and self.timer.running:
            self._drain()  # the warm-up steps' sums, apart from the rest
        self.gpu.step = self._steps

    # -- log intervals ----------------------------------------------------------------------
    def _drain(self) -> None:
        """Add the steps closed since the last call to the interval and whole-run sums, and those after
        the first ``warmup_steps`` of the run to ``_timed`` (a running timer is drained once at the end
        of warm-up, so each of its rows lies wholly on one side)."""
        for row in self.timer.totals(PHASES):  # the fields of _FIELDS
            timed = self._all[0] >= self.warmup_steps
            for sums in (self._interval, self._all, self._timed) if timed else (self._interval, self._all):
                for i, v in enumerate(row):
                    sums[i] += v

    def _gather(self, vec: list[float]) -> list[list[float]]:
        """Every rank's ``vec``: one ``all_gather_single`` into a ``(world_size, len(vec))`` float64
        tensor on the device, then one device-to-host copy (``tolist`` of the whole tensor: one wait,
        not one per rank); at log intervals only. At world size 1 the list itself: no tensor, no copy."""
        if self.rt.world_size == 1:
            return [vec]
        import torch.distributed as dist

        local = torch.tensor([vec], dtype=torch.float64, device=self.rt.device)  # (1, n): ranks stack on dim 0
        out = torch.empty((self.rt.world_size, len(vec)), dtype=torch.float64, device=self.rt.device)
        # all_gather_single is torch 2.13's name (all_gather_into_tensor is deprecated there)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local)
        return out.tolist()

    def _local(self, sums: list[float], loss: float = _NAN, whole_run: bool = False) -> list[float]:
        samples = self.gpu.take()
        self._util_sum += sum(s[1] for s in samples)
        self._util_n += len(samples)
        if whole_run:
            util = self._util_sum / self._util_n if self._util_n else _NAN
        else:
            util = fmean(s[1] for s in samples) if samples else _NAN
        used = max(s[2] for s in samples) if samples else _NAN
        reserved = self.memory.peak_reserved_bytes()
        extra = [loss, float(self.memory.peak_bytes()), _NAN if reserved is None else float(reserved), util, used]
        return sums + extra

    def log(self, step: int, epoch: int, loss: torch.Tensor | float | None = None) -> dict | None:
        """The interval record (``rank`` "all"), on every rank; prints new stragglers on rank zero.

        A collective: every rank must call it at the same step. Reads ``loss`` (one host sync).
        """
        self._drain()
        value = float(loss.detach() if isinstance(loss, torch.Tensor) else loss) if loss is not None else _NAN
        rows = self._gather(self._local(self._interval, value))
        self._interval = [0.0] * len(_FIELDS)
        record = {"kind": "step", "rank": "all", "time": time.time(), "epoch": epoch, "step": step}
        losses = [r[_IDX["loss"]] for r in rows]
        if not any(math.isnan(v) for v in losses):
            record["train_loss"] = fmean(losses)
        record.update(self._numbers(rows, per_rank=True))
        stragglers = record["straggler_ranks"]
        if stragglers and stragglers != self._stragglers:
            compute = record["rank_compute_s"]
            self.rt.print(f"trainscale: straggler rank(s) {', '.join(map(str, stragglers))} at step {step}: "
                          "compute " + ", ".join(f"{compute[r]:.4f}" for r in stragglers)
                          + f" s/step vs median {median(compute):.4f} s/step")
        self._stragglers = stragglers
        self.timer.start()  # leave the logging itself out of the next step
        return record

    def summary(self) -> dict | None:
        """The run's telemetry (the contract of ``summary.json["telemetry"]``). A collective."""
        self._drain()
        sums = self._timed if self._timed[0] > 0 else self._all
        rows = self._gather(self._local(sums, whole_run=True))
        numbers = self._numbers(rows, per_rank=False)
        self.gpu.stop()
        return numbers

    def close(self) -> None:
        self.gpu.stop()

    def peak_flops_per_device(self) -> float | None:
        """FLOP/s: ``peak_flops`` when given, else the table's peak for this device and precision, under
        "32-true" with the TF32 settings of now and the counted step's share of convolutions."""
        if self.peak_flops is not None:
            return float(self.peak_flops)
        tf32_matmul, tf32_conv = tf32_enabled()
        return peak_flops_per_s(self._device_name, self.rt.config.precision, tf32_matmul=tf32_matmul,
                                tf32_conv=tf32_conv, conv_share=self.flops.conv_share)

    def _mfu(self, achieved: float | None, devices: int) -> tuple[float | None, str | None]:
        """MFU and, when it exceeds 1, the error that says why it cannot be (printed once, rank zero)."""
        if achieved is None:  # no FLOPs known: no MFU, and no peak to look up
            return None, None
        value = mfu(achieved, self.peak_flops_per_device(), devices)
        if value is None or value <= 1:
            return value, None
        if not self._mfu_error_said:
            self.rt.print(f"trainscale: MFU {value:.2f}: {MFU_ERROR}")
            self._mfu_error_said = True
        return value, MFU_ERROR

    def _numbers(self, rows: list[list[float]], per_rank: bool) -> dict:
        """The fixed numbers from each rank's sums (see docs/telemetry.md for each definition)."""
        world = len(rows)
        devices = world * self._devices_per_process  # dp drives all its GPUs from one rank
        steps = rows[0][_IDX["steps"]]
        col = dict(zip(_IDX, map(list, zip(*rows))))  # field name -> its value on each rank
        wall = fmean(col["wall"])  # ranks run the same steps; DDP keeps their walls equal
        per_step = (lambda s: s / steps) if steps > 0 else (lambda s: _NAN)
        phase_s = {p: per_step(fmean(col[p])) for p in PHASES}
        total = sum(phase_s.values())
        samples = sum(col["samples"]) / self._copies  # each sample once, though tp ranks all read it
        samples_per_s = samples / wall if wall > 0 else _NAN
        tokens = sum(col["tokens"]) / self._copies
        if self._flops_per_token is not None and self.flops.method in (None, ANALYTIC) and tokens > 0 and samples > 0:
            length = round(tokens / samples)  # under compile, or where counting is off or failed
            self.flops.value, self.flops.method = self._flops_per_token(length) * length, DECLARED
        achieved = self.flops.value * samples_per_s if self.flops.value is not None else None
        mfu_value, mfu_error = self._mfu(achieved, devices)
        has_comm = self.timer.time_comm
        compute = [compute_per_step(wall_s, exposed if has_comm else None, steps)
                   for wall_s, exposed in zip(col["wall"], col["exposed_comm"])]
        util = col["gpu_util"]
        out = {
            "step_time_s": per_step(wall),
            "phase_s": phase_s,
            "phase_share": {p: (v / total if total > 0 else _NAN) for p, v in phase_s.items()},
            **_comm_numbers(col, per_step, per_step(wall), has_comm, per_rank),
            "samples_per_s": samples_per_s,
            "samples_per_s_per_device": samples_per_s / devices,
            "tokens_per_s": tokens / wall if tokens > 0 and wall > 0 else None,
            "flops_per_sample": self.flops.value,
            "flops_method": self.flops.method,
            "achieved_flops_per_s": achieved,
            "mfu": mfu_value,
            "peak_memory_bytes": [int(m) for m in col["memory"]],
            "peak_memory_kind": self.memory.kind,
            "gpu_utilization": None if all(math.isnan(u) for u in util) else util,
            "slowest_rank": max(range(world), key=lambda r: compute[r]),
            "straggler_ranks": find_stragglers(compute, self.straggler_margin),
        }
        if mfu_error is not None:
            out["mfu_error"] = mfu_error
        # every rank's step, its phases and its compute (with rank_exposed_comm_s from _comm_numbers): the speed-up
        # account (trainscale.telemetry.account) reads the step of the rank that waited most
        out["rank_step_time_s"] = [per_step(w) for w in col["wall"]]
        out["rank_compute_s"] = compute
        out["rank_phase_s"] = {p: [per_step(v) for v in col[p]] for p in PHASES}
        if per_rank:
            out["steps"] = int(steps)
            out["samples"] = round(samples)
            if out["tokens_per_s"] is not None:
                out["tokens_per_s_per_device"] = out["tokens_per_s"] / devices
            if self.memory.cuda:
                out["peak_memory_reserved_bytes"] = [int(m) for m in col["memory_reserved"]]
            if out["gpu_utilization"] is not None:
                out["gpu_memory_used_bytes"] = col["gpu_memory"]
        return out


def _comm_numbers(col: dict[str, list[float]], per_step, step_time_s: float, timed: bool, per_rank: bool) -> dict:
    """``comm_s``, ``exposed_comm_s`` (seconds per step, means over ranks), ``exposed_comm_share``
    (of the step time) and ``rank_exposed_comm_s`` (per rank), all None when the all-reduce was not timed;
    with ``per_rank`` and timing, also ``rank_comm_s``."""
    if not timed:
        return {"comm_s": None, "exposed_comm_s": None, "exposed_comm_share": None, "rank_exposed_comm_s": None}
    exposed = per_step(fmean(col["exposed_comm"]))
    out = {"comm_s": per_step(fmean(col["comm"])), "exposed_comm_s": exposed,
           "exposed_comm_share": exposed / step_time_s if step_time_s > 0 else _NAN,
           "rank_exposed_comm_s": [per_step(e) for e in col["exposed_comm"]]}
    if per_rank:
        out["rank_comm_s"] = [per_step(c) for c in col["comm"]]
    return out


class NullTelemetry:
    """What the loop measures with ``enable_telemetry=False``: the same methods, doing nothing
    (``log`` and ``summary`` return None)."""

    clock = staticmethod(time.perf_counter)

    def attach(self, module: Any) -> None: ...

    def start(self) -> None: ...

    def mark(self, phase: str, batch: Any = None) -> None: ...

    def micro_batch(self, data_end: Any, forward_end: Any, backward_end: Any, samples: int,
                    tokens: int | None = None) -> None: ...

    def phase(self, name: str):
        return contextlib.nullcontext()

    def count_flops(self, batch: Any):
        return _NO_COUNT

    counting_flops = False

    def end_step(self) -> None: ...

    def log(self, step: int, epoch: int, loss: Any = None) -> None:
        return None

    def summary(self) -> None:
        return None

    def close(self) -> None: ...


def create_telemetry(runtime: Runtime, enabled: bool = True, **options: Any) -> Telemetry | NullTelemetry:
    """A :class:`Telemetry` (``options`` are its keyword arguments), or a :class:`NullTelemetry` when not
    ``enabled``."""
    return Telemetry(runtime, **options) if enabled else NullTelemetry()
