"""The callback protocol: a base class whose hooks do nothing (Lightning's ``Callback``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer


class Callback:
    """Override the hooks you need. Every rank calls every hook at the same point, so a callback may
    run collectives (e.g. save a checkpoint) as long as it does so on every rank.

    Hook order in ``fit``: ``on_fit_start`` → per epoch ``on_train_epoch_start``, per micro-batch
    ``on_train_batch_end`` (after the optimizer step when the micro-batch ended one), after the
    epoch's validation ``on_validation_end``, then ``on_train_epoch_end`` (the epoch's numbers are in
    ``trainer.callback_metrics``) → ``on_fit_end``. ``on_save_checkpoint``/``on_load_checkpoint`` see
    the checkpoint dict; ``on_exception`` sees what ``fit`` raised. ``state_dict``/``load_state_dict``
    are saved in every checkpoint under ``state_key`` and restored on resume.
    """

    @property
    def state_key(self) -> str:
        return type(self).__name__

    def on_fit_start(self, trainer: Trainer, module: Any) -> None: ...

    def on_fit_end(self, trainer: Trainer, module: Any) -> None: ...

    def on_train_epoch_start(self, trainer: Trainer, module: Any) -> None: ...

    def on_train_epoch_end(self, trainer: Trainer, module: Any) -> None: ...

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None: ...

    def on_validation_end(self, trainer: Trainer, module: Any) -> None: ...

    def on_save_checkpoint(self, trainer: Trainer, module: Any, checkpoint: dict) -> None: ...

    def on_load_checkpoint(self, trainer: Trainer, module: Any, checkpoint: dict) -> None: ...

    def on_exception(self, trainer: Trainer, module: Any, exception: BaseException) -> None: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...
