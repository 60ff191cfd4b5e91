"""Training progress as values, saved in every checkpoint.

- :class:`TrainState` — the one stateful value of the loop's progress (torchtitan's ``TrainState``):
  optimizer steps, the epoch, micro-batches done in it, the epoch records.
- :class:`ResumePoint` — what a checkpoint says about where to continue (frozen, returned by the load).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
        status: "initializing", "running" (in ``fit``), "finished" (``fit`` returned) or "interrupted" (it raised):
            Lightning's ``trainer.state.status``, not saved.
        stage: what runs now, Lightning's ``trainer.state.stage``: "train" (in ``fit``), "sanity_check", "validate"
            (``validate()``, and validation in ``fit``), "test", "predict", or None; not saved.
        fn: the Trainer method running, or last run: "fit", "validate", "test" or "predict" (None before any), the
            values of Lightning's ``trainer.state.fn`` (its ``TrainerFn`` is a ``str`` enum of them); not saved.
        epoch_ended: True once ``epoch``'s end (validation, ``on_train_epoch_end``, its checkpoints) has run, or
            after a resume from a checkpoint written at its end; :attr:`current_epoch` then counts it.
    """

    global_step: int = 0
    epoch: int = 0
    batches: int = 0
    total_batches: int = 0
    history: list[dict] = field(default_factory=list)
    epoch_ended: bool = False
    status: str = "initializing"
    stage: str | None = None
    fn: str | None = None

    @property
    def finished(self) -> bool:
        """The last ``fit`` ran to its end (Lightning's ``trainer.state.finished``)."""
        return self.status == "finished"

    @property
    def current_epoch(self) -> int:
        """Lightning's ``trainer.current_epoch``: the running epoch (0-based), or the epochs completed once an
        epoch's end hooks have run (so ``max_epochs=2`` ends ``fit`` at 2, a stop by ``max_steps`` or a callback at
        the stopped epoch + 1)."""
        return self.epoch + 1 if self.epoch_ended else self.epoch

    def state_dict(self) -> dict:
        return {"global_step": self.global_step, "epoch": self.epoch, "batches": self.batches,
                "total_batches": self.total_batches, "history": list(self.history)}


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
