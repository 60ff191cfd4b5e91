"""Checks of the loaders handed to ``fit``, made before the first step, with the fix in each message."""

from __future__ import annotations

import warnings
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

from trainscale.runtime.sampling import in_order
from trainscale.utilities.warnings import PossibleUserWarning


def check_train_loader_type(loader: Any) -> None:
    """Refuse a training "loader" that is not a ``torch.utils.data.DataLoader``: the loop reads its ``batch_size``
    (the global batch), its sampler (trainscale's, whose position a checkpoint saves) and its length. Lightning also
    takes any iterable there, and a list or dict of loaders (its ``CombinedLoader``), which trainscale has not.

    Raises:
        TypeError: naming what was given and the fix.
    """
    if isinstance(loader, DataLoader):
        return
    if isinstance(loader, (list, tuple, dict)):
        raise TypeError(f"the training loaders came as a {type(loader).__name__}: trainscale trains on one DataLoader "
                        "(it has no CombinedLoader to draw from several at once); give one DataLoader over a data set "
                        "that returns the samples of each source together (e.g. a Dataset whose __getitem__ returns a "
                        "tuple of them), or a torch.utils.data.ConcatDataset for one after the other")
    raise TypeError(f"the training loader is a {type(loader).__name__}, not a torch.utils.data.DataLoader: trainscale "
                    "reads the DataLoader's batch_size, sampler and length (the global batch, the resumable sample "
                    "position); pass the DataLoader itself (unwrapped), or a DataLoader over an IterableDataset that "
                    "yields what your object does")


def check_loaders(train_loader: Any, val_loaders: list | None) -> None:
    """Refuse a training loader the loop cannot count (None: none to check); warn about an empty validation loader.
    Loaders over an ``IterableDataset`` are not measured (no ``len``: their iterator ends each epoch), nor are other
    iterables than DataLoaders among the validation loaders.

    Raises:
        ValueError: a loader built with ``batch_size=None`` (the Trainer needs the per-device batch size
            for the global batch and the sample position), or an empty training loader.
    """
    if train_loader is not None and getattr(train_loader, "batch_size", None) is None:
        raise ValueError("the training DataLoader has batch_size=None (it yields ready-made batches); build it as "
                         "DataLoader(dataset, batch_size=N) with the per-device batch size")
    if train_loader is not None and not isinstance(train_loader.dataset, IterableDataset) and len(train_loader) == 0:
        raise ValueError("the training DataLoader is empty on this rank (a dataset of no samples, or drop_last with "
                         "fewer samples than one batch); give it data, or a smaller batch_size")
    for i, loader in enumerate(val_loaders or []):
        dataset = getattr(loader, "dataset", None)
        if dataset is not None and not isinstance(dataset, IterableDataset) and len(dataset) == 0:
            which = f" (dataloader {i})" if len(val_loaders) > 1 else ""
            warnings.warn(f"the validation DataLoader{which} is empty: no val_ metrics will be recorded for it",
                          stacklevel=3)


def warn_few_batches(batches: float, log_every_n_steps: int, logs: bool) -> None:
    """Lightning's ``PossibleUserWarning`` (its words, ``_FitLoop.setup_data``) when an epoch has fewer training
    batches (``batches``: after ``limit_train_batches``; inf for an iterable data set, never warned) than
    ``log_every_n_steps``, so no step record of the epoch reaches the loggers; ``logs``: the run has loggers and is
    no ``fast_dev_run`` (Lightning's conditions). Said each time the training loader is made (a reload too)."""
    if logs and batches < log_every_n_steps:
        warnings.warn(f"The number of training batches ({batches}) is smaller than the logging interval "
                      f"Trainer(log_every_n_steps={log_every_n_steps}). Set a lower value for log_every_n_steps if "
                      "you want to see logs for the training epoch.", PossibleUserWarning, stacklevel=4)


def validation_to_run(model: Any, has_training_step: bool, has_loaders: bool, limit_val_batches: float,
                      warn: bool) -> bool:
    """Whether ``fit`` validates (Lightning's ``trainer.enable_validation``), with Lightning's checks of its validation
    loop (``trainer/configuration_validator.py``) in its words: it has validation loaders (``has_loaders``: passed,
    or a ``val_dataloader()`` hook, Lightning's ``_DataLoaderSource.is_defined``), ``limit_val_batches`` is not 0,
    and the module can validate with them: a module with ``training_step`` and no ``validation_step`` cannot
    (Lightning's ``UserWarning``: validation is skipped). A ``validation_step`` without loaders is Lightning's
    ``PossibleUserWarning`` (not when ``limit_val_batches=0`` turned validation off). ``warn``: this rank says the
    latter (rank zero, as Lightning's ``rank_zero_warn``)."""
    has_step = getattr(model, "validation_step", None) is not None
    if has_loaders and has_training_step and not has_step:
        warnings.warn("You passed in a `val_dataloader` but have no `validation_step`. Skipping val loop. "
                      f"({type(model).__name__} defines no validation_step: validation is skipped, as in "
                      "Lightning; define validation_step to validate)", stacklevel=5)
        return False
    if not has_loaders and has_step and warn and limit_val_batches != 0:
        warnings.warn("You defined a `validation_step` but have no `val_dataloader`. Skipping val loop. (Pass "
                      "val_dataloaders to fit, or define val_dataloader() on the module or its data module)",
                      PossibleUserWarning, stacklevel=5)
    return has_loaders and limit_val_batches != 0


def warn_unshuffled(loader: Any, data_parallel_size: int) -> None:
    """Say (a ``UserWarning``, shown once per script) that a training loader without shuffling keeps its order on
    several data-parallel ranks, where Lightning's default (``use_distributed_sampler=True``) shuffles every training
    loader it distributes (``DistributedSampler(shuffle=True)``): a ported script's results would differ silently."""
    if data_parallel_size > 1 and isinstance(getattr(loader, "sampler", None), SequentialSampler):
        warnings.warn(f"the training DataLoader does not shuffle: on {data_parallel_size} data-parallel ranks each "
                      "reads its share in the loader's order, where Lightning would shuffle it (its DistributedSampler "
                      "default); pass DataLoader(..., shuffle=True) for a shuffled order (seed + epoch, the same on "
                      "every rank), or Trainer(use_distributed_sampler=False) to use the loader as given",
                      UserWarning, stacklevel=3)


def overfit_order(loader: Any, stage: str, warn: bool = True) -> Any:
    """Under ``overfit_batches``: ``loader`` with a ``SequentialSampler`` (``sampling.in_order``), with Lightning's
    ``UserWarning`` (when ``warn``: rank zero) when its sampler was another (a shuffling or custom one), so that every
    epoch reads the same first batches; a loader over an ``IterableDataset`` or with a ``batch_sampler`` of its own
    is returned as given."""
    sampler = getattr(loader, "sampler", None)
    if (sampler is None or isinstance(sampler, SequentialSampler) or isinstance(loader.dataset, IterableDataset)
            or loader.batch_size is None):
        return loader
    if warn:
        warnings.warn(f"You requested to overfit but enabled {stage} dataloader shuffling. We are turning off the "
                      f"{stage} dataloader shuffling for you: overfit_batches reads the same first batches every "
                      f"epoch (its {type(sampler).__name__} is replaced by a SequentialSampler; give the loader "
                      "shuffle=False to silence this)", UserWarning, stacklevel=4)
    return in_order(loader)


_DTYPE_MISMATCH = ("must have the same dtype", "expected scalar type", "Input type (double)")


def explain_batch_error(err: BaseException) -> Exception | None:
    """A clear error for a batch the model cannot take, from the error torch raised in the step; None for
    any other error. Translated where it surfaces (no check per step): float64 inputs to a float32 model,
    and class labels outside the model's outputs (``cross_entropy``'s "Target N is out of bounds")."""
    text = str(err)
    if isinstance(err, RuntimeError) and any(marker in text for marker in _DTYPE_MISMATCH) and "Double" in text:
        return TypeError(f"the batch holds float64 (double) inputs but the model's parameters are float32 ({text}); "
                         "convert the data once, e.g. TensorDataset(x.float(), y), or build the model in float64 "
                         "(model.double())")
    if isinstance(err, IndexError) and text.startswith("Target ") and "out of bounds" in text:
        return ValueError(f"a class label is outside the model's outputs ({text}): labels must lie in "
                          "[0, number of classes); check the labels (e.g. 1-based, or a class the model has no "
                          "output for) or the model's output size")
    return None
