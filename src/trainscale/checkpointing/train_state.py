"""Training progress as values, saved in every checkpoint.

- :class:`TrainState` — the one stateful value of the loop's progress (torchtitan's ``TrainState``):
  optimizer steps, the epoch, micro-batches done in it, the epoch records.
- :class:`ResumePoint` — what a checkpoint says about where to continue (frozen, returned by the load).
- :class:`TrainerStatus`, :class:`TrainerFn`, :class:`RunningStage` — the values of ``TrainState.status``, ``fn`` and
  ``stage``: Lightning's enums (``lightning.pytorch.trainer.states``), ``str`` enums equal to their strings
  (``TrainerFn.FITTING == "fit"``), also importable as ``trainscale.trainer.states``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class _StrEnum(str, Enum):
    """A ``str`` enum: equal to, hashed as, and printed as its value (``str(TrainerFn.FITTING) == "fit"``)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__
    __hash__ = str.__hash__


class TrainerStatus(_StrEnum):
    """Where the Trainer's last ``fit``/``validate``/``test``/``predict`` stands (Lightning's ``TrainerStatus``)."""

    INITIALIZING = "initializing"  # the Trainer is made, nothing has run
    RUNNING = "running"
    FINISHED = "finished"  # the last call returned
    INTERRUPTED = "interrupted"  # the last call raised (an exception, a KeyboardInterrupt)

    @property
    def stopped(self) -> bool:
        """Finished or interrupted."""
        return self in (TrainerStatus.FINISHED, TrainerStatus.INTERRUPTED)


class TrainerFn(_StrEnum):
    """The Trainer method running, or last run (Lightning's ``TrainerFn``)."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class RunningStage(_StrEnum):
    """What runs now (Lightning's ``RunningStage``): in ``fit`` TRAINING, SANITY_CHECKING (the sanity check's
    validation) or VALIDATING (its validation); VALIDATING in ``validate``, TESTING in ``test``, PREDICTING in
    ``predict``."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    @property
    def evaluating(self) -> bool:
        """Validation (in ``fit``'s sanity check too) or test."""
        return self in (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)

    @property
    def dataloader_prefix(self) -> str:
        """The prefix of the stage's loader hook: "val" for validation and the sanity check, else the value
        ("train_dataloader", "test_dataloader", "predict_dataloader")."""
        return "val" if self in (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING) else self.value


@dataclass
class TrainState:
    """Where training stands.

    Attributes:
        global_step: optimizer steps taken since the start of the run.
        epoch: the current (0-based) epoch.
        batches: micro-batches of ``epoch`` consumed since its sampler started (a resumed epoch counts the
            batches before the resume too).
        total_batches: micro-batches trained since the start of the run (Lightning's ``total_batch_idx`` + 1;
            ``val_check_interval`` with ``check_val_every_n_epoch=None`` counts them).
        history: one record per completed epoch (``kind`` "epoch" metrics, without ``kind``/``time``).
        status: a :class:`TrainerStatus`: INITIALIZING, RUNNING (in ``fit``, ``validate``, ``test``, ``predict``),
            FINISHED (the call returned) or INTERRUPTED (it raised): Lightning's ``trainer.state.status``; not saved.
        stage: what runs now, a :class:`RunningStage` (Lightning's ``trainer.state.stage``): TRAINING (in ``fit``),
            SANITY_CHECKING, VALIDATING (``validate()``, and validation in ``fit``), TESTING, PREDICTING, or None
            (nothing runs); not saved.
        fn: the Trainer method running, or last run, a :class:`TrainerFn` (FITTING, VALIDATING, TESTING,
            PREDICTING; None before any): Lightning's ``trainer.state.fn``; not saved.

    Lightning's ``TrainerState`` is this class (``trainscale.trainer.states.TrainerState``); its ``status``, ``fn``
    and ``stage`` are the same enums, equal to the same strings.
        epoch_ended: True once ``epoch``'s end (validation, ``on_train_epoch_end``, its checkpoints) has run, or
            after a resume from a checkpoint written at its end; :attr:`current_epoch` then counts it.
    """

    global_step: int = 0
    epoch: int = 0
    batches: int = 0
    total_batches: int = 0
    history: list[dict] = field(default_factory=list)
    epoch_ended: bool = False
    status: TrainerStatus = TrainerStatus.INITIALIZING
    stage: RunningStage | None = None
    fn: TrainerFn | None = None

    @property
    def finished(self) -> bool:
        """The last ``fit``, ``validate``, ``test`` or ``predict`` ran to its end (Lightning's
        ``trainer.state.finished``)."""
        return self.status == TrainerStatus.FINISHED

    @property
    def stopped(self) -> bool:
        """The last call finished or was interrupted (Lightning's ``trainer.state.stopped``)."""
        return self.status.stopped

    @property
    def current_epoch(self) -> int:
        """Lightning's ``trainer.current_epoch``: the running epoch (0-based), or the epochs completed once an
        epoch's end hooks have run (so ``max_epochs=2`` ends ``fit`` at 2, a stop by ``max_steps`` or a callback at
        the stopped epoch + 1)."""
        return self.epoch + 1 if self.epoch_ended else self.epoch

    def state_dict(self) -> dict:
        return {"global_step": self.global_step, "epoch": self.epoch, "batches": self.batches,
                "total_batches": self.total_batches, "history": list(self.history)}


TrainerState = TrainState  # Lightning's name (``lightning.pytorch.trainer.states.TrainerState``)


@dataclass(frozen=True)
class ResumePoint:
    """Where a checkpoint leaves off.

    Attributes:
        epoch: the epoch the checkpoint was written in.
        complete: True when that epoch had ended; training continues with ``epoch + 1``.
        consumed: samples of all ranks consumed in ``epoch`` (mid-epoch, with trainscale's sampler), else None.
        batches: micro-batches of ``epoch`` done (for other samplers, on the same world size).
        totals: (loss × samples summed, samples, tokens, seconds) of the part of ``epoch`` done, so that its
            record after the resume covers the whole epoch (older checkpoints: without tokens).
        rng: this rank's RNG states, restored when the resumed epoch's loader iterator is made.
        world_size: the world size that wrote it.
        loader_state: this rank's training-loader state (``state_dict()`` of a loader that keeps its own
            position, e.g. a ``StatefulDataLoader``) after the batches trained on, mid-epoch; else None.
        loader_ranks: how many ranks' loader states the checkpoint holds (0: none).
        plateau_pending: the "step" ``ReduceLROnPlateau`` update the checkpoint was written before (at a
            validation's end), ``{"count": batch index + 1, "metrics": {monitor: value}}``, made on resume; else None.
    """

    epoch: int
    complete: bool
    consumed: int | None
    batches: int
    totals: tuple
    rng: dict | None
    world_size: int
    loader_state: dict | None = None
    loader_ranks: int = 0
    plateau_pending: dict | None = None

    @property
    def next_epoch(self) -> int:
        return self.epoch + 1 if self.complete else self.epoch

    def position(self) -> dict:
        """The form ``trainscale.checkpointing.run_dirs.start_epoch`` reads."""
        return {"epoch": self.epoch, "complete": self.complete, "consumed": self.consumed, "batches": self.batches}

    def resumes(self, epoch: int) -> bool:
        """True when ``epoch`` is the one this point continues mid-way."""
        return not self.complete and epoch == self.epoch
