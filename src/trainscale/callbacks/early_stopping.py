"""Stop training when a monitored metric stops improving (Lightning's ``EarlyStopping``)."""

from __future__ import annotations

import logging
import math
import warnings
from enum import Enum
from typing import TYPE_CHECKING, Any

from trainscale.callbacks.base import Callback
from trainscale.utilities.rank_zero import log_info

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer

log = logging.getLogger(__name__)


class EarlyStoppingReason(Enum):
    """Why :class:`EarlyStopping` stopped training (Lightning's enum of the same name)."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


class EarlyStopping(Callback):
    """Stop ``fit`` when ``monitor`` stops improving, with Lightning's arguments and rules
    (``lightning.pytorch.callbacks.early_stopping``, ``_evaluate_stopping_criteria``), checked in this order at each
    check: a non-finite value (``check_finite``), ``stopping_threshold`` reached, ``divergence_threshold`` passed,
    an improvement by more than ``min_delta`` (resets the count), else one more check without one; training stops
    when that count reaches ``patience``. So with ``patience=2`` and the best value at epoch 3 the last epoch trained
    is epoch 5 (0-based). The metric is read from ``trainer.callback_metrics``, whose values are reduced over all
    ranks, so every rank takes the same decision and all stop on the same epoch.

    When: at each training epoch end, after the module's ``on_train_epoch_end`` (what it logs there counts), when
    ``check_on_train_epoch_end`` is True, or None and validation runs once per epoch (Lightning's rule:
    ``val_check_interval`` 1.0 and ``check_val_every_n_epoch`` 1); otherwise at the end of each validation
    during ``fit`` (``on_validation_end``), and the stop comes at the next optimizer step (once ``min_epochs``/
    ``min_steps`` allow it). ``patience`` counts checks, not epochs.

    Args:
        monitor: a metric name, e.g. "val_loss" or a name given to ``self.log``.
        min_delta: the smallest change that counts as an improvement (an absolute change <= ``min_delta`` does not).
        patience: checks in a row without improvement that stop training (0: the first one does).
        verbose: say each decision (improvement, stop) in Lightning's words on every rank (rank zero only with
            ``log_rank_zero_only``); without it only the stop is said, on rank zero. Said at INFO through the
            ``trainscale.callbacks.early_stopping`` logger where logging shows INFO, printed otherwise
            (``utilities.rank_zero.log_info``).
        mode: "min" (lower is better) or "max".
        strict: a ``monitor`` missing from the metrics raises; False: the check is skipped (with a warning when
            ``verbose``).
        check_finite: stop when the value is NaN or infinite.
        stopping_threshold: stop as soon as the value is better than this.
        divergence_threshold: stop as soon as the value is worse than this.
        check_on_train_epoch_end: see "When" above.
        log_rank_zero_only: with ``verbose``, say it on rank zero only.

    Attributes:
        stopped_epoch: the epoch (0-based) after which training stopped; 0 if it did not.
        stopping_reason: an :class:`EarlyStoppingReason`; ``stopping_reason_message`` says it in words.
        best_score, wait_count: the best value so far and the checks since it.

    Raises:
        ValueError: bad ``mode``/``patience``/``min_delta``; at a check, with ``strict``, a ``monitor`` that is
            not among the metrics (their names are listed).
    """

    monitors_metrics = True  # its on_train_epoch_end after the module's (Lightning's monitoring callbacks)

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, verbose: bool = False,
                 mode: str = "min", strict: bool = True, check_finite: bool = True,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_on_train_epoch_end: bool | None = None, log_rank_zero_only: bool = False) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"`mode` can be min, max, got {mode}: pass mode='min' (lower is better) or 'max'")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"patience={patience!r} must be an int >= 0")
        if not min_delta >= 0:
            raise ValueError(f"min_delta={min_delta!r} must be >= 0")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.verbose, self.strict, self.check_finite = verbose, strict, check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.check_on_train_epoch_end, self.log_rank_zero_only = check_on_train_epoch_end, log_rank_zero_only
        self.best_score = math.inf if mode == "min" else -math.inf
        self.wait_count = 0
        self.stopped_epoch = 0
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None

    @property
    def state_key(self) -> str:
        """Lightning's key: ``EarlyStopping{'monitor': ..., 'mode': ...}`` (two callbacks on two metrics keep two
        states)."""
        return self._generate_state_key(monitor=self.monitor, mode=self.mode)

    def _better(self, value: float, than: float) -> bool:
        return value < than if self.mode == "min" else value > than

    def _at_epoch_end(self, trainer: Trainer) -> bool:
        if self.check_on_train_epoch_end is not None:
            return self.check_on_train_epoch_end
        cfg = trainer.config  # Lightning's EarlyStopping.setup: validation once per epoch, at its end
        return cfg.val_check_interval in (1.0, None) and cfg.check_val_every_n_epoch == 1

    def on_train_epoch_end(self, trainer: Trainer, module: Any) -> None:
        if self._at_epoch_end(trainer):
            self._check(trainer)

    def on_validation_end(self, trainer: Trainer, module: Any) -> None:
        # Lightning checks during fit only (not in trainer.validate), and not in the sanity check
        if trainer.fitting and not trainer.sanity_checking and not self._at_epoch_end(trainer):
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        if trainer.fast_dev_run:  # Lightning's _run_early_stopping_check: no check (nor its refusal) in a debug run
            return
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            message = (f"EarlyStopping monitors {self.monitor!r}, which is not among the metrics: "
                       f"{', '.join(sorted(metrics))}; log it, or pass strict=False to skip such checks")
            if self.strict:
                raise ValueError(message)
            if self.verbose:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            return
        stop, reason = self._evaluate(float(metrics[self.monitor]))
        if stop:
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason_message = reason
            trainer.should_stop = True
        rt = trainer.runtime
        if reason and self.verbose and (rt.is_rank_zero or not self.log_rank_zero_only):  # Lightning's _log_info
            log_info(log, f"[rank: {rt.rank}] {reason}" if rt.world_size > 1 else reason)
        elif stop and rt.is_rank_zero:  # the stop is always said, once
            log_info(log, f"EarlyStopping: {reason} (after epoch {trainer.current_epoch + 1})")

    def _evaluate(self, value: float) -> tuple[bool, str | None]:
        """Lightning's ``_evaluate_stopping_criteria``: ``(stop, reason)``; updates the best score and the count."""
        op = "<" if self.mode == "min" else ">"
        if self.check_finite and not math.isfinite(value):
            self.stopping_reason = EarlyStoppingReason.NON_FINITE_METRIC
            return True, (f"Monitored metric {self.monitor} = {value} is not finite. Previous best value was "
                          f"{self.best_score:.3f}. Signaling Trainer to stop.")
        if self.stopping_threshold is not None and self._better(value, self.stopping_threshold):
            self.stopping_reason = EarlyStoppingReason.STOPPING_THRESHOLD
            return True, (f"Stopping threshold reached: {self.monitor} = {value} {op} {self.stopping_threshold}. "
                          "Signaling Trainer to stop.")
        if self.divergence_threshold is not None and self._better(self.divergence_threshold, value):
            self.stopping_reason = EarlyStoppingReason.DIVERGENCE_THRESHOLD
            return True, (f"Divergence threshold reached: {self.monitor} = {value} {op} {self.divergence_threshold}"
                          ". Signaling Trainer to stop.")
        delta = self.min_delta if self.mode == "max" else -self.min_delta  # Lightning's signed min_delta
        if self._better(value - delta, self.best_score):
            previous, self.best_score, self.wait_count = self.best_score, value, 0
            by = f" by {abs(previous - value):.3f} >= min_delta = {self.min_delta}" if math.isfinite(previous) else ""
            return False, f"Metric {self.monitor} improved{by}. New best score: {value:.3f}"
        self.wait_count += 1
        if self.wait_count >= self.patience:
            self.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
            return True, (f"Monitored metric {self.monitor} did not improve in the last {self.wait_count} records. "
                          f"Best score: {self.best_score:.3f}. Signaling Trainer to stop.")
        return False, None

    def state_dict(self) -> dict:
        return {"wait_count": self.wait_count, "stopped_epoch": self.stopped_epoch, "best_score": self.best_score,
                "patience": self.patience, "stopping_reason": self.stopping_reason.value,
                "stopping_reason_message": self.stopping_reason_message}

    def load_state_dict(self, state: dict) -> None:
        if "wait" in state:  # a checkpoint written before the Lightning names
            state = {"wait_count": state["wait"], "best_score": state["best"], "stopped_epoch": state["stopped_epoch"] or 0}
        self.wait_count, self.best_score = state["wait_count"], state["best_score"]
        self.stopped_epoch = state["stopped_epoch"]
        self.patience = state.get("patience", self.patience)
        self.stopping_reason = EarlyStoppingReason(state.get("stopping_reason", 0))
        self.stopping_reason_message = state.get("stopping_reason_message")
