"""Where a fit or an evaluation gets its DataLoaders: the ones passed, or Lightning's data hooks.

    trainer.fit(model, datamodule=dm)        # dm.prepare_data(), dm.setup("fit"), dm.train_dataloader(), ...
    trainer.test(model, datamodule=dm)       # dm.setup("test"), dm.test_dataloader()
    trainer.fit(model)                       # the model's own train_dataloader() / val_dataloader()

A ``LightningDataModule`` ports by changing its base class to :class:`DataModule` (or keeps none: any object
with the hooks works). The loaders the hooks return are set up as passed ones are (distributed sampler). An
evaluation hook (or argument) may give several loaders, in a list, tuple or dict: each is evaluated in turn, as
Lightning's ``CombinedLoader`` in "sequential" mode (:func:`eval_loaders`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

from trainscale.checkpointing.rng import rng_state, set_rng_state
from trainscale.lightning.hparams import HyperparametersMixin, checkpoint_init_kwargs
from trainscale.lightning.module import configure_model

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime

LOADER_HOOKS = {"fit": "train_dataloader", "validate": "val_dataloader", "test": "test_dataloader",
                "predict": "predict_dataloader"}


class DataModule(HyperparametersMixin):
    """Optional base class with Lightning's ``LightningDataModule`` API. Define ``train_dataloader()`` and any of
    ``val_dataloader()``, ``test_dataloader()``, ``predict_dataloader()`` (each returning a DataLoader, with the
    per-device ``batch_size``); optionally ``prepare_data()`` (downloads: once per node, on local rank 0, before
    any ``setup``) and ``setup(stage)`` (every rank; stage "fit", "validate", "test" or "predict")."""

    CHECKPOINT_HYPER_PARAMS_KEY = "datamodule_hyper_parameters"  # Lightning's keys for a data module's
    CHECKPOINT_HYPER_PARAMS_NAME = "datamodule_hparams_name"

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | os.PathLike, verify: bool = True,
                             weights_only: bool | None = None, **overrides: Any) -> DataModule:
        """The data module rebuilt from the hyperparameters it saved (``save_hyperparameters()``) in a checkpoint
        of a fit it took part in, as Lightning's ``LightningDataModule.load_from_checkpoint``:
        ``cls(**datamodule_hyper_parameters, **overrides)`` (``cls(config=...)`` when they came in one
        container; ``checkpoint_path`` (an ``http(s)://`` URL too), ``weights_only`` and the rules as in
        ``TrainingModule.load_from_checkpoint``).

        Raises:
            FileNotFoundError: no such checkpoint.
            ValueError, urllib.error.URLError: a URL other than ``http(s)://``; a failed download.
            CheckpointError: not a trainscale checkpoint, a failed checksum (``verify``).
            TypeError: ``__init__`` needs arguments the checkpoint does not hold (named, with why).
        """
        from trainscale.checkpointing.checkpointer import read_module_checkpoint

        entries, _ = read_module_checkpoint(checkpoint_path, verify)
        return cls(**checkpoint_init_kwargs(cls, entries, overrides, weights_only, checkpoint_path, "datamodule_"))

    def prepare_data(self) -> None:
        """Once per node (local rank 0), the other ranks waiting: write files here, assign no state."""

    def setup(self, stage: str) -> None:
        """On every rank before the stage's loaders are asked for: build the data sets."""


def is_data_source(obj: Any) -> bool:
    """Whether ``obj`` is a data module (has a loader hook) rather than a DataLoader."""
    return any(hasattr(obj, hook) for hook in LOADER_HOOKS.values()) and not hasattr(obj, "__iter__")


def resolve_loaders(runtime: Runtime, stage: str, model: Any, loaders: Any, datamodule: Any,
                    set_up_callbacks: Callable[[], None] = lambda: None, request: bool = True) -> tuple[Any, Any]:
    """The stage's loaders: ``(train, val loaders or None)`` for "fit", ``(loaders, None)`` for "validate", "test"
    and "predict" (evaluation loaders as a list: :func:`eval_loaders`). First, in every case, the data hooks of
    ``datamodule`` and of the model (:func:`_prepare`): ``prepare_data()`` on each node's local rank 0 then a
    barrier, ``setup(stage)`` on every rank, with ``set_up_callbacks`` (the callbacks' ``setup``) between the data
    module's and the model's. Then ``loaders`` when given (a data module passed there counts as ``datamodule``, as
    Lightning allows); else the loader hooks of ``datamodule`` or, without one, of the model: ``val_dataloader()``
    if defined (None or an empty list from it: no validation) and ``train_dataloader()`` with the random state as
    before the first (Lightning's order: two data sets drawn alike from the random state are the same), or the
    stage's hook (Lightning's ``DataHooks``). ``request`` False (an evaluation stage whose ``limit_*_batches`` is 0):
    the setup hooks only, no loader asked for, ``([], None)`` (Lightning's ``setup_data`` returns before it).

    Raises:
        ValueError: both ``loaders`` and ``datamodule``; neither, and the model has no such hook (named with the
            fix); no evaluation loader in a list (:func:`eval_loaders`). Raised on every rank before any collective.
    """
    if loaders is not None and is_data_source(loaders):
        loaders, datamodule = None, _only(datamodule, loaders, stage)
    if loaders is not None and datamodule is not None:
        raise ValueError(f"{stage}: pass DataLoaders or datamodule=, not both")
    if not request:
        _prepare(runtime, datamodule, model, stage, set_up_callbacks)
        return [], None
    source = None if loaders is not None else _source(stage, model, datamodule)  # raises before any hook runs
    _prepare(runtime, datamodule, model, stage, set_up_callbacks)  # with loaders passed too
    if source is None:
        return (loaders if stage == "fit" else eval_loaders(loaders, stage)), None
    if stage != "fit":
        return eval_loaders(getattr(source, LOADER_HOOKS[stage])(), stage), None
    # Lightning's order: val_dataloader() first (its sanity check asks for it, with the random state put back after
    # it), then train_dataloader(), which so sees the random state either would see alone
    saved = rng_state()
    val = _hooked_val(source)
    set_rng_state(saved)
    return source.train_dataloader(), val


def _hooked_val(source: Any) -> list | None:
    """``source.val_dataloader()``'s loaders (:func:`val_loaders`); None when the hook is missing."""
    hook = getattr(source, "val_dataloader", None)
    return val_loaders(hook() if hook is not None else None)


def val_loaders(loaders: Any) -> list | None:
    """``fit``'s validation loaders as a list (:func:`eval_loaders`); None for None or an empty list, tuple or dict
    (no validation, as Lightning)."""
    if loaders is None or (isinstance(loaders, (list, tuple, dict)) and not loaders):
        return None
    return eval_loaders(loaders, "validation")


def eval_loaders(loaders: Any, stage: str) -> list:
    """An evaluation stage's loaders as a list, in the order Lightning runs them (its ``CombinedLoader`` in
    "sequential" mode): a DataLoader alone, a list's or tuple's items, a dict's values. Each is evaluated in turn;
    with several, the steps get ``dataloader_idx`` and ``self.log`` names end in ``/dataloader_idx_N``.

    Raises:
        ValueError: an empty list, tuple or dict (nothing to evaluate), naming the fix.
    """
    if isinstance(loaders, dict):
        found = list(loaders.values())
    elif isinstance(loaders, (list, tuple)):
        found = list(loaders)
    else:
        found = [loaders]
    if not found:
        raise ValueError(f"{stage}: an empty {type(loaders).__name__} of DataLoaders was given, so there is nothing to "
                         "evaluate; pass at least one DataLoader")
    return found


def _prepare(runtime: Runtime, datamodule: Any, model: Any, stage: str, set_up_callbacks: Callable[[], None]) -> None:
    """Lightning's order (``_DataConnector.prepare_data``, ``_call_setup_hook``): ``prepare_data()`` of the data
    module then of the model, once per node (local rank 0) while the other ranks wait; then on every rank the data
    module's ``setup(stage)``, ``set_up_callbacks()``, the model's ``setup(stage)`` and its ``configure_model()``
    (``lightning.module.configure_model``). Whether the loaders were
    passed or come from the hooks; any hook may be missing (a plain ``nn.Module`` has neither)."""
    sources = [source for source in (datamodule, model) if source is not None]
    if any(hasattr(source, "prepare_data") for source in sources):
        if runtime.world.local_rank == 0:
            for source in sources:
                if hasattr(source, "prepare_data"):
                    source.prepare_data()
        runtime.barrier()
    if hasattr(datamodule, "setup"):
        datamodule.setup(stage=stage)  # by keyword, as Lightning calls it
    set_up_callbacks()
    if hasattr(model, "setup"):
        model.setup(stage=stage)
    configure_model(model)  # Lightning's next hook: the layers it builds exist before the strategy wraps the model


def _source(stage: str, model: Any, datamodule: Any) -> Any:
    """``datamodule``, else ``model``: the one whose hook gives the stage's loader."""
    source, hook = (datamodule if datamodule is not None else model), LOADER_HOOKS[stage]
    if getattr(source, hook, None) is None:
        where = f"{type(source).__name__} (the datamodule)" if datamodule is not None else type(model).__name__
        raise ValueError(f"{stage}: no DataLoader was passed and {where} defines no {hook}(); pass the loader, or "
                         f"define {hook}() on a DataModule given as datamodule=")
    return source


def _only(datamodule: Any, passed: Any, stage: str) -> Any:
    if datamodule is not None:
        raise ValueError(f"{stage}: a data module was passed both as the loader and as datamodule=; pass it once")
    return passed


def fit_loader_hooks(model: Any, train: Any, val: Any, datamodule: Any) -> Callable[[], tuple[Any, Any]] | None:
    """For ``reload_dataloaders_every_n_epochs``: a function asking the data hooks again for ``fit``'s ``(train,
    val)`` (only the ``*_dataloader()`` hooks, not ``prepare_data``/``setup``, as Lightning's reload), a passed
    ``val`` kept; None when the training loader was passed (nothing to ask)."""
    if train is not None and is_data_source(train):
        train, datamodule = None, train
    if train is not None:
        return None
    source = datamodule if datamodule is not None else model
    return lambda: (source.train_dataloader(), val_loaders(val) if val is not None else _hooked_val(source))


def resolve_fit_loaders(runtime: Runtime, model: Any, train: Any, val: Any, datamodule: Any,
                        set_up_callbacks: Callable[[], None] = lambda: None) -> tuple[Any, Any]:
    """``fit``'s ``(train, val)``: :func:`resolve_loaders` for "fit", with ``val`` when it was passed (the validation
    loaders as a list, or None: :func:`val_loaders`). A training loader passed without ``val`` validates on the
    model's own ``val_dataloader()`` when it has one, as Lightning's ``fit(model, train_dataloaders=...)``.

    Raises:
        ValueError: as :func:`resolve_loaders`.
    """
    passed = train is not None and not is_data_source(train)
    train, hooked_val = resolve_loaders(runtime, "fit", model, train, datamodule, set_up_callbacks)
    if val is not None:
        return train, val_loaders(val)
    return train, _hooked_val(model) if passed and datamodule is None else hooked_val
