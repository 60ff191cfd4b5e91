"""The callback protocol: a base class whose hooks do nothing (Lightning's ``Callback``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer


class Callback:
    """Override the hooks you need. Every rank calls every hook at the same point, so a callback may
    run collectives (e.g. save a checkpoint) as long as it does so on every rank.

    Lightning's hooks, names and arguments, called at Lightning's points in Lightning's order; each callback's
    hook runs before the module's hook of the same name (Lightning's ``_call_callback_hooks`` then
    ``_call_lightning_module_hook``). In ``fit``: ``on_fit_start`` → ``on_train_start`` → per epoch
    ``on_train_epoch_start``, per micro-batch ``on_train_batch_start``, ``on_before_backward``,
    ``on_after_backward``, and on a micro-batch that ends an optimizer step ``on_before_optimizer_step`` and
    ``on_before_zero_grad``, then ``on_train_batch_end``; at the epoch end the validation hooks
    (``on_validation_start``, ``on_validation_epoch_start``, per batch ``on_validation_batch_start``/``_end``,
    ``on_validation_epoch_end``, ``on_validation_end``), then ``on_train_epoch_end`` (the epoch's numbers are
    in ``trainer.callback_metrics``; a callback with ``monitors_metrics`` runs after the module's hook, so it
    sees what the module logged there) → ``on_train_end`` → ``on_fit_end``. ``validate``/``test``/``predict``
    call the ``on_validation_*``/``on_test_*``/``on_predict_*`` hooks (the batch hooks get ``dataloader_idx`` when
    a stage has several loaders, as in Lightning). ``on_save_checkpoint``/
    ``on_load_checkpoint`` see the checkpoint dict; ``on_exception`` sees what ``fit``, ``validate``, ``test`` or ``predict`` raised.
    ``state_dict``/``load_state_dict`` are saved in every checkpoint under ``state_key`` and restored on resume
    (a callback with state that may be used twice in one Trainer builds a key from the arguments that tell its
    instances apart, with :meth:`_generate_state_key`, as Lightning's ``EarlyStopping`` and ``ModelCheckpoint``).
    The table of hooks and the one difference from Lightning's order: docs/lightning.md.
    """

    monitors_metrics = False  # True: on_train_epoch_end runs after the module's (Lightning's monitoring callbacks)

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint's "callbacks" entry: unique among the Trainer's
        callbacks with state (Lightning's ``Callback.state_key``; by default the class name)."""
        return type(self).__name__

    @property
    def _legacy_state_key(self) -> str:
        """The key trainscale checkpoints used before the keys built by :meth:`_generate_state_key`: the class
        name; read when a checkpoint has no entry under ``state_key`` (Lightning's ``_legacy_state_key``)."""
        return type(self).__name__

    def _generate_state_key(self, **kwargs: Any) -> str:
        """Lightning's ``Callback._generate_state_key``: ``"<class name>{repr(kwargs)}"``, e.g.
        ``EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}``."""
        return f"{type(self).__qualname__}{kwargs!r}"

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        """Lightning's ``Callback.setup``: at the start of ``fit``, ``validate``, ``test`` and ``predict`` (``stage``
        "fit", "validate", "test", "predict"), after the data module's ``setup``, before the model is wrapped by its
        strategy and (in ``fit``) before ``configure_optimizers`` (``BaseFinetuning`` freezes there)."""

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        """Lightning's ``Callback.teardown``: at the end of a ``fit``, ``validate``, ``test`` or ``predict`` that ended
        normally (after ``on_fit_end`` in ``fit``); the pair of :meth:`setup`."""

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_fit_end(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_train_epoch_start(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None: ...

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None: ...

    def on_before_backward(self, trainer: Trainer, pl_module: Any, loss: Any) -> None: ...

    def on_after_backward(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None: ...

    def on_before_zero_grad(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None: ...

    def on_sanity_check_start(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_sanity_check_end(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_validation_start(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_validation_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None: ...

    def on_validation_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None: ...

    def on_test_start(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_test_end(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_test_epoch_start(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_test_epoch_end(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_test_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None: ...

    def on_test_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None: ...

    def on_predict_start(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_predict_end(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_predict_epoch_start(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: Any) -> None: ...

    def on_predict_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int,
                               dataloader_idx: int = 0) -> None: ...

    def on_predict_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None: ...

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: dict) -> None: ...

    def on_load_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: dict) -> None: ...

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


HOOKS = frozenset(name for name in vars(Callback) if name.startswith("on_"))


def overrides(callback: Callback, name: str) -> bool:
    """Whether ``callback``'s method ``name`` is its own rather than :class:`Callback`'s: a method of its class, or a
    callable set on the instance (a ``unittest.mock.Mock(spec=Callback)``'s attributes too, so that its hooks are
    called and recorded, as Lightning calls every callback's)."""
    attr = getattr(callback, name)
    return getattr(attr, "__func__", attr) is not getattr(Callback, name)


def overridden_hooks(callback: Callback) -> frozenset[str]:
    """The hooks ``callback`` overrides (:func:`overrides`): the others do nothing."""
    return frozenset(name for name in HOOKS if overrides(callback, name))

