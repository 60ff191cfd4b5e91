"""Callbacks: code that runs at named points of ``Trainer.fit`` (Lightning's names and signatures).

    from trainscale import Trainer
    from trainscale.callbacks import EarlyStopping, ModelCheckpoint

    trainer = Trainer(max_epochs=50, callbacks=[EarlyStopping("val_loss", patience=3),
                                                ModelCheckpoint(monitor="val_loss", save_top_k=2)])
"""

from typing import Any

from trainscale.callbacks.backbone_finetuning import BackboneFinetuning
from trainscale.callbacks.base import Callback, overrides
from trainscale.callbacks.device_stats_monitor import DeviceStatsMonitor
from trainscale.callbacks.early_stopping import EarlyStopping
from trainscale.callbacks.ema import EMA
from trainscale.callbacks.finetuning import BaseFinetuning
from trainscale.callbacks.gradient_accumulation_scheduler import GradientAccumulationScheduler
from trainscale.callbacks.lambda_function import LambdaCallback
from trainscale.callbacks.lr_monitor import LearningRateMonitor
from trainscale.callbacks.model_checkpoint import ModelCheckpoint
from trainscale.callbacks.model_summary import ModelSummary
from trainscale.callbacks.on_exception_checkpoint import OnExceptionCheckpoint
from trainscale.callbacks.prediction_writer import BasePredictionWriter
from trainscale.callbacks.progress_bar import RichProgressBar, TQDMProgressBar
from trainscale.callbacks.rich_model_summary import RichModelSummary
from trainscale.callbacks.swa import StochasticWeightAveraging
from trainscale.callbacks.throughput_monitor import ThroughputMonitor
from trainscale.callbacks.timer import Timer
from trainscale.utilities import rank_zero_info

__all__ = ["BackboneFinetuning", "BaseFinetuning", "BasePredictionWriter", "Callback", "DeviceStatsMonitor", "EMA", "EarlyStopping", "GradientAccumulationScheduler", "LambdaCallback", "LearningRateMonitor", "ModelCheckpoint", "ModelSummary",
           "OnExceptionCheckpoint", "RichModelSummary", "RichProgressBar", "StochasticWeightAveraging",
           "TQDMProgressBar", "ThroughputMonitor", "Timer", "resolve_callbacks"]


def resolve_callbacks(callbacks, default_checkpoint: ModelCheckpoint | None = None,
                      enable_checkpointing: bool = True, max_time: Any = None) -> list[Callback]:
    """The Trainer's callbacks (one :class:`Callback` or a list, as Lightning's flag) as a list, with ``default_checkpoint`` appended when it is given and the user's
    list holds no :class:`ModelCheckpoint` (Lightning adds its default checkpoint callback the same way). The
    Trainer's ``max_time`` (a ``timedelta``, or None) is a ``Timer(duration=max_time, interval="step")`` placed before
    the checkpoint callbacks, unless the list holds a :class:`Timer` already (then Lightning's note that it is
    ignored), as Lightning's ``_configure_timer_callback``.

    Raises:
        TypeError: an entry that is not a :class:`Callback`.
        ValueError: callbacks that cannot go together (:func:`_refuse_conflicts`).
    """
    callbacks = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise TypeError(f"callbacks holds a {type(cb).__name__}; pass trainscale.callbacks.Callback instances")
    _refuse_conflicts(callbacks, enable_checkpointing)
    if max_time is not None and any(isinstance(cb, Timer) for cb in callbacks):
        rank_zero_info("Ignoring `Trainer(max_time=...)`, callbacks list already contains a Timer.")
    elif max_time is not None:
        at = next((i for i, cb in enumerate(callbacks) if isinstance(cb, ModelCheckpoint)), len(callbacks))
        callbacks.insert(at, Timer(duration=max_time, interval="step"))
    if default_checkpoint is not None and not any(isinstance(cb, ModelCheckpoint) for cb in callbacks):
        callbacks.append(default_checkpoint)
    return callbacks


def _refuse_conflicts(callbacks: list[Callback], enable_checkpointing: bool) -> None:
    """Raise ValueError, as Lightning, for two callbacks with state under one ``state_key`` (e.g. two
    ``EarlyStopping`` on the same metric and mode: a checkpoint would keep one state for both), several progress bars,
    and a :class:`ModelCheckpoint` with the Trainer's ``enable_checkpointing`` False; and for several
    :class:`GradientAccumulationScheduler` (Lightning lets the last one's factor win each epoch)."""
    keys = [cb.state_key for cb in callbacks if overrides(cb, "state_dict")]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"two callbacks save their state under {twice[0]!r}: a checkpoint would keep one state for "
                         "both; drop one, or make them differ (another monitor or mode; a subclass may override "
                         "state_key)")
    if sum(isinstance(cb, TQDMProgressBar) for cb in callbacks) > 1:
        raise ValueError("callbacks holds several progress bars (TQDMProgressBar/RichProgressBar); keep one")
    if sum(isinstance(cb, GradientAccumulationScheduler) for cb in callbacks) > 1:
        raise ValueError("callbacks holds several GradientAccumulationScheduler: keep one, with every epoch's factor "
                         "in its scheduling")
    if not enable_checkpointing and any(isinstance(cb, ModelCheckpoint) for cb in callbacks):
        raise ValueError("Trainer was configured with `enable_checkpointing=False` but found `ModelCheckpoint` in "
                         "callbacks list: drop one of the two (the ModelCheckpoint, or enable_checkpointing=False)")


def merge_model_callbacks(callbacks: list[Callback], model_callbacks: Any) -> list[Callback]:
    """The Trainer's ``callbacks`` with those a module's ``configure_callbacks()`` returned (one callback, a list or
    tuple, or None/empty: none), as Lightning's ``_attach_model_callbacks`` (``trainer/connectors/callback_connector.py``):
    a module's callback replaces every Trainer callback whose type is its own or a parent of it (a plain
    :class:`Callback` excepted), said once on rank zero's log, and the checkpoint callbacks (:class:`ModelCheckpoint`,
    :class:`OnExceptionCheckpoint`) go last, each group in its order. ``callbacks`` itself is not changed.

    Raises:
        TypeError: an entry that is not a :class:`Callback`, naming it.
    """
    made = _model_callbacks(model_callbacks)
    if not made:
        return callbacks
    replaced = {kind for kind in {type(cb) for cb in callbacks} - {Callback}
                if any(issubclass(type(cb), kind) for cb in made)}
    if replaced:
        rank_zero_info("The following callbacks returned in `LightningModule.configure_callbacks` will override "
                       f"existing callbacks passed to Trainer: {', '.join(sorted(t.__name__ for t in replaced))}")
    merged = [cb for cb in callbacks if type(cb) not in replaced] + made
    last = (ModelCheckpoint, OnExceptionCheckpoint)
    return [cb for cb in merged if not isinstance(cb, last)] + [cb for cb in merged if isinstance(cb, last)]


def _model_callbacks(returned: Any) -> list[Callback]:
    """What ``configure_callbacks()`` returned, as a list of callbacks.

    Raises:
        TypeError: an entry that is not a :class:`Callback`, naming it.
    """
    made = [returned] if isinstance(returned, Callback) else list(returned or [])
    wrong = [cb for cb in made if not isinstance(cb, Callback)]
    if wrong:
        raise TypeError(f"configure_callbacks returned a {type(wrong[0]).__name__}; return "
                        "trainscale.callbacks.Callback instances (one, or a list)")
    return made
