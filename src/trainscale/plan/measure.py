"""The measured part of the time prediction: one device's forward, backward and optimizer seconds per
micro-batch, from a short real run (warm-up steps untimed, then the median of timed steps).

This allocates the model on the device, unlike :mod:`trainscale.plan.memory`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class ComputeTime:
    """Median seconds per micro-batch of ``batch_size`` on one device."""

    batch_size: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    device: str


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_compute(model: nn.Module, sample: tuple, batch_size: int, loss_fn: Callable, optimizer_fn: Callable,
                    precision: str = "32-true", device: torch.device | None = None, steps: int = 10,
                    warmup: int = 3) -> ComputeTime:
    """Time ``steps`` training steps of ``model`` (a real module, moved to ``device``) on a batch of
    ``batch_size`` copies of ``sample`` after ``warmup`` untimed steps.

    Args:
        model: the module to time; it is trained (its weights change).
        sample: one example ``(input, target)``.
        device: default: the first CUDA device, else the CPU.

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
    times: list[tuple[float, float, float]] = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        with prec.autocast():
            loss = loss_fn(model(x), y)
        _sync(device)
        t1 = time.perf_counter()
        prec.backward(loss)
        _sync(device)
        t2 = time.perf_counter()
        prec.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    fwd, bwd, opt = (statistics.median(col) for col in zip(*times))
    return ComputeTime(batch_size, fwd, bwd, opt, str(device))
