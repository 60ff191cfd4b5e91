"""Lightning's ``LearningRateMonitor``: its names, arguments, attributes and logging points."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from trainscale.callbacks.base import Callback
from trainscale.scaling.lr_scaling import param_group_names

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer


class LearningRateMonitor(Callback):
    """Lightning's ``LearningRateMonitor(logging_interval, log_momentum, log_weight_decay, log_key_prefix)``.

    Every step and epoch record already holds each param group's learning rate under the same names
    (:func:`~trainscale.scaling.lr_scaling.param_group_names`: ``lr-SGD``; ``lr-SGD/pg1``, ``lr-SGD/pg2`` for two
    groups; a scheduler's ``"name"``; ``lr-Adam-1`` for a second Adam), so this callback adds what Lightning's does
    beyond that: ``<name>-momentum`` (``momentum``, or Adam's first beta; 0 for an optimizer with neither, with a
    ``RuntimeWarning``) with ``log_momentum=True``, ``<name>-weight_decay`` with ``log_weight_decay=True``, every
    name prefixed with ``log_key_prefix`` (``"optim/"``: ``optim/lr-SGD``) when it is given, and these values in
    ``trainer.callback_metrics`` (as tensors), where ``EarlyStopping`` can monitor them.

    When, as in Lightning: ``logging_interval="step"``: every optimizer's values at the start of each batch whose
    step is a log step (``log_every_n_steps``); ``"epoch"``: at each epoch's start; None: the optimizers of
    ``"step"`` schedulers at the log steps, those of ``"epoch"`` schedulers at each epoch's start, and the
    optimizers without a scheduler at both. ``lrs`` maps each name to the rates seen then (an optimizer that gains
    param groups goes on under ``<name>/pg1``, moved last, as Lightning's), ``last_momentum_values`` and
    ``last_weight_decay_values`` each ``<name>-momentum``/``<name>-weight_decay`` to its last value (None until one
    is logged).

    Raises:
        ValueError: an unknown ``logging_interval``; at ``fit``, a Trainer without a logger (``logger=False``,
            as Lightning) or an optimizer with two param groups of one ``"name"``.
    """

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False, log_key_prefix: str | None = None) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f"logging_interval={logging_interval!r}; choose None, 'step' or 'epoch'")
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self.log_key_prefix = log_key_prefix or ""
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}

    def _names(self, trainer: Trainer) -> list[tuple[Any, list[str]]]:
        return [(opt, [self.log_key_prefix + name for name in names])
                for opt, names in param_group_names(trainer.optimizers, trainer.lr_scheduler_configs,
                                                    refuse_duplicates=True)]

    def on_train_start(self, trainer: Trainer, module: Any) -> None:
        if not trainer.loggers:
            raise ValueError("Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger: drop "
                             "logger=False (trainscale's default is a CSVLogger) or the callback")
        if self.log_momentum:
            optimizers = ([config.scheduler.optimizer for config in trainer.lr_scheduler_configs]
                          or [getattr(opt, "optimizer", opt) for opt in trainer.optimizers])
            if any("momentum" not in opt.defaults and "betas" not in opt.defaults for opt in optimizers):
                warnings.warn("log_momentum=True, but some optimizers do not have momentum. Their momentum is logged "
                              "as 0", RuntimeWarning, stacklevel=2)
        names = [name for _, group_names in self._names(trainer) for name in group_names]
        self.lrs = {name: [] for name in names}
        self.last_momentum_values = {f"{name}-momentum": None for name in names}
        self.last_weight_decay_values = {f"{name}-weight_decay": None for name in names}

    def _stats(self, trainer: Trainer, when: str) -> dict[str, float]:
        """The values of the optimizers due ``when`` ("step" or "epoch"), recorded in ``lrs`` and ``last_*``."""
        interval_of = {id(config.scheduler.optimizer): config.interval for config in trainer.lr_scheduler_configs}
        stats: dict[str, float] = {}
        named = self._names(trainer)
        self._remap_keys([name for _, names in named for name in names])
        for opt, names in named:
            interval = interval_of.get(id(opt))
            if self.logging_interval is None and interval is not None and interval != when:
                continue
            for name, group in zip(names, opt.param_groups):
                self.lrs[name].append(group["lr"])
                stats[name] = group["lr"]
                if self.log_momentum:
                    momentum = group["betas"][0] if "betas" in opt.defaults else group.get("momentum", 0)
                    self.last_momentum_values[f"{name}-momentum"] = stats[f"{name}-momentum"] = momentum
                if self.log_weight_decay:
                    decay = group["weight_decay"]
                    self.last_weight_decay_values[f"{name}-weight_decay"] = stats[f"{name}-weight_decay"] = decay
        trainer.callback_metrics.update((name, torch.tensor(float(value))) for name, value in stats.items())
        return stats

    def _remap_keys(self, names: list[str]) -> None:
        """Lightning's ``_remap_keys``: once an optimizer has more param groups (``BaseFinetuning`` adds them), the
        rates of its one group, ``lr-SGD``, go on as ``lr-SGD/pg1``, which moves to the end of ``lrs``; a name not in
        ``lrs`` yet (``lr-SGD/pg2``) is added after it, empty."""
        for name in names:
            single = name.replace("/pg1", "")
            if "/pg1" in name and single in self.lrs:
                self.lrs[name] = self.lrs.pop(single)
            elif name not in self.lrs:
                self.lrs[name] = []

    def _log(self, trainer: Trainer, stats: dict[str, float], epoch: bool) -> None:
        # the records hold the learning rates themselves (the rate the next step uses): add only what they lack
        own = {name for _, names in param_group_names(trainer.optimizers, trainer.lr_scheduler_configs)
               for name in names}
        trainer.log_metrics({name: float(value) for name, value in stats.items() if name not in own}, epoch=epoch)

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        # Lightning's should_update_logs: the step this batch belongs to will be a log step
        if self.logging_interval != "epoch" and (trainer.batches_that_stepped + 1) % trainer.config.log_every_n_steps == 0:
            self._log(trainer, self._stats(trainer, "step"), epoch=False)

    def on_train_epoch_start(self, trainer: Trainer, module: Any) -> None:
        if self.logging_interval != "step":
            self._log(trainer, self._stats(trainer, "epoch"), epoch=True)

