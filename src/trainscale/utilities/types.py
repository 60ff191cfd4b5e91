"""Lightning's ``lightning.pytorch.utilities.types`` name that scripts and callbacks read: ``LRSchedulerConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class LRSchedulerConfig:
    """One learning-rate scheduler and when the Trainer steps it, as Lightning's ``LRSchedulerConfig``: what
    ``trainer.lr_scheduler_configs`` holds, one per scheduler ``configure_optimizers`` returned, in its order (the
    keys of its ``lr_scheduler`` dict, with the same defaults).

    Attributes:
        scheduler: the scheduler (torch's ``LRScheduler`` or ``ReduceLROnPlateau``; another object with ``step``,
            ``state_dict`` and ``load_state_dict`` where the module overrides ``lr_scheduler_step``).
        name: the name ``LearningRateMonitor`` and the records give its learning rates (None: ``lr-<Optimizer>``).
        interval: "epoch" (after each epoch whose batches were all seen) or "step" (after each optimizer step).
        frequency: step it every ``frequency`` epochs; for "step", at each optimizer step whose batch index in the
            epoch + 1 is a multiple of it (Lightning's count: batches, restarting each epoch, not optimizer steps).
        reduce_on_plateau: it reads a monitored value when it steps (``ReduceLROnPlateau``: True by default).
        monitor: the name in ``trainer.callback_metrics`` it reads (``"val_loss"``), with ``reduce_on_plateau``.
        strict: the monitored value missing is an error (True) or a ``RuntimeWarning`` and no step (False).
    """

    scheduler: Any
    name: str | None = None
    interval: str = "epoch"
    frequency: int = 1
    reduce_on_plateau: bool = False
    monitor: str | None = None
    strict: bool = True
