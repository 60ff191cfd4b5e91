"""Lightning's ``Throughput``: batches, samples, items and FLOPs per second over a rolling window, and MFU.

The names of Lightning's ``lightning.fabric.utilities.throughput`` (``Throughput``, ``measure_flops``,
``get_available_flops``) are here: ``from trainscale.telemetry.throughput import Throughput, measure_flops``. The
FLOP count and the peak FLOP/s table are trainscale's own (``trainscale.telemetry.flops``); ``Throughput`` is a port
of Lightning's (itself adapted from MosaicML composer's ``SpeedMonitor``), with its keys, window and errors.
``ThroughputMonitor`` (``trainscale.callbacks``) feeds it from a fit and hands its numbers to the loggers.

    throughput = Throughput(window_size=10)
    t0 = time.perf_counter()
    for i in range(1, 100):
        train_one_batch()
        torch.cuda.synchronize()            # on CUDA: the clock must see the finished work
        throughput.update(time=time.perf_counter() - t0, batches=i, samples=i * batch_size)
        if i % 10 == 0:
            print(throughput.compute())     # {"time": ..., "device/samples_per_sec": ..., ...}
"""

from __future__ import annotations

from collections import deque
from typing import Any

from trainscale.telemetry.flops import get_available_flops, measure_flops
from trainscale.utilities import rank_zero_warn

__all__ = ["Throughput", "compute_dtype", "get_available_flops", "measure_flops"]

# the dtype a precision's matmuls run in (Lightning's ``_plugin_to_compute_dtype``): its peak FLOP/s is that dtype's
_COMPUTE_DTYPES = {"16-mixed": "float16", "bf16-mixed": "bfloat16", "bf16-true": "bfloat16", "16-true": "float16",
                   "64-true": "float64"}


def compute_dtype(precision: str) -> Any:
    """The ``torch.dtype`` of a precision flag's matmuls: float16 for "16-mixed", bfloat16 for "bf16-mixed" and
    "bf16-true", float64 for "64-true", float32 for "32-true" (Lightning's ``_plugin_to_compute_dtype``)."""
    import torch

    return getattr(torch, _COMPUTE_DTYPES.get(str(precision), "float32"))


class Throughput:
    """Throughput over the ``window_size`` most recent :meth:`update` calls, as Lightning's ``Throughput``.

    :meth:`compute` returns (``/`` is ``separator``):

    - always: ``time`` (the last elapsed seconds given), ``batches``, ``samples``, and ``lengths`` when given;
    - once ``window_size`` updates are in: ``device/batches_per_sec`` and ``device/samples_per_sec`` (the window's
      growth over its time span: ``(last - first) / (t_last - t_first)``), ``device/items_per_sec`` with lengths;
      with ``world_size`` > 1 also ``batches_per_sec``, ``samples_per_sec``, ``items_per_sec`` (× ``world_size``:
      the devices are taken as alike);
    - once ``window_size`` FLOP values are in: ``device/flops_per_sec`` (the window's FLOPs but its first, per
      second of its span), ``flops_per_sec`` with ``world_size`` > 1, and ``device/mfu`` (``device/flops_per_sec``
      ÷ ``available_flops``) when ``available_flops`` is known.

    Padding is counted as items and FLOPs: ``samples_per_sec`` is the honest figure for padded batches.

    Args:
        available_flops: peak FLOP/s of one device (:func:`get_available_flops`), or None (no MFU).
        world_size: devices across all hosts.
        window_size: updates in the rolling window, at least 2 (the rates are differences of its ends).
        separator: between ``device`` and a key.
        using_sparse_model: the model uses 2:4 structured sparsity: ``available_flops`` is multiplied by
            ``sparse_cuda_acceleration_factor``. None (the default) takes the model as dense, with Lightning's
            warning when ``available_flops`` is given.
        sparse_cuda_acceleration_factor: at least 1.

    Raises:
        ValueError: ``world_size`` below 1, ``window_size`` below 2, a sparse factor below 1 (Lightning: an
            ``AssertionError``).
    """

    def __init__(self, available_flops: float | None = None, world_size: int = 1, window_size: int = 100,
                 separator: str = "/", using_sparse_model: bool | None = None,
                 sparse_cuda_acceleration_factor: float = 2.0) -> None:
        if sparse_cuda_acceleration_factor < 1.0:
            raise ValueError("sparse acceleration factor cannot reduce peak FLOPs: give "
                             f"sparse_cuda_acceleration_factor >= 1, not {sparse_cuda_acceleration_factor}")
        if world_size < 1:
            raise ValueError(f"Throughput(world_size={world_size}): give the number of devices, at least 1")
        if window_size < 2:
            raise ValueError(f"Throughput(window_size={window_size}): give at least 2 (the rates are differences "
                             "between the window's first and last values)")
        if using_sparse_model is None and available_flops is not None:
            rank_zero_warn("MFU assumes dense model FLOPs (no sparsity acceleration). Set 'using_sparse_model=True' "
                           "for MFU to use sparse FLOPs.")
        if using_sparse_model and available_flops is not None:
            available_flops = available_flops * sparse_cuda_acceleration_factor
        self.available_flops = available_flops
        self.separator = separator
        self.world_size = world_size
        # values that must grow: a counter or clock that goes back (a user's mistake) is an error, not a rate
        self._time: _MonotonicWindow = _MonotonicWindow(window_size)
        self._batches: _MonotonicWindow = _MonotonicWindow(window_size)
        self._samples: _MonotonicWindow = _MonotonicWindow(window_size)
        self._lengths: _MonotonicWindow = _MonotonicWindow(window_size)
        self._flops: deque = deque(maxlen=window_size)

    def update(self, *, time: float, batches: int, samples: int, lengths: int | None = None,
               flops: float | None = None) -> None:
        """Add one reading.

        Args:
            time: seconds elapsed since the start, growing with each call.
            batches: batches seen by this device so far, growing.
            samples: samples seen by this device so far, growing, at least ``batches``.
            lengths: items (tokens, ...) seen by this device so far, at least ``samples``; give it at every update
                or never.
            flops: FLOPs this device ran since the last update (:func:`measure_flops` per batch × batches); the
                window sums them × ``world_size``.

        Raises:
            ValueError: a value that does not grow ("Expected the value to increase, last: 1, current: 1"),
                ``samples`` below ``batches``, ``lengths`` below ``samples`` (Lightning's words).
            RuntimeError: ``lengths`` given at some updates and not at others.
        """
        self._time.append(time)
        if samples < batches:
            raise ValueError(f"Expected samples ({samples}) to be greater or equal than batches ({batches})")
        self._batches.append(batches)
        self._samples.append(samples)
        if lengths is not None:
            if lengths < samples:
                raise ValueError(f"Expected lengths ({lengths}) to be greater or equal than samples ({samples})")
            self._lengths.append(lengths)
            if len(self._samples) != len(self._lengths):
                raise RuntimeError(f"If lengths are passed ({len(self._lengths)}), there needs to be the same number "
                                   f"of samples ({len(self._samples)})")
        if flops is not None:
            self._flops.append(flops * self.world_size)  # the FLOPs of all devices

    def compute(self) -> dict[str, int | float]:
        """The numbers of the class docstring, from the readings so far (at least one :meth:`update`)."""
        metrics: dict[str, int | float] = {"time": self._time[-1], "batches": self._batches[-1],
                                           "samples": self._samples[-1]}
        if self._lengths:
            metrics["lengths"] = self._lengths[-1]
        dev = f"device{self.separator}"
        world = self.world_size
        if len(self._time) == self._time.maxlen:  # the rates wait for a full window
            elapsed = self._time[-1] - self._time[0]  # > 0: the window's values grow
            batches_per_sec = (self._batches[-1] - self._batches[0]) / elapsed
            samples_per_sec = (self._samples[-1] - self._samples[0]) / elapsed
            metrics[f"{dev}batches_per_sec"] = batches_per_sec
            metrics[f"{dev}samples_per_sec"] = samples_per_sec
            if world > 1:
                metrics.update(batches_per_sec=batches_per_sec * world, samples_per_sec=samples_per_sec * world)
            if len(self._lengths) == self._lengths.maxlen:
                items_per_sec = (self._lengths[-1] - self._lengths[0]) / elapsed
                metrics[f"{dev}items_per_sec"] = items_per_sec
                if world > 1:
                    metrics["items_per_sec"] = items_per_sec * world
        if len(self._flops) == self._flops.maxlen:
            # the first value's FLOPs were spent before the window's first time: they are left out
            flops_per_sec = (sum(self._flops) - self._flops[0]) / (self._time[-1] - self._time[0])
            if world > 1:
                metrics["flops_per_sec"] = flops_per_sec
            metrics[f"{dev}flops_per_sec"] = flops_per_sec / world
            if self.available_flops:
                metrics[f"{dev}mfu"] = flops_per_sec / world / self.available_flops
        return metrics

    @property
    def last_time(self) -> float | None:
        """The ``time`` of the last :meth:`update` in the window (seconds), None without one."""
        return self._time[-1] if self._time else None

    def reset(self) -> None:
        """Forget every reading."""
        for window in (self._time, self._batches, self._samples, self._lengths, self._flops):
            window.clear()


class _MonotonicWindow(list):
    """The last ``maxlen`` values appended, each larger than the one before (Lightning's ``_MonotonicWindow``)."""

    def __init__(self, maxlen: int) -> None:
        super().__init__()
        self.maxlen = maxlen

    def append(self, value: Any) -> None:
        """Add ``value`` at the end, dropping the oldest beyond ``maxlen``.

        Raises:
            ValueError: ``value`` is not larger than the last one.
        """
        if self and self[-1] >= value:
            raise ValueError(f"Expected the value to increase, last: {self[-1]}, current: {value}")
        super().append(value)
        if len(self) > self.maxlen:
            del self[0]
