"""Log the learning rate of every param group (Lightning's ``LearningRateMonitor``)."""

from __future__ import annotations

from typing import Any

from trainscale.callbacks.base import Callback
from trainscale.train.optimizers import learning_rates


class LearningRateMonitor(Callback):
    """Adds ``lr-<Optimizer>`` (and ``lr-<Optimizer>/pg<i>`` for further param groups) to the step
    records (``logging_interval="step"``), the epoch records ("epoch"), or both (None, the default).
    The Trainer adds one by default when ``callbacks`` holds none.

    Raises:
        ValueError: an unknown ``logging_interval``.
    """

    def __init__(self, logging_interval: str | None = None) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f"logging_interval={logging_interval!r}; choose None, 'step' or 'epoch'")
        self.logging_interval = logging_interval

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.logging_interval != "epoch" and trainer.is_log_step:
            trainer.log_metrics(learning_rates(trainer.optimizers))

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if self.logging_interval != "step":  # the rates this epoch trains with, in its epoch record
            trainer.log_metrics(learning_rates(trainer.optimizers), epoch=True)
