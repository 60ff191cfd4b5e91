"""Lightning's ``DeviceStatsMonitor``: the device's memory statistics (CUDA) or the host's CPU and memory use,
written to the loggers around every logged training step and every validation and test batch of a fit."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from trainscale.callbacks.base import Callback

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer


def get_cpu_stats() -> dict[str, float]:
    """Lightning's ``get_cpu_stats``: system-wide ``cpu_percent`` (psutil's, since its previous call),
    ``cpu_vm_percent`` (memory in use) and ``cpu_swap_percent``, each in % (0-100)."""
    import psutil

    return {"cpu_vm_percent": psutil.virtual_memory().percent, "cpu_percent": psutil.cpu_percent(),
            "cpu_swap_percent": psutil.swap_memory().percent}


def get_device_stats(device: torch.device) -> dict[str, Any]:
    """Lightning's ``Accelerator.get_device_stats``: ``torch.cuda.memory_stats(device)`` (the caching allocator's
    counters, bytes and counts, e.g. ``allocated_bytes.all.current``) on a CUDA device, :func:`get_cpu_stats` on the
    CPU, nothing on another device."""
    if device.type == "cuda":
        return torch.cuda.memory_stats(device)
    return get_cpu_stats() if device.type == "cpu" else {}


class DeviceStatsMonitor(Callback):
    """``DeviceStatsMonitor(cpu_stats=None, filter_keys=None)``, as Lightning's ``callbacks.DeviceStatsMonitor``.

    During ``fit``, at ``on_train_batch_start``/``_end`` and ``on_validation_batch_start``/``_end`` when the step is a
    log step (every ``log_every_n_steps``, or a stopping fit: Lightning's ``should_update_logs``), each
    logger's ``log_metrics`` gets this rank's device statistics (:func:`get_device_stats`) named
    ``DeviceStatsMonitor.<hook>/<stat>`` (the logger's ``group_separator`` where it has one), at
    ``trainer.batches_that_stepped`` (the step's, for both hooks of a training batch, as Lightning's). ``cpu_stats``:
    None logs CPU statistics on a CPU device only, True also beside a CUDA device's, False never. ``filter_keys``: a
    set of statistic names to keep (a name that the device does not report is a warning at ``setup``).

    Differences from Lightning: loggers are called on rank zero only (the Trainer's rule), so rank zero's device is
    the one logged; ``validate``/``test`` outside a fit log nothing (the loggers are set up by ``fit``); the values
    reach the loggers only, not ``metrics.jsonl``.

    Raises:
        ValueError: a ``fit`` with ``Trainer(logger=False)`` (Lightning's message; Lightning:
            ``MisconfigurationException``).
    """

    def __init__(self, cpu_stats: bool | None = None, filter_keys: set[str] | None = None) -> None:
        self._cpu_stats = cpu_stats
        self._filter_keys = filter_keys
        self._train_step = 0  # the step of the training batch running (its start's batches_that_stepped)

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise ValueError("Cannot use `DeviceStatsMonitor` callback with `Trainer(logger=False)`.")
        if self._filter_keys is not None:
            unrecognized = self._filter_keys - self._stats(trainer.runtime.device, filtered=False).keys()
            if unrecognized:
                warnings.warn("`DeviceStatsMonitor` filter_keys contains keys not found in device stats and will be "
                              f"ignored: {unrecognized}", UserWarning, stacklevel=2)

    def _stats(self, device: torch.device, filtered: bool = True) -> dict[str, Any]:
        if self._cpu_stats is False and device.type == "cpu":
            return {}
        stats = dict(get_device_stats(device))
        if self._cpu_stats and device.type != "cpu":
            stats.update(get_cpu_stats())
        if filtered and self._filter_keys is not None:
            stats = {k: v for k, v in stats.items() if k in self._filter_keys}
        return stats

    def _log(self, trainer: Trainer, hook: str, step: int) -> None:
        if not (trainer.fitting and trainer.is_global_zero):
            return
        stats = self._stats(trainer.runtime.device)
        if not stats:
            return
        for logger in trainer.loggers:
            prefix = f"{type(self).__qualname__}.{hook}{getattr(logger, 'group_separator', '/')}"
            logger.log_metrics({prefix + k: v for k, v in stats.items()}, step)

    def _log_if_due(self, trainer: Trainer, hook: str, step: int) -> None:
        """Lightning's ``should_update_logs``: the step's records go to the loggers (or the fit is stopping)."""
        if (step + 1) % trainer.log_every_n_steps == 0 or trainer.should_stop:
            self._log(trainer, hook, step)

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._train_step = trainer.batches_that_stepped
        self._log_if_due(trainer, "on_train_batch_start", self._train_step)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._log_if_due(trainer, "on_train_batch_end", self._train_step)

    def on_validation_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._log_if_due(trainer, "on_validation_batch_start", trainer.batches_that_stepped)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self._log_if_due(trainer, "on_validation_batch_end", trainer.batches_that_stepped)
