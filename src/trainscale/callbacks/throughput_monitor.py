"""Lightning's ``ThroughputMonitor``: batches, samples, items and FLOPs per second and MFU of a fit, to the loggers."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from trainscale.callbacks.base import Callback
from trainscale.telemetry.throughput import Throughput, compute_dtype, get_available_flops
from trainscale.utilities import rank_zero_only, rank_zero_warn

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer


class ThroughputMonitor(Callback):
    """``ThroughputMonitor(batch_size_fn, length_fn=None, **kwargs)``, as Lightning's
    ``lightning.pytorch.callbacks.ThroughputMonitor``: a :class:`~trainscale.telemetry.throughput.Throughput` per
    stage (``kwargs``: its ``window_size``, ``separator``, ``using_sparse_model``, ...), fed after each training and
    validation batch of a fit, its numbers given to each logger's ``log_metrics`` under the stage's name::

        class Model(TrainingModule):
            def setup(self, stage):
                with torch.device("meta"):
                    net, x = Net(), torch.randn(32, 784)
                    self.flops_per_batch = measure_flops(net, lambda: net(x), lambda y: y.sum())

        monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0))
        Trainer(callbacks=[monitor], log_every_n_steps=10).fit(Model())
        # metrics.csv: train/time, train/batches, train/samples, train/device/samples_per_sec, train/device/mfu, ...

    On rank zero, as Lightning's: ``on_train_start`` starts the clock; each training batch's ``on_train_batch_end``
    reads it (after ``torch.cuda.synchronize`` on CUDA, so that the batch's work is done) and counts the batch,
    ``batch_size_fn(batch)`` samples, ``length_fn(batch)`` items and the module's ``flops_per_batch`` FLOPs (an
    attribute or property read at every batch; without one, Lightning's warning, once, and no FLOPs or MFU). At a
    batch that ends an optimizer step (not one that accumulates) of a log step (every ``log_every_n_steps``, or a
    stopping fit: Lightning's ``should_update_logs``) the loggers get ``train/<key>`` and ``epoch`` at the step
    number of that step's record (``trainer.batches_that_stepped`` before it). The fit's validation (not the sanity
    check) is measured the same way, from 0 at each ``on_validation_start``, logged as ``validate/<key>`` at the
    fit's validation batches so far when that run's batch count is a multiple of ``log_every_n_steps``; its time
    (and the gap before it) is taken out of the training clock at ``on_validation_end``. The peak FLOP/s for MFU:
    ``Trainer(peak_flops=...)`` when given, else trainscale's table for the device and the precision's dtype
    (:func:`~trainscale.telemetry.throughput.get_available_flops`; none on a CPU, so no MFU there).

    Differences from Lightning: ``validate``/``test``/``predict`` outside a fit log nothing (trainscale's loggers
    are a fit's, as its own evaluation records are); the loggers' ``save()`` is not called at each log step (they
    write on their own schedule and at the fit's end); the values do not enter ``trainer.logged_metrics``.

    Args:
        batch_size_fn: a batch -> its number of samples (required, as in Lightning).
        length_fn: a batch -> its number of items (tokens, ...), or None (no ``lengths``, ``items_per_sec``).
        **kwargs: :class:`~trainscale.telemetry.throughput.Throughput`'s arguments but ``available_flops`` and
            ``world_size``, which come from the Trainer.

    Raises:
        TypeError: an argument ``Throughput`` does not take, or ``available_flops``/``world_size``.
        ValueError: a ``window_size`` below 2, or another value ``Throughput`` refuses.
    """

    def __init__(self, batch_size_fn: Callable[[Any], int], length_fn: Callable[[Any], int] | None = None,
                 **kwargs: Any) -> None:
        given = sorted({"available_flops", "world_size"} & kwargs.keys())
        if given:
            raise TypeError(f"ThroughputMonitor got {given[0]!r}, which the Trainer gives (its device's peak FLOP/s, "
                            "Trainer(peak_flops=...); its world size): leave it out")
        Throughput(**kwargs)  # a wrong argument fails here, not at the fit's start
        self.kwargs = kwargs
        self.batch_size_fn = batch_size_fn
        self.length_fn = length_fn
        self.available_flops: float | None = None
        self._throughputs: dict[str, Throughput] = {}  # by stage: "train", "validate"
        self._t0s: dict[str, float] = {}  # time.perf_counter() at the stage's start
        self._lengths: dict[str, int] = {}
        self._samples: dict[str, int] = {}
        self._batches: dict[str, int] = {}
        self._module_has_flops: bool | None = None  # read at the first batch, as Lightning's
        self._train_step = 0  # the running training batch's step number (its step record's)
        self._val_batches = 0  # batches of the running validation
        self._val_total = 0  # validation batches of this fit: the step of validation's values

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self.available_flops = trainer.config.peak_flops or get_available_flops(trainer.runtime.device,
                                                                                compute_dtype(trainer.precision))
        self._throughputs = {"train": self._new_throughput(trainer)}  # validation's: at its first start
        self._val_total = 0

    def _new_throughput(self, trainer: Trainer) -> Throughput:
        return Throughput(available_flops=self.available_flops, world_size=trainer.world_size, **self.kwargs)

    def _start(self, trainer: Trainer, stage: str) -> None:
        """The stage's counts from 0 and its clock started (Lightning resets them at every start of a fit's stage)."""
        if stage not in self._throughputs:
            self._throughputs[stage] = self._new_throughput(trainer)
        self._throughputs[stage].reset()
        self._lengths[stage] = self._samples[stage] = self._batches[stage] = 0
        self._t0s[stage] = time.perf_counter()

    @torch.inference_mode()  # batch_size_fn and length_fn record no autograd graph
    def _update(self, trainer: Trainer, pl_module: Any, batch: Any, stage: str) -> None:
        device = trainer.runtime.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the batch's kernels finished: the clock reads their end
        elapsed = time.perf_counter() - self._t0s[stage]
        if self.length_fn is not None:
            self._lengths[stage] += self.length_fn(batch)
        if self._module_has_flops is None:
            self._module_has_flops = hasattr(pl_module, "flops_per_batch")
            if not self._module_has_flops:
                rank_zero_warn("When using the `ThroughputMonitor`, you need to define a `flops_per_batch` attribute "
                               f"or property in {type(pl_module).__name__} to compute the FLOPs.")
        self._samples[stage] += self.batch_size_fn(batch)
        self._batches[stage] += 1
        self._throughputs[stage].update(time=elapsed, batches=self._batches[stage], samples=self._samples[stage],
                                        lengths=None if self.length_fn is None else self._lengths[stage],
                                        flops=pl_module.flops_per_batch if self._module_has_flops else None)

    def _log(self, trainer: Trainer, stage: str, step: int, epoch: int | None = None) -> None:
        """The stage's numbers, named ``<stage><separator><key>`` (and ``epoch`` when given), to each logger."""
        throughput = self._throughputs[stage]
        metrics: dict[str, Any] = {f"{stage}{throughput.separator}{k}": v for k, v in throughput.compute().items()}
        if epoch is not None:
            metrics["epoch"] = epoch
        for logger in trainer.loggers:
            logger.log_metrics(metrics=metrics, step=step)

    @staticmethod
    def _due(trainer: Trainer, count: int) -> bool:
        """Lightning's ``should_update_logs`` for the ``count``-th step or evaluation batch."""
        every = trainer.log_every_n_steps
        return bool(every) and (count % every == 0 or trainer.should_stop)

    @rank_zero_only
    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._start(trainer, "train")

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._train_step = trainer.batches_that_stepped  # the optimizer steps before this batch's

    @rank_zero_only
    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._update(trainer, pl_module, batch, "train")
        # logged once the optimizer has stepped (not while accumulating), so that the step's time is all in
        if trainer.is_step_end and self._due(trainer, self._train_step + 1):
            self._log(trainer, "train", self._train_step, epoch=trainer.current_epoch)

    @rank_zero_only
    def on_validation_start(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.fitting and not trainer.sanity_checking:
            self._val_batches = 0
            self._start(trainer, "validate")

    @rank_zero_only
    def on_validation_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if not trainer.fitting or trainer.sanity_checking:
            return
        self._val_batches += 1
        self._val_total += 1
        self._update(trainer, pl_module, batch, "validate")
        if self._due(trainer, self._val_batches):
            self._log(trainer, "validate", self._val_total)

    @rank_zero_only
    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not trainer.fitting or trainer.sanity_checking or "train" not in self._t0s:
            return
        # the training clock skips the validation and the gap before it (Lightning's rule)
        train_elapsed, val_elapsed = self._throughputs["train"].last_time, self._throughputs["validate"].last_time
        gap = self._t0s["validate"] - (self._t0s["train"] + (train_elapsed or 0.0))
        self._t0s["train"] += gap + (val_elapsed or 0.0)
