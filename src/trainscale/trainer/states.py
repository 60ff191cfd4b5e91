"""Lightning's ``lightning.pytorch.trainer.states``: the values of ``trainer.state`` (``status``, ``fn``, ``stage``),
``str`` enums equal to their strings, and ``TrainerState``, the class of ``trainer.state``. They live beside the
loop's progress in ``trainscale.checkpointing.train_state``; this module gives them Lightning's path.

    from trainscale.trainer.states import RunningStage, TrainerFn

    class Report(Callback):
        def on_validation_end(self, trainer, pl_module):
            if trainer.state.fn == TrainerFn.FITTING and trainer.state.stage == RunningStage.VALIDATING:
                ...  # a validation of fit, not the sanity check's (RunningStage.SANITY_CHECKING)
"""

from trainscale.checkpointing.train_state import RunningStage, TrainerFn, TrainerState, TrainerStatus

__all__ = ["RunningStage", "TrainerFn", "TrainerState", "TrainerStatus"]
