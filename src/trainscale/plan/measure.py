"""The measured part of the time prediction: short runs of the real :class:`~trainscale.loop.trainer.Trainer`
(the loop bench times), one device's in the planner's process and, inside ``trainscale plan --probe``'s
processes, a real DDP run (:mod:`trainscale.plan.probe`). Each batch size gets a warm-up run
(``WARMUP_STEPS``, untimed) and a timed one of at least ``STEPS`` steps and about ``MIN_SECONDS`` of
wall time (its length read from the warm-up's step; the epoch, if shorter); the Trainer's
telemetry splits the timed steps into data, forward, backward (with the gradient all-reduce's exposed
part separated) and optimizer seconds, and the rest of the loop's wall time (the Trainer's own
per-step work: callbacks, fault checks, loss bookkeeping) is kept as ``other_s``.

Why the real loop and not a hand-written step: measured on this 2-core VM (docs/plan.md), a
hand-written step of the ConvNet missed 4–10 % of the Trainer's step on one process and more on two
(DDP's forward and its Reducer's per-bucket work, the DistributedSampler's loader), so predictions
were systematically low.

This allocates the model on the device, unlike :mod:`trainscale.plan.memory`. On a CPU a "device" is
what a bench cell gives each process: ``cores ÷ processes`` threads
(``trainscale.jobs.launcher.threads_per_process``), so the planner passes ``threads``.
"""

from __future__ import annotations

import contextlib
import copy
import io
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

WARMUP_STEPS = 3
STEPS = 20
# Seconds a timed run lasts at least: 20 steps of a 7 ms step (the ConvNet at batch 4 on 2 processes) are
# 0.14 s, which one descheduled moment on a shared host moves by half (two probes a minute apart predicted
# 5.3 and 3.4 s for the same epoch, docs/plan.md); the epoch averages such moments over its whole length.
MIN_SECONDS = 2.0


@dataclass(frozen=True)
class ComputeTime:
    """Mean seconds per step of ``batch_size`` per device: forward, backward (compute only), optimizer;
    ``comm_s``: the gradient communication the step waited for (exposed; 0 on one device);
    ``hidden_comm_s``: the communication that ran while backward computed; ``data_s``: the data
    loader's wait; ``other_s``: the rest of the loop's wall time (the Trainer's own work)."""

    batch_size: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    device: str
    comm_s: float = 0.0
    data_s: float = 0.0
    other_s: float = 0.0
    hidden_comm_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s + self.comm_s + self.data_s + self.other_s

    @property
    def overlap(self) -> float:
        """The share of backward that hid communication (``hidden_comm_s / backward_s``, within [0, 1]):
        the ``overlap`` of :func:`trainscale.plan.comm.step_s`, measured."""
        return min(1.0, self.hidden_comm_s / self.backward_s) if self.backward_s > 0 else 0.0


@contextlib.contextmanager
def num_threads(threads: int | None):
    """``torch.set_num_threads(threads)`` inside the block (nothing for None)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def from_summary(batch_size: int, summary: dict) -> ComputeTime:
    """A :class:`ComputeTime` from ``Trainer.fit``'s summary: the telemetry's per-step phases (means over
    ranks), its exposed and total gradient communication (``trainscale.telemetry.overlap``: backward
    holds the exposed part, which is moved to ``comm_s``), and the loop's wall time per step (the
    epoch times over the steps) less the phases as ``other_s``.

    Raises:
        ValueError: the summary has no telemetry or no step.
    """
    tel = summary.get("telemetry") or {}
    phases, steps = tel.get("phase_s"), summary.get("steps")
    if not phases or not steps:
        raise ValueError("the timed run has no telemetry or no step: run the Trainer with enable_telemetry=True")
    exposed = tel.get("exposed_comm_s") or 0.0
    total = tel.get("comm_s") or 0.0
    wall = sum(summary["epoch_time_s"]) / steps
    return ComputeTime(batch_size, phases["forward"], max(0.0, phases["backward"] - exposed), phases["optimizer"],
                       summary.get("device", ""), comm_s=exposed, data_s=phases["data"],
                       other_s=max(0.0, wall - sum(phases.values())), hidden_comm_s=max(0.0, total - exposed))


def _timed_steps(warm: dict, steps: int, min_seconds: float) -> int:
    """Steps of the timed run: ``steps``, or more to last ``min_seconds`` at the warm-up's seconds per step;
    the largest over the ranks (all-reduced when a process group runs), so every rank runs as many."""
    import math

    import torch.distributed as dist

    per_step = sum(warm["epoch_time_s"]) / max(1, warm["steps"])
    n = max(steps, math.ceil(min_seconds / per_step) if per_step > 0 else steps)
    if not dist.is_initialized():
        return n
    agreed = torch.tensor(n, device="cuda" if dist.get_backend() == "nccl" else "cpu")  # nccl reduces CUDA tensors
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return int(agreed)


class _Repeated(torch.utils.data.Dataset):
    """``n`` copies of one example (a workload given as a model and a sample, without a data set)."""

    def __init__(self, sample: tuple, n: int) -> None:
        self.sample, self.n = tuple(torch.as_tensor(t) for t in sample), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple:
        return self.sample


def trainer_steps(model: nn.Module, dataset: Any, sample: tuple, batch_sizes: list[int], loss_fn: Callable,
                  optimizer_fn: Callable, precision: str, root: str, threads: int | None = None,
                  loader_kwargs: dict | None = None, steps: int = STEPS, min_seconds: float = MIN_SECONDS,
                  strategy_options: dict | None = None) -> dict[int, ComputeTime]:
    """Per batch size, the real Trainer's step on this process: one device, or this rank of the running
    process group under ``strategy="ddp"`` (every rank must call it). The Trainer's output is silenced.

    Args:
        model: copied for each run (never trained itself).
        dataset: the training set (shuffled through a ``DataLoader`` with ``loader_kwargs``); None: copies
            of ``sample``.
        root: the runs' ``default_root_dir`` (the same path on every rank).
        threads: CPU threads for the runs (None: torch's current setting).
        steps, min_seconds: the timed run's least steps and its least wall time (s), whichever is longer.
        strategy_options: ddp's options (``bucket_cap_mb``, ...), for several ranks.
    """
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from trainscale.loop.trainer import Trainer

    world = dist.get_world_size() if dist.is_initialized() else 1
    data = dataset if dataset is not None else _Repeated(sample, max(batch_sizes) * world * (WARMUP_STEPS + steps))
    # (copies of the sample hold WARMUP_STEPS + steps batches per rank: a timed run ends there, at the epoch's end)
    common = dict(devices=world, strategy="ddp" if world > 1 else "auto", precision=precision, seed=0,
                  max_epochs=1, enable_progress_bar=False, enable_checkpointing=False, log_every_n_steps=10**9,
                  handle_signals=False, default_root_dir=root,
                  strategy_options=(strategy_options or None) if world > 1 else None)
    out = {}
    with num_threads(threads), contextlib.redirect_stdout(io.StringIO()):
        for bs in batch_sizes:
            loader = DataLoader(data, batch_size=bs, shuffle=True, **(loader_kwargs or {}))
            # the warm-up run pays kernels, allocator, DDP's first buckets, and tells the step's length
            warm = Trainer(max_steps=WARMUP_STEPS, **common).fit(copy.deepcopy(model), loader, loss_fn=loss_fn,
                                                                 optimizer=optimizer_fn)
            n = _timed_steps(warm, steps, min_seconds)
            summary = Trainer(max_steps=n, **common).fit(copy.deepcopy(model), loader, loss_fn=loss_fn,
                                                         optimizer=optimizer_fn)
            out[bs] = from_summary(bs, summary)
    return out


def counted_compute(meta_model: nn.Module, sample: tuple, batch_size: int, loss_fn: Callable, precision: str,
                    device_flops: float) -> ComputeTime:
    """Forward and backward seconds of a device you are not on: the step's FLOPs, counted by PyTorch's
    ``torch.utils.flop_counter.FlopCounterMode`` on fake tensors (no storage), divided by the device's
    FLOP/s ``device_flops`` (e.g. 989e12, an H100 SXM's dense bf16 peak in NVIDIA's datasheet).

    At the peak rate (a model FLOPs utilisation of 1) these are lower bounds. The optimizer (memory-bound,
    a few FLOPs per parameter) and the data loader are counted as 0 s.

    Raises:
        ValueError: ``device_flops`` not positive.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from trainscale.plan import memory
    from trainscale.runtime.precision import Precision

    if not device_flops > 0:
        raise ValueError(f"device_flops={device_flops!r} must be the device's FLOP/s, e.g. 989e12")
    prec = Precision(precision, "cpu")
    with memory._fake_mode():
        model = memory._fake_copy(meta_model, precision)
        x, y = prec.convert_input(memory._fake_batch(sample, batch_size))
        with FlopCounterMode(display=False) as forward:
            with prec.autocast():
                loss = loss_fn(model(x), y)
        with FlopCounterMode(display=False) as backward:
            loss.backward()
    return ComputeTime(batch_size, forward.get_total_flops() / device_flops,
                       backward.get_total_flops() / device_flops, 0.0, f"{device_flops:.4g} FLOP/s (counted)")
