"""``Tuner``: Lightning's ``lightning.pytorch.tuner.Tuner`` (``tuner/tuning.py``) on trainscale's Trainer.

    from trainscale.tuner import Tuner
    tuner = Tuner(trainer)
    lr_finder = tuner.lr_find(model)                    # sets model.lr to lr_finder.suggestion()
    tuner.scale_batch_size(model, mode="binsearch")     # sets model.batch_size to the largest that trains

Both run short throwaway fits of the trainer's own flags (:mod:`trainscale.tuner.scratch`): nothing is written into
the user's runs, and the model's weights, its optimizer's state and the random state are as before; only the
attribute tuned changes.
"""

from __future__ import annotations

import gc
import logging
import warnings
from typing import Any, Callable, Literal

import torch

from trainscale.utilities.rank_zero import log_info
from trainscale.lightning.data_sources import LOADER_HOOKS, eval_loaders, is_data_source
from trainscale.tune.batch_size import search
from trainscale.tuner.lr_finder import LRFinder, RangeTest
from trainscale.tuner.scratch import Scratch, StateKeeper

_log = logging.getLogger(__name__)
_METHODS = ("fit", "validate", "test", "predict")
# Lightning's is_oom_error (utilities/memory.py): CUDA's, cuDNN's and the CPU allocator's out-of-memory errors
_OOM_TEXT = ("CUDA out of memory.", "CUDA error: out of memory", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
             "DefaultCPUAllocator: can't allocate memory")


class Tuner:
    """Lightning's ``Tuner(trainer)``: :meth:`lr_find` and :meth:`scale_batch_size` with Lightning's arguments and
    results. Each runs throwaway fits of ``trainer``'s flags on its Runtime (:mod:`trainscale.tuner.scratch`)."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def lr_find(self, model: Any, train_dataloaders: Any = None, val_dataloaders: Any = None, dataloaders: Any = None,
                datamodule: Any = None, method: Literal["fit", "validate", "test", "predict"] = "fit",
                min_lr: float = 1e-8, max_lr: float = 1, num_training: int = 100,
                mode: Literal["exponential", "linear"] = "exponential", early_stop_threshold: float | None = 4.0,
                update_attr: bool = True, attr_name: str = "", weights_only: bool | None = None, *,
                loss_fn: Callable | None = None, optimizer: Any = None) -> LRFinder | None:
        """The learning-rate range test (:mod:`trainscale.tuner.lr_finder`): ``num_training`` optimizer steps of a
        throwaway fit on the training data, the learning rate growing from ``min_lr`` to ``max_lr`` ("exponential"
        or "linear"), stopped early when the smoothed loss exceeds ``early_stop_threshold`` times the best (None:
        never). The model's weights and its optimizer's state are put back afterwards; with ``update_attr`` the
        suggestion is then set on the learning-rate attribute (``attr_name``, else ``lr`` or ``learning_rate`` of
        the model, its ``hparams``, the data module or its ``hparams``: Lightning's lookup, every holder set) and on
        the optimizers of the trainer's last fit. ``loss_fn``, ``optimizer``: as ``Trainer.fit``'s (a plain
        ``nn.Module``); ``weights_only``: accepted (the state is kept in memory, not in a checkpoint file).

        Returns:
            An :class:`~trainscale.tuner.lr_finder.LRFinder` (``results``, ``suggestion()``, ``plot()``); None under
            ``fast_dev_run`` (skipped with Lightning's warning).

        Raises:
            ValueError: ``method`` other than "fit"; loaders in the wrong argument; a bad ``mode``, ``min_lr``,
                ``max_lr`` or ``num_training``; several optimizers or manual optimization.
            AttributeError: ``update_attr`` and no learning-rate attribute found (named with the fix).
        """
        if method != "fit":
            raise ValueError("method='fit' is the only valid configuration to run lr finder.")
        _check_tuner_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        _check_range(mode, min_lr, max_lr, num_training)
        trainer = self._trainer
        if trainer.fast_dev_run:
            warnings.warn("Skipping learning rate finder since `fast_dev_run` is enabled.", UserWarning, stacklevel=2)
            return None
        if update_attr:
            attr_name = _lr_attr_name(model, datamodule, attr_name)
        finder = LRFinder(mode, min_lr, max_lr, num_training)
        test = RangeTest(finder, early_stop_threshold)
        with Scratch(trainer, model) as scratch:
            try:
                scratch.run("fit", {"max_steps": num_training, "limit_val_batches": 0}, [test], train_dataloaders,
                            val_dataloaders, datamodule=datamodule, loss_fn=loss_fn, optimizer=optimizer)
            finally:
                test.restore()
        if len(test.lrs) < num_training and trainer.is_global_zero:
            log_info(_log, f"LR finder stopped early after {len(test.lrs)} steps due to diverging loss.")
        finder.results = trainer.runtime.broadcast_object({"lr": test.lrs, "loss": test.losses})  # rank zero's
        lr = finder.suggestion() if update_attr else None
        if lr is not None:
            _set_attr(_holders(model, datamodule, attr_name), attr_name, lr)
            for opt in trainer.optimizers:  # a later fit builds its own; the last one's trains on at it too
                for group in opt.param_groups:
                    group["lr"] = lr
            if trainer.is_global_zero:
                log_info(_log, f"Learning rate set to {lr}")
        return finder

    def scale_batch_size(self, model: Any, train_dataloaders: Any = None, val_dataloaders: Any = None,
                         dataloaders: Any = None, datamodule: Any = None,
                         method: Literal["fit", "validate", "test", "predict"] = "fit",
                         mode: Literal["power", "binsearch"] = "power", steps_per_trial: int = 3, init_val: int = 2,
                         max_trials: int = 25, batch_arg_name: str = "batch_size", margin: float = 0.05,
                         max_val: int = 8192, *, loss_fn: Callable | None = None, optimizer: Any = None) -> int | None:
        """The largest batch size that runs ``method`` without running out of memory, as Lightning's: the attribute
        ``batch_arg_name`` of the model, its ``hparams``, the data module or its ``hparams`` is set to each size
        tried, and each trial is a throwaway ``method`` of ``steps_per_trial`` steps (batches) whose loaders the
        data hooks (``train_dataloader()``, ...) build again with it. From ``init_val`` the size doubles until a
        trial runs out of memory (``torch.OutOfMemoryError``, ``MemoryError``, or Lightning's CUDA/cuDNN/CPU
        allocator messages), the data set's length or ``max_val`` is reached, or ``max_trials`` trials have run;
        "power" keeps the last size that ran, "binsearch" then searches between it and the first that failed and
        takes ``margin`` off the result (``int(size × (1 - margin))``, at least 1). An ``init_val`` that fails is
        halved until a size runs (``trainscale.tune.batch_size.search``); ``max_trials=0`` runs none and keeps
        ``init_val``. The size found is set on the attribute and returned; the model's weights are put back.

        Returns:
            The batch size; None under ``fast_dev_run`` (skipped with Lightning's warning).

        Raises:
            ValueError: loaders passed directly (they cannot be rebuilt: give the module or a data module the
                ``*_dataloader()`` hook), loaders in the wrong argument, a bad ``mode`` or ``margin``, several
                processes (use ``Trainer(batch_size="max", max_memory=...)``, which searches on every rank).
            AttributeError: no ``batch_arg_name`` attribute found.
            trainscale.tune.batch_size.BatchSizeError: not even a batch of 1 runs.
        """
        _check_tuner_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        source, datamodule = _rebuildable_source(model, train_dataloaders if method == "fit" else dataloaders,
                                                 datamodule, method)
        if mode not in ("power", "binsearch"):
            raise ValueError(f"`mode` should be either of ('power', 'binsearch'), not {mode!r}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"`margin` should be between 0 and 1. Found margin={margin}")
        trainer = self._trainer
        if trainer.world_size > 1 or trainer.runtime.spawns:
            raise ValueError("Tuning the batch size is currently not supported with distributed strategies: on several "
                             "processes use Trainer(batch_size='max', max_memory=...), which searches on every rank "
                             "and agrees on the size")
        holders = _batch_holders(model, datamodule, batch_arg_name)
        if trainer.fast_dev_run:
            warnings.warn("Skipping batch size scaler since `fast_dev_run` is enabled.", UserWarning, stacklevel=2)
            return None
        keeper = StateKeeper()
        with Scratch(trainer, model) as scratch:
            trial = _Trials(scratch, method, steps_per_trial, keeper, holders, batch_arg_name,
                            (val_dataloaders if method == "fit" else None, datamodule, loss_fn, optimizer))
            try:
                found = init_val if max_trials < 1 else _search(trial, source, method, init_val, max_val, max_trials,
                                                                mode)
            except BaseException:
                trial.put_back()  # the attribute as it was, when no size was found
                raise
            finally:
                keeper.restore()
        if mode == "binsearch" and margin > 0:
            found = max(1, int(found * (1 - margin)))
        _set_attr(holders, batch_arg_name, found)
        log_info(_log, f"Finished batch size finder, will continue with full run using batch size {found}")
        return found


def _search(trial: _Trials, source: Any, method: str, init_val: int, max_val: int, max_trials: int, mode: str) -> int:
    """The largest size that runs (``tune.batch_size.search``), the growth bounded by ``max_val`` and, once
    ``init_val`` has run, by the data set's length (Lightning's)."""
    limit = max_val
    if trial.fits(init_val):
        limit = max(init_val, min(max_val, _data_length(source, method) or max_val))
    return search(trial.fits, init_val, max(limit, init_val), max_trials, mode=mode, shrink=True)


class _Trials:
    """One trial per batch size (remembered: a size is tried once): the attribute set, a throwaway run, out of
    memory caught and the memory freed."""

    def __init__(self, scratch: Scratch, method: str, steps: int, keeper: StateKeeper, holders: list, name: str,
                 data: tuple) -> None:
        self.scratch, self.method, self.keeper, self.holders, self.name = scratch, method, keeper, holders, name
        self.val, self.datamodule, self.loss_fn, self.optimizer = data
        limit = "limit_val_batches" if method in ("fit", "validate") else f"limit_{method}_batches"
        self.overrides = {limit: steps, "max_steps": steps} if method == "fit" else {limit: steps}
        self.results: dict[int, bool] = {}
        self.before = [holder[name] if isinstance(holder, dict) else getattr(holder, name) for holder in holders]

    def put_back(self) -> None:
        """The attribute's values from before the first trial."""
        for holder, value in zip(self.holders, self.before):
            _set_attr([holder], self.name, value)

    def fits(self, size: int) -> bool:
        if size not in self.results:
            self.results[size] = self._run(size)
        return self.results[size]

    def _run(self, size: int) -> bool:
        _set_attr(self.holders, self.name, size)
        try:
            if self.method == "fit":
                self.scratch.run("fit", self.overrides, [self.keeper], None, self.val, datamodule=self.datamodule,
                                 loss_fn=self.loss_fn, optimizer=self.optimizer)
            else:
                kwargs = ({"verbose": False, "loss_fn": self.loss_fn} if self.method != "predict"
                          else {"return_predictions": False})
                self.scratch.run(self.method, self.overrides, [], None, datamodule=self.datamodule, **kwargs)
            fitted = True
        except Exception as err:  # noqa: BLE001 - out of memory ends the growth; anything else is raised
            if not _is_oom(err):
                raise
            fitted = False
        self.scratch.model.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log_info(_log, f"Batch size {size} {'succeeded' if fitted else 'failed'}")
        return fitted


def _is_oom(err: BaseException) -> bool:
    """An out-of-memory error (Lightning's ``is_oom_error``, with torch's ``OutOfMemoryError`` and ``MemoryError``)."""
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and any(text in str(err) for text in _OOM_TEXT))


def _check_tuner_configuration(train: Any, val: Any, dataloaders: Any, method: str) -> None:
    """Lightning's ``_check_tuner_configuration``: the loaders in the arguments ``method`` reads."""
    if method not in _METHODS:
        raise ValueError(f"method {method!r} is invalid. Should be one of {_METHODS}.")
    if method == "fit" and dataloaders is not None:
        raise ValueError("In tuner with method='fit', `dataloaders` argument should be None, please consider setting "
                         "`train_dataloaders` and `val_dataloaders` instead.")
    if method != "fit" and (train is not None or val is not None):
        raise ValueError(f"In tuner with `method`={method!r}, `train_dataloaders` and `val_dataloaders` arguments "
                         "should be None, please consider setting `dataloaders` instead.")


def _check_range(mode: str, min_lr: float, max_lr: float, num_training: int) -> None:
    if mode not in ("exponential", "linear"):
        raise ValueError(f"mode should be either `linear` or `exponential`, not {mode!r}")
    if not (min_lr > 0 and max_lr > 0):  # min_lr > max_lr is a falling schedule, as Lightning allows
        raise ValueError(f"min_lr={min_lr} and max_lr={max_lr} must both be > 0 (learning rates, e.g. 1e-8 and 1)")
    if isinstance(num_training, bool) or not isinstance(num_training, int) or num_training < 1:
        raise ValueError(f"num_training={num_training!r} must be an int >= 1 (the optimizer steps of the range test)")


def _rebuildable_source(model: Any, passed: Any, datamodule: Any, method: str) -> tuple[Any, Any]:
    """``(the object whose loader hook builds the loader again, the data module or None)``.

    Raises:
        ValueError: a loader passed directly (Lightning's refusal), or a data module passed twice.
    """
    if passed is not None and not is_data_source(passed):
        raise ValueError("The Batch size finder cannot be used with dataloaders passed directly to `.fit()`. Please "
                         "disable the feature or incorporate the dataloader into your LightningModule or "
                         f"LightningDataModule: define {LOADER_HOOKS[method]}() building the loader with "
                         "self.batch_size (on the module or a DataModule passed as datamodule=)")
    if passed is not None:
        if datamodule is not None:
            raise ValueError(f"{method}: a data module was passed both as the loader and as datamodule=; pass it once")
        datamodule = passed
    return (datamodule if datamodule is not None else model), datamodule


def _holders(model: Any, datamodule: Any, name: str) -> list:
    """Where ``name`` lives, as Lightning's ``_lightning_get_all_attr_holders``: the model, its ``hparams``, the
    data module, its ``hparams`` (each that has it, in this order)."""
    found = []
    for obj in (model, datamodule):
        if obj is None:
            continue
        if hasattr(obj, name):
            found.append(obj)
        hparams = getattr(obj, "hparams", None)
        if hparams is not None and name in hparams:
            found.append(hparams)
    return found


def _set_attr(holders: list, name: str, value: Any) -> None:
    """Lightning's ``lightning_setattr``: ``name`` set to ``value`` on every holder."""
    for holder in holders:
        if isinstance(holder, dict):
            holder[name] = value
        else:
            setattr(holder, name, value)


def _lr_attr_name(model: Any, datamodule: Any, attr_name: str) -> str:
    """Lightning's ``_determine_lr_attr_name``: ``attr_name`` when found, else "lr", else "learning_rate".

    Raises:
        AttributeError: none found (Lightning's messages, with the fix)."""
    if attr_name:
        if not _holders(model, datamodule, attr_name):
            raise AttributeError(f"The attribute name for the learning rate was set to {attr_name}, but could not find "
                                 "this as a field in `model` or `model.hparams`.")
        return attr_name
    for name in ("lr", "learning_rate"):
        if _holders(model, datamodule, name):
            return name
    raise AttributeError("When using the learning rate finder, either `model` or `model.hparams` should have one of "
                         "these fields: ('lr', 'learning_rate'). If your model has a different name for the learning "
                         "rate, set it with `.lr_find(attr_name=...)` (or pass update_attr=False and read "
                         "lr_finder.suggestion() yourself).")


def _batch_holders(model: Any, datamodule: Any, name: str) -> list:
    """The holders of the batch size (:func:`_holders`), with Lightning's warning when the model has it both as an
    attribute and in ``hparams``.

    Raises:
        AttributeError: none has it."""
    holders = _holders(model, datamodule, name)
    if not holders:
        raise AttributeError(f"Field {name} not found in `model`, `datamodule`, nor their `hparams` attributes: set "
                             f"self.{name} in __init__ (or self.save_hyperparameters() with a {name} argument) and "
                             f"build the loaders with it, or name the attribute with batch_arg_name=")
    hparams = getattr(model, "hparams", None)
    if hasattr(model, name) and hparams is not None and name in hparams:
        warnings.warn(f"Field `model.{name}` and `model.hparams.{name}` are mutually exclusive! `model.{name}` will be "
                      "used as the initial batch size for scaling. If this is not the intended behavior, please "
                      "remove either one.", UserWarning, stacklevel=3)
    return holders


def _data_length(source: Any, method: str) -> int | None:
    """The length of the data set of ``source``'s loader for ``method`` (its hook asked once more; the first of several
    loaders), None when it has none (an iterable data set)."""
    loader = eval_loaders(getattr(source, LOADER_HOOKS[method])(), method)[0]
    try:
        return len(loader.dataset)
    except (TypeError, AttributeError):
        return None
