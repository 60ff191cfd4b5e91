"""The learning-rate range test of ``Tuner.lr_find`` (Lightning's ``tuner/lr_finder.py``, Smith 2017, "Cyclical
Learning Rates for Training Neural Networks", section 3.3).

    lr_finder = Tuner(trainer).lr_find(model, min_lr=1e-6, max_lr=1.0, num_training=100)
    lr_finder.results        # {"lr": [...], "loss": [...]}: one point per optimizer step
    lr_finder.suggestion()   # the learning rate where the smoothed loss falls fastest
    lr_finder.plot(suggest=True)

**The schedule** (Lightning's ``_ExponentialLR``/``_LinearLR``, here a ``torch.optim.lr_scheduler.LambdaLR`` over the
run's optimizer, stepped by the Trainer after every optimizer step): step ``k`` (from 0) trains at ``min_lr`` for
``k = 0`` and at ``min_lr · (max_lr / min_lr) ** ((k + 1) / num_training)`` ("exponential") or
``min_lr + (k + 1) / num_training · (max_lr - min_lr)`` ("linear") after it, so the last step trains at ``max_lr``.

**The loss recorded** at step ``k`` is Lightning's smoothed loss: ``avg = β·avg + (1-β)·loss`` with ``β = 0.98``,
divided by ``1 - β ** (s + 1)`` where ``s`` is the global step after the step (from 1). The test stops early once
the smoothed loss exceeds ``early_stop_threshold`` times the best so far (from the second step on).

**The suggestion** (Lightning's ``_LRFinder.suggestion``): the learning rate at the steepest negative gradient of
the recorded loss over the learning rate, ``torch.gradient(loss, spacing=[lr])``, after dropping ``skip_begin``
points at the start, ``skip_end`` at the end and the non-finite losses.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from trainscale.tuner.scratch import StateKeeper
from trainscale.utilities.types import LRSchedulerConfig

_log = logging.getLogger(__name__)
BETA = 0.98  # Lightning's _LRCallback smoothing


def lr_factor(step: int, ratio: float, num_training: int, mode: str) -> float:
    """The multiple of ``min_lr`` that step ``step`` (from 0) trains at, ``ratio = max_lr / min_lr`` (see the
    module docstring): what ``LambdaLR`` multiplies the initial learning rate by."""
    if step == 0:
        return 1.0
    r = (step + 1) / num_training
    return ratio ** r if mode == "exponential" else 1.0 + r * (ratio - 1.0)


class LRFinder:
    """What ``Tuner.lr_find`` returns (Lightning's ``_LRFinder``): the points of the range test in ``results``
    (``{"lr": [...], "loss": [...]}``, the learning rate of each optimizer step and the smoothed loss after it).

    Args:
        mode: "exponential" or "linear", how the learning rate grew. lr_min, lr_max: its bounds.
        num_training: the steps asked for (``results`` holds fewer after an early stop).
    """

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int) -> None:
        self.mode, self.lr_min, self.lr_max, self.num_training = mode, lr_min, lr_max, num_training
        self.results: dict[str, list[float]] = {}
        self._optimal_idx: int | None = None

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The learning rate where the recorded loss falls fastest (its steepest negative gradient over the
        learning rate), skipping ``skip_begin`` points at the start and ``skip_end`` at the end; None (with an
        error logged, as Lightning) when fewer than two finite points remain: run more steps (``num_training``)
        or give more batches."""
        losses = torch.tensor(self.results["loss"][skip_begin:-skip_end], dtype=torch.float64)
        lrs = torch.tensor(self.results["lr"][skip_begin:-skip_end], dtype=torch.float64)
        finite = torch.isfinite(losses)
        losses, lrs = losses[finite], lrs[finite]
        if len(losses) < 2:
            _log.error("Failed to compute suggestion for learning rate because there are not enough points. Increase "
                       "the loop iteration limits or the size of your dataset/dataloader.")
            self._optimal_idx = None
            return None
        gradients = torch.gradient(losses, spacing=[lrs])[0]
        kept = torch.arange(len(self.results["loss"]))[skip_begin:-skip_end][finite]
        self._optimal_idx = int(kept[int(torch.argmin(gradients))])
        return self.results["lr"][self._optimal_idx]

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """The loss over the learning rate (a log axis in "exponential" mode), with the suggestion as a red dot
        (``suggest``); ``show`` calls ``plt.show()``; drawn on ``ax`` when given. Returns the matplotlib figure.

        Raises:
            ImportError: matplotlib is not installed: ``pip install 'trainscale[plot]'``.
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise ImportError("LRFinder.plot needs matplotlib: pip install 'trainscale[plot]'") from err
        lrs, losses = self.results["lr"], self.results["loss"]
        fig, ax = plt.subplots() if ax is None else (ax.figure, ax)
        ax.plot(lrs, losses)
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest and self.suggestion() is not None:
            ax.plot(lrs[self._optimal_idx], losses[self._optimal_idx], markersize=10, marker="o", color="red")
        if show:
            plt.show()
        return fig


class RangeTest(StateKeeper):
    """The callback of the throwaway fit that runs the range test (Lightning's ``_exchange_scheduler`` and
    ``_LRCallback``): at ``on_fit_start`` it saves the model's and the optimizer's state (restored by
    :meth:`~trainscale.tuner.scratch.StateKeeper.restore`), puts the optimizer at ``min_lr`` and gives the Trainer the schedule as its only scheduler
    (``interval="step"``; the module's own schedulers do not step during the test, as in Lightning); after each
    optimizer step it records the learning rate and the smoothed loss and asks the fit to stop when the loss
    diverges."""

    def __init__(self, finder: LRFinder, early_stop_threshold: float | None) -> None:
        super().__init__()
        self.finder, self.early_stop_threshold = finder, early_stop_threshold
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.avg_loss = self.best_loss = 0.0
        self._lr = float("nan")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.manual_optimizers:
            raise ValueError("lr_find steps the learning rate after each optimizer step the Trainer takes; under manual "
                             "optimization (automatic_optimization = False) the module steps itself: set "
                             "automatic_optimization = True for the range test, or run it by hand")
        if len(trainer.optimizers) != 1:
            raise ValueError(f"`model.configure_optimizers()` returned {len(trainer.optimizers)}, but learning rate "
                             "finder only works with single optimizer")
        super().on_fit_start(trainer, pl_module)  # the state restore() puts back
        optimizer, f = trainer.optimizers[0], self.finder
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] = f.lr_min
        factor = functools.partial(lr_factor, ratio=f.lr_max / f.lr_min, num_training=f.num_training, mode=f.mode)
        trainer.schedulers = [LRSchedulerConfig(torch.optim.lr_scheduler.LambdaLR(optimizer, factor), interval="step")]

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._lr = trainer.optimizers[0].param_groups[0]["lr"]  # the step's (recorded at its end)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not trainer.is_step_end:  # a micro-batch inside an accumulated step
            return
        self.lrs.append(self._lr)
        if not outputs:  # a training_step that returned nothing ({}): a point the suggestion skips
            self.losses.append(float("nan"))
            return
        step = trainer.global_step
        self.avg_loss = BETA * self.avg_loss + (1 - BETA) * float(outputs["loss"])
        smoothed = self.avg_loss / (1 - BETA ** (step + 1))
        stop = self.early_stop_threshold is not None and step > 1 and smoothed > self.early_stop_threshold * self.best_loss
        rt = trainer.runtime
        if rt.world_size > 1:  # rank zero decides, so every rank stops after the same step
            stop = bool(rt.broadcast_object(stop))
        trainer.should_stop = trainer.should_stop or stop
        if smoothed < self.best_loss or step == 1:
            self.best_loss = smoothed
        self.losses.append(smoothed)
