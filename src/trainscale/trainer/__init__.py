"""Lightning's ``lightning.pytorch.trainer`` import paths that training code uses, under the same names:
``from trainscale.trainer.states import TrainerFn, TrainerStatus, RunningStage, TrainerState`` (Lightning's
``lightning.pytorch.trainer.states``). The Trainer itself is ``trainscale.Trainer`` (``trainscale.loop.trainer``).
"""
