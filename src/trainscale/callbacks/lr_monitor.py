"""Lightning's ``LearningRateMonitor``, for code that ports with it; it adds momentum when asked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainscale.callbacks.base import Callback
from trainscale.scaling.lr_scaling import learning_rates

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer


class LearningRateMonitor(Callback):
    """Every step and epoch record already holds each param group's learning rate (``lr-<Optimizer>``,
    ``lr-<Optimizer>/pg<i>``: Lightning's names), so this callback is needed only for ``log_momentum=True``:
    it adds ``momentum-<Optimizer>`` (SGD's ``momentum`` or Adam's first beta) to the step records
    (``logging_interval="step"``), the epoch records ("epoch") or both (None).

    ``lrs`` (Lightning's attribute) maps each of those names to the learning rates seen, one per logged step
    (``log_every_n_steps``; "step" or None) and one at each epoch's start ("epoch"), from ``on_train_start``.

    Raises:
        ValueError: an unknown ``logging_interval``.
    """

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f"logging_interval={logging_interval!r}; choose None, 'step' or 'epoch'")
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.lrs: dict[str, list[float]] = {}

    def on_train_start(self, trainer: Trainer, module: Any) -> None:
        self.lrs = {name: [] for name in learning_rates(trainer.optimizers)}

    def _record_lrs(self, trainer: Trainer) -> None:
        for name, lr in learning_rates(trainer.optimizers).items():
            self.lrs.setdefault(name, []).append(lr)

    def _momenta(self, trainer: Trainer) -> dict[str, float]:
        out = {}
        for opt in trainer.optimizers:
            for i, group in enumerate(opt.param_groups):
                value = group.get("momentum", group.get("betas", (None,))[0])
                if value is not None:
                    out[f"momentum-{type(opt).__name__}" + (f"/pg{i}" if i else "")] = float(value)
        return out

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.logging_interval != "epoch" and trainer.is_log_step:
            self._record_lrs(trainer)
            if self.log_momentum:
                trainer.log_metrics(self._momenta(trainer))

    def on_train_epoch_start(self, trainer: Trainer, module: Any) -> None:
        if self.logging_interval == "epoch":
            self._record_lrs(trainer)
        if self.log_momentum and self.logging_interval != "step":
            trainer.log_metrics(self._momenta(trainer), epoch=True)
