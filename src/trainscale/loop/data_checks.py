"""Checks of the loaders handed to ``fit``, made before the first step, with the fix in each message."""

from __future__ import annotations

import warnings
from typing import Any

from torch.utils.data import IterableDataset, SequentialSampler

from trainscale.runtime.sampling import in_order
from trainscale.utilities.warnings import PossibleUserWarning


def check_loaders(train_loader: Any, val_loaders: list | None) -> None:
    """Refuse a training loader the loop cannot count; warn about an empty validation loader. Loaders over an
    ``IterableDataset`` are not measured (no ``len``: their iterator ends each epoch).

    Raises:
        ValueError: a loader built with ``batch_size=None`` (the Trainer needs the per-device batch size
            for the global batch and the sample position), or an empty training loader.
    """
    if getattr(train_loader, "batch_size", None) is None:
        raise ValueError("the training DataLoader has batch_size=None (it yields ready-made batches); build it as "
                         "DataLoader(dataset, batch_size=N) with the per-device batch size")
    if not isinstance(train_loader.dataset, IterableDataset) and len(train_loader) == 0:
        raise ValueError("the training DataLoader is empty on this rank (a dataset of no samples, or drop_last with "
                         "fewer samples than one batch); give it data, or a smaller batch_size")
    for i, loader in enumerate(val_loaders or []):
        if not isinstance(loader.dataset, IterableDataset) and len(loader.dataset) == 0:
            which = f" (dataloader {i})" if len(val_loaders) > 1 else ""
            warnings.warn(f"the validation DataLoader{which} is empty: no val_ metrics will be recorded for it",
                          stacklevel=3)


def validation_to_run(model: Any, has_training_step: bool, val_dataloaders: Any, limit_val_batches: float,
                      warn: bool) -> Any:
    """Lightning's checks of ``fit``'s validation loop (``trainer/configuration_validator.py``), in its words:
    ``val_dataloaders`` (a list, or None) when the module can validate with them; None, with Lightning's
    ``UserWarning``, when a module with ``training_step`` has no ``validation_step``. A ``validation_step`` without a
    loader is Lightning's ``PossibleUserWarning`` (not when ``limit_val_batches=0`` turned validation off). ``warn``:
    this rank says so (rank zero, as Lightning's ``rank_zero_warn``)."""
    has_step = getattr(model, "validation_step", None) is not None
    if val_dataloaders is not None and has_training_step and not has_step:
        warnings.warn("You passed in a `val_dataloader` but have no `validation_step`. Skipping val loop. "
                      f"({type(model).__name__} defines no validation_step: validation is skipped, as in "
                      "Lightning; define validation_step to validate)", stacklevel=5)
        return None
    if val_dataloaders is None and has_step and warn and limit_val_batches != 0:
        warnings.warn("You defined a `validation_step` but have no `val_dataloader`. Skipping val loop. (Pass "
                      "val_dataloaders to fit, or define val_dataloader() on the module or its data module)",
                      PossibleUserWarning, stacklevel=5)
    return val_dataloaders


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
