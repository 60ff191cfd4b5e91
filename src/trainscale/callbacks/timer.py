"""Lightning's ``Timer`` callback: how long each stage ran, and a stop once training has run for a duration."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from trainscale.callbacks.base import Callback
from trainscale.utilities.rank_zero import log_info
from trainscale.runtime.flags import parse_duration

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer

_STAGES = ("train", "validate", "test")
log = logging.getLogger(__name__)


class Timer(Callback):
    """``Timer(duration=None, interval="step", verbose=True)``, as Lightning's ``callbacks.Timer``.

    ``duration``: "DD:HH:MM:SS", a ``timedelta`` or a dict of its keywords (``{"hours": 1}``); None: only measure.
    Once the training time (from ``on_train_start``, plus what a checkpoint's ``time_elapsed`` carried over) reaches
    it, checked after every optimizer step (``interval="step"``) or at each epoch end ("epoch"), it sets
    ``trainer.should_stop`` (rank zero's clock, broadcast to every rank), so the fit ends after that step's epoch
    end hooks, unless ``min_epochs``/``min_steps`` hold it back. ``time_elapsed(stage)``, ``start_time(stage)``,
    ``end_time(stage)`` (``time.monotonic`` seconds) for "train", "validate" and "test"; ``time_remaining(stage)``:
    seconds left of ``duration`` (None without one). ``Trainer(max_time=...)`` adds one (``interval="step"``)
    unless the callbacks hold a Timer.
    With ``verbose``, rank zero says "Time limit reached. ..." at the stop, at INFO through the
    ``trainscale.callbacks.timer`` logger where logging shows INFO, printed otherwise (``utilities.rank_zero.log_info``).

    Raises:
        ValueError: a ``duration`` of another form (the message names "DD:HH:MM:SS"), an ``interval`` other than
            "step" or "epoch".
    """

    def __init__(self, duration: str | timedelta | dict | None = None, interval: str = "step",
                 verbose: bool = True) -> None:
        if interval not in ("step", "epoch"):
            raise ValueError(f"Unsupported parameter value `Timer(interval={interval!r})`; possible values are: "
                             "'step', 'epoch'")
        try:
            parsed = parse_duration("duration", duration)
        except ValueError as err:
            raise ValueError(f"Timer(duration={duration!r}) must be in the format DD:HH:MM:SS (days, hours, minutes, "
                             "seconds), a datetime.timedelta or a dict of its keywords") from err
        self._duration = parsed.total_seconds() if parsed is not None else None
        self._interval = interval
        self._verbose = verbose
        self._start_time: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._end_time: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._offset = 0.0  # training seconds of the run a checkpoint was saved from

    def start_time(self, stage: str = "train") -> float | None:
        """``time.monotonic()`` seconds at which ``stage`` ("train", "validate", "test") last started; None before.
        Raises KeyError for another stage."""
        return self._start_time[stage]

    def end_time(self, stage: str = "train") -> float | None:
        """``time.monotonic()`` seconds at which ``stage`` last ended; None while it runs or before it ran."""
        return self._end_time[stage]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds ``stage`` has run (so far, while it runs); training counts the resumed run's time too."""
        start, end = self._start_time[stage], self._end_time[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return offset + (end if end is not None else time.monotonic()) - start

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds of ``duration`` left for ``stage`` (negative once exceeded); None without a duration."""
        return None if self._duration is None else self._duration - self.time_elapsed(stage)

    def _start(self, stage: str) -> None:
        self._start_time[stage], self._end_time[stage] = time.monotonic(), None

    def _end(self, stage: str) -> None:
        self._end_time[stage] = time.monotonic()

    def on_train_start(self, trainer: Trainer, module: Any) -> None:
        self._start("train")

    def on_train_end(self, trainer: Trainer, module: Any) -> None:
        self._end("train")

    def on_validation_start(self, trainer: Trainer, module: Any) -> None:
        self._start("validate")

    def on_validation_end(self, trainer: Trainer, module: Any) -> None:
        self._end("validate")

    def on_test_start(self, trainer: Trainer, module: Any) -> None:
        self._start("test")

    def on_test_end(self, trainer: Trainer, module: Any) -> None:
        self._end("test")

    def on_fit_start(self, trainer: Trainer, module: Any) -> None:
        self._check(trainer)  # a zero duration (or one a resumed run already spent) stops before any step

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # at an optimizer step's end only (the fit stops after a whole step): with gradient accumulation one
        # broadcast of rank zero's clock per step, not one per micro-batch
        if self._interval == "step" and getattr(trainer, "is_step_end", True):
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: Any) -> None:
        if self._interval == "epoch":
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        if self._duration is None:
            return
        out_of_time = trainer.runtime.broadcast_object(self.time_elapsed() >= self._duration)
        if out_of_time and not trainer.should_stop:
            trainer.should_stop = True
            if self._verbose and trainer.runtime.is_rank_zero:  # Lightning's rank_zero_info
                elapsed = timedelta(seconds=int(self.time_elapsed()))
                log_info(log, f"Time limit reached. Elapsed time is {elapsed}. Signaling Trainer to stop.")

    def state_dict(self) -> dict:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in _STAGES}}

    def load_state_dict(self, state: dict) -> None:
        self._offset = state.get("time_elapsed", {}).get("train", 0.0)
