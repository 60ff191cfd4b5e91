"""Stop training when a monitored metric stops improving (Lightning's ``EarlyStopping``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from trainscale.callbacks.base import Callback

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer


class EarlyStopping(Callback):
    """Stop ``fit`` after ``patience`` checks in a row without an improvement of ``monitor`` by more than
    ``min_delta``: Lightning's rule (``wait_count >= patience``), so with ``patience=2`` and the best value at
    epoch 3 the last epoch trained is epoch 5 (0-based). The metric is read from ``trainer.callback_metrics`` at
    each epoch end, after the module's ``on_train_epoch_end`` (what it logs there counts); those values are
    reduced over all ranks, so every rank takes the same decision and all stop on the same epoch. With
    ``val_check_interval`` or ``check_val_every_n_epoch`` set so that validation does not run exactly at each epoch
    end, it checks after each validation of ``fit`` instead (Lightning's default ``check_on_train_epoch_end``), and
    the stop comes at the next optimizer step (once ``min_epochs``/``min_steps`` allow it).

    Args:
        monitor: a metric name, e.g. "val_loss" or a name given to ``self.log``.
        mode: "min" (lower is better) or "max".
        patience: checks in a row without improvement that stop training (0: the first one does).
        min_delta: the smallest change that counts as an improvement (>= 0).

    Raises:
        ValueError: bad ``mode``/``patience``/``min_delta``; at an epoch end, a ``monitor`` that is not
            among the metrics (their names are listed).
    """

    monitors_metrics = True  # its on_train_epoch_end after the module's (Lightning's monitoring callbacks)

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}; choose 'min' or 'max'")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"patience={patience!r} must be an int >= 0")
        if not min_delta >= 0:
            raise ValueError(f"min_delta={min_delta!r} must be >= 0")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.best = math.inf if mode == "min" else -math.inf
        self.wait = 0
        self.stopped_epoch: int | None = None

    def _improved(self, value: float) -> bool:
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    @staticmethod
    def _checks_at_validation_end(trainer: Trainer) -> bool:
        """Lightning's ``check_on_train_epoch_end=None``: at each epoch end when validation runs exactly there
        (``val_check_interval`` None or 1.0, ``check_val_every_n_epoch=1``), else after each validation of ``fit``."""
        cfg = trainer.config
        return not (cfg.val_check_interval in (None, 1.0) and cfg.check_val_every_n_epoch == 1)

    def on_validation_end(self, trainer: Trainer, module: Any) -> None:
        if self._checks_at_validation_end(trainer) and trainer.fitting and not trainer.sanity_checking:
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: Any) -> None:
        if not self._checks_at_validation_end(trainer):
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            raise ValueError(f"EarlyStopping monitors {self.monitor!r}, which is not among this epoch's metrics: "
                             f"{', '.join(sorted(metrics))}")
        value = metrics[self.monitor]
        if self._improved(value):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:  # Lightning's EarlyStopping._evaluate_stopping_criteria
            self.stopped_epoch = trainer.current_epoch
            trainer.should_stop = True
            trainer.runtime.print(f"trainscale: EarlyStopping: {self.monitor} did not improve on {self.best:.6g} for "
                                  f"{self.wait} checks; stopping at step {trainer.global_step}, epoch "
                                  f"{trainer.current_epoch + 1}")

    def state_dict(self) -> dict:
        return {"best": self.best, "wait": self.wait, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.wait, self.stopped_epoch = state["best"], state["wait"], state["stopped_epoch"]
