"""The measured part of the time prediction: one device's forward, backward and optimizer seconds per
micro-batch, from a short real run (warm-up steps untimed, then the mean of timed steps); the data
loader's seconds per batch; and, inside ``trainscale plan --probe``'s processes, the same step with
the collectives a DDP step issues, timed where DDP issues them (:mod:`trainscale.plan.probe`).

This allocates the model on the device, unlike :mod:`trainscale.plan.memory`.

On a CPU a "device" is what a bench cell gives each process: ``cores ÷ processes`` threads
(``trainscale.bench.runner.threads_per_process``), so the planner passes ``threads``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class ComputeTime:
    """Mean seconds per micro-batch of ``batch_size`` on one device; ``comm_s``: the collectives timed
    in the step (0 outside the probe); ``data_s``: the data loader's seconds per batch (0: not measured)."""

    batch_size: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    device: str
    comm_s: float = 0.0
    data_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s + self.comm_s + self.data_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _timed_step(model, optimizer, x, y, loss_fn, prec, device, collectives) -> tuple[float, float, float, float]:
    """One training step: ``(forward, backward, collectives, optimizer)`` seconds."""
    _sync(device)
    t0 = time.perf_counter()
    if collectives is not None:
        collectives.before_forward()
    t1 = time.perf_counter()
    with prec.autocast():
        loss = loss_fn(model(x), y)
    _sync(device)
    t2 = time.perf_counter()
    prec.backward(loss)
    _sync(device)
    t3 = time.perf_counter()
    if collectives is not None:
        collectives.after_backward()
    t4 = time.perf_counter()
    prec.optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    _sync(device)
    return t2 - t1, t3 - t2, (t1 - t0) + (t4 - t3), time.perf_counter() - t4


def measure_compute(model: nn.Module, sample: tuple, batch_size: int, loss_fn: Callable, optimizer_fn: Callable,
                    precision: str = "32-true", device: torch.device | None = None, steps: int = 10,
                    warmup: int = 3, threads: int | None = None, collectives: Any = None) -> ComputeTime:
    """Time ``steps`` training steps of ``model`` (a real module, moved to ``device``) on a batch of
    ``batch_size`` copies of ``sample`` after ``warmup`` untimed steps.

    Args:
        model: the module to time; it is trained (its weights change).
        sample: one example ``(input, target)``.
        device: default: the first CUDA device, else the CPU.
        threads: CPU threads for the run (None: torch's current setting).
        collectives: None, or an object whose ``before_forward()`` and ``after_backward()`` run a step's
            collectives where DDP runs them (the probe's; see :mod:`trainscale.plan.probe`), timed as ``comm_s``.

    Raises:
        ValueError: ``steps`` < 1 or ``warmup`` < 0.
    """
    from trainscale.runtime.precision import Precision

    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prec = Precision(precision, device.type)
    model = prec.convert_module(model.to(device))
    optimizer = optimizer_fn(model.parameters())
    x, y = (torch.stack([torch.as_tensor(t)] * batch_size).to(device) for t in sample)
    x = prec.convert_input(x)
    with num_threads(threads):
        times = [_timed_step(model, optimizer, x, y, loss_fn, prec, device, collectives)
                 for _ in range(warmup + steps)][warmup:]
    # the mean, not the median: an epoch is the sum of its steps, and on a shared host the slow steps
    # (a descheduled process, a peer that wakes late) are part of that sum
    fwd, bwd, comm, opt = (statistics.fmean(col) for col in zip(*times))
    return ComputeTime(batch_size, fwd, bwd, opt, str(device), comm_s=comm)


def measure_data(dataset: Any, batch_size: int, loader_kwargs: dict | None = None, batches: int = 20,
                 threads: int | None = None) -> float:
    """Seconds per batch to draw shuffled batches of ``batch_size`` from ``dataset`` through a
    ``DataLoader`` built with the workload's ``loader_kwargs`` (bench's ``dataloader`` entry): the loop's
    data wait when the loader runs in the training process (``num_workers=0``), an upper bound with workers."""
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, **(loader_kwargs or {}))
    with num_threads(threads):
        it = iter(loader)
        next(it, None)  # the first batch starts the workers, if any
        t0, n = time.perf_counter(), 0
        for _ in range(batches):
            if next(it, None) is None:
                break
            n += 1
    return (time.perf_counter() - t0) / n if n else 0.0


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
