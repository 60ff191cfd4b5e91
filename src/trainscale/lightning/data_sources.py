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

from trainscale.checkpointing.train_state import TrainerFn
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

    def state_dict(self) -> dict[str, Any]:
        """Lightning's hook: the data module's state (a curriculum's level, a stream's position), saved in every
        checkpoint of a fit it takes part in under its class's ``__qualname__``; empty (the default): nothing."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's hook: the state :meth:`state_dict` saved, given back when a fit resumes from the checkpoint
        (after the ``on_load_checkpoint`` hooks)."""

    def on_exception(self, exception: BaseException) -> None:
        """Lightning's hook: a stage (``fit``, ``validate``, ``test``, ``predict``) is ending in ``exception``."""


def is_data_source(obj: Any) -> bool:
    """Whether ``obj`` is a data module (has a loader hook) rather than a DataLoader."""
    return any(hasattr(obj, hook) for hook in LOADER_HOOKS.values()) and not hasattr(obj, "__iter__")


def resolve_loaders(runtime: Runtime, stage: str, model: Any, loaders: Any, datamodule: Any,
                    set_up_callbacks: Callable[[], None] = lambda: None, request: bool = True) -> tuple[Any, Any]:
    """An evaluation stage's loaders ("validate", "test", "predict"): ``(loaders, None)``, the loaders an
    :class:`EvalLoaders` list (:func:`eval_loaders`). First, in every case, the data hooks of ``datamodule`` and of
    the model (:func:`prepare_stage`): ``prepare_data()`` on each node's local rank 0 then a barrier,
    ``setup(stage)`` on every rank, with ``set_up_callbacks`` (the callbacks' ``setup``) between the data module's
    and the model's. Then ``loaders`` when given (a data module passed there counts as ``datamodule``, as Lightning
    allows); else the stage's loader hook of ``datamodule`` or, without one, of the model (Lightning's
    ``DataHooks``). ``request`` False (a stage whose ``limit_*_batches`` is 0): the setup hooks only, no loader asked
    for, ``([], None)`` (Lightning's ``setup_data`` returns before it). ``fit``'s loaders: :class:`FitSources`.

    Raises:
        ValueError: both ``loaders`` and ``datamodule``; neither, and the model has no such hook (named with the
            fix); no evaluation loader in a list (:func:`eval_loaders`). Raised on every rank before any collective.
    """
    if loaders is not None and is_data_source(loaders):
        loaders, datamodule = None, _only(datamodule, loaders, stage)
    if loaders is not None and datamodule is not None:
        raise ValueError(f"{stage}: pass DataLoaders or datamodule=, not both")
    if not request:
        prepare_stage(runtime, datamodule, model, stage, set_up_callbacks)
        return [], None
    source = None if loaders is not None else _source(stage, model, datamodule)  # raises before any hook runs
    prepare_stage(runtime, datamodule, model, stage, set_up_callbacks)  # with loaders passed too
    if source is None:
        return eval_loaders(loaders, stage), None
    return eval_loaders(getattr(source, LOADER_HOOKS[stage])(), stage), None


class FitSources:
    """Where ``fit``'s loaders come from (Lightning's ``_DataLoaderSource`` of its fit loop and of its validation
    loop): the loaders passed to ``fit``, else the ``train_dataloader()``/``val_dataloader()`` hooks of ``datamodule``
    or, without one, of the model (a training loader passed without ``val``: the model's own ``val_dataloader()``,
    as Lightning's ``fit(model, train_dataloaders=...)``). The Trainer asks :meth:`train` and :meth:`val` when its
    loop needs them, in Lightning's order, and again under ``reload_dataloaders_every_n_epochs``.

    Raises:
        ValueError: both loaders and ``datamodule``; no training loader and no ``train_dataloader()`` (named with
            the fix). Raised on every rank before any hook runs.
    """

    def __init__(self, model: Any, train: Any, val: Any, datamodule: Any) -> None:
        if train is not None and is_data_source(train):
            train, datamodule = None, _only(datamodule, train, "fit")
        if (train is not None or val is not None) and datamodule is not None:
            raise ValueError("You cannot pass `train_dataloader` or `val_dataloaders` to `trainer.fit(datamodule=...)`: "
                             "fit: pass DataLoaders or datamodule=, not both")
        self.datamodule = datamodule
        self._train = train if train is not None else _source("fit", model, datamodule)
        self.train_hooked = train is None  # asked again on a reload; a passed loader is the same object again
        self._val = val if val is not None else (datamodule if datamodule is not None else model)
        self.val_hooked = val is None
        # Lightning's _DataLoaderSource.is_defined: loaders passed, or a val_dataloader() hook
        self.has_val = not self.val_hooked or getattr(self._val, "val_dataloader", None) is not None

    def train(self) -> Any:
        """The training loader: the one passed, or what ``train_dataloader()`` returns now."""
        return self._train.train_dataloader() if self.train_hooked else self._train

    def val(self) -> EvalLoaders | None:
        """The validation loaders (:func:`val_loaders`): those passed, or what ``val_dataloader()`` returns now;
        None without any."""
        if not self.has_val:
            return None
        return val_loaders(self._val.val_dataloader() if self.val_hooked else self._val)


class EvalLoaders(list):
    """An evaluation stage's loaders in the order they run, and the form they were given in (``form``: None for a
    loader alone, ``list``, ``tuple``, or ``dict`` with its keys in ``keys``), so that
    ``trainer.val_dataloaders`` and the others give them back in that form, as Lightning's
    ``CombinedLoader.iterables`` (:meth:`in_given_form`)."""

    def __init__(self, loaders: list, form: Any = None, keys: tuple = ()) -> None:
        super().__init__(loaders)
        self.form, self.keys = form, keys

    def in_given_form(self, loaders: list) -> Any:
        """``loaders`` (these, or each as the loop reads it, in the same order) in the form these were given in: the
        one loader, a list, a tuple, or a dict with the same keys."""
        if self.form is dict:
            return dict(zip(self.keys, loaders))
        if self.form in (list, tuple):
            return self.form(loaders)
        return loaders[0]


def val_loaders(loaders: Any) -> EvalLoaders | None:
    """``fit``'s validation loaders as a list (:func:`eval_loaders`); None for None or an empty list, tuple or dict
    (no validation, as Lightning)."""
    if loaders is None or (isinstance(loaders, (list, tuple, dict)) and not loaders):
        return None
    return eval_loaders(loaders, "validation")


def eval_loaders(loaders: Any, stage: str) -> EvalLoaders:
    """An evaluation stage's loaders as a list, in the order Lightning runs them (its ``CombinedLoader`` in
    "sequential" mode): a DataLoader alone, a list's or tuple's items, a dict's values. Each is evaluated in turn;
    with several, the steps get ``dataloader_idx`` and ``self.log`` names end in ``/dataloader_idx_N``.

    Raises:
        ValueError: an empty list, tuple or dict (nothing to evaluate), naming the fix.
    """
    if isinstance(loaders, dict):
        found = EvalLoaders(list(loaders.values()), dict, tuple(loaders))
    elif isinstance(loaders, (list, tuple)):
        found = EvalLoaders(list(loaders), list if isinstance(loaders, list) else tuple)
    else:
        found = EvalLoaders([loaders])
    if not found:
        raise ValueError(f"{stage}: an empty {type(loaders).__name__} of DataLoaders was given, so there is nothing to "
                         "evaluate; pass at least one DataLoader")
    return found


def prepare_stage(runtime: Runtime, datamodule: Any, model: Any, stage: str,
                  set_up_callbacks: Callable[[], None]) -> None:
    """Lightning's order (``_DataConnector.prepare_data``, ``_call_setup_hook``): ``prepare_data()`` of the data
    module then of the model, once per node (local rank 0) while the other ranks wait; then on every rank the data
    module's ``setup(stage)``, ``set_up_callbacks()``, the model's ``setup(stage)`` and its ``configure_model()``
    (``lightning.module.configure_model``). Whether the loaders were
    passed or come from the hooks; any hook may be missing (a plain ``nn.Module`` has neither). ``stage`` reaches
    the hooks as Lightning's ``TrainerFn`` (a ``str`` enum: ``stage == "fit"`` and ``stage.value`` both work)."""
    stage = TrainerFn(stage)
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
