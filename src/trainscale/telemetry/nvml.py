"""GPU utilisation and memory from NVML, sampled on a background thread, tied to step numbers.

Uses NVIDIA's ``nvidia-ml-py`` (module ``pynvml``; ``pip install 'trainscale[gpu]'``), imported
lazily. Without it, without a driver, or on a CPU-only machine the sampler is simply not
available (``available`` is False, readings are None): training is never affected.
``nvmlDeviceGetUtilizationRates(...).gpu`` is the per cent of the last sample period (1/6 s to
1 s, by product) during which one or more kernels ran on the GPU — a busy-ness measure, not a
FLOP/s one. https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html
"""

from __future__ import annotations

import threading
from typing import Callable


def _nvml_handle(pynvml, cuda_index: int):
    """The NVML handle of CUDA device ``cuda_index``, found by its UUID as CUDA reports it.

    NVML numbers devices in PCI bus order, CUDA in its own (``CUDA_DEVICE_ORDER``, FASTEST_FIRST by
    default) after ``CUDA_VISIBLE_DEVICES`` (indices, full or partial UUIDs) renumbered them: only the
    UUID names the same device on both sides. ``torch.cuda.get_device_properties(i).uuid`` prints
    without NVML's "GPU-" (or, for a MIG instance, "MIG-") prefix.
    """
    import torch

    uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
    for prefix in ("GPU-", "MIG-"):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(f"{prefix}{uuid}".encode())
        except pynvml.NVMLError:
            continue
    raise LookupError(f"NVML knows no device with UUID {uuid}")


def _nvml_reader(cuda_index: int) -> Callable[[], tuple[float, float]] | None:
    """A function returning (utilisation %, memory used bytes) of CUDA device ``cuda_index``, or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = _nvml_handle(pynvml, cuda_index)
    except Exception:  # noqa: BLE001 - no library, no driver, no device: "not available"
        return None

    def read() -> tuple[float, float]:
        return (float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                float(pynvml.nvmlDeviceGetMemoryInfo(handle).used))

    return read


class GpuSampler:
    """Sample a GPU every ``interval_s`` seconds on a daemon thread.

    Args:
        cuda_index: the CUDA device index (this rank's local device), or None (nothing to sample).
        interval_s: seconds between samples.
        read: a function returning ``(utilisation %, memory used bytes)``; default NVML.

    Attributes:
        available: whether samples can be taken.
        step: set by the training loop; each sample is tagged with the step it was taken in.
    """

    def __init__(self, cuda_index: int | None, interval_s: float = 0.5,
                 read: Callable[[], tuple[float, float]] | None = None) -> None:
        self.interval_s = interval_s
        self._read = read or (_nvml_reader(cuda_index) if cuda_index is not None else None)
        self.available = self._read is not None
        self.step = 0
        self._samples: list[tuple[int, float, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "GpuSampler":
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trainscale-nvml", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                util, used = self._read()
            except Exception:  # noqa: BLE001 - a failing driver call ends sampling, not training
                self.available = False
                return
            with self._lock:
                self._samples.append((self.step, util, used))
            self._stop.wait(self.interval_s)

    def take(self) -> list[tuple[int, float, float]]:
        """Samples ``(step, utilisation %, memory used bytes)`` taken since the last call."""
        with self._lock:
            samples, self._samples = self._samples, []
        return samples

    def __getstate__(self) -> dict:
        """A pickled sampler (``torch.save(trainer)``, as Lightning's Trainer pickles) is a stopped one: its thread,
        lock and driver reader stay in this process; the samples not taken yet are kept."""
        state = dict(self.__dict__, _read=None, available=False, _thread=None)
        del state["_lock"], state["_stop"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock(), _stop=threading.Event())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
