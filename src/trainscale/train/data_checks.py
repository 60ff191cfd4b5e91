"""Checks of the loaders handed to ``fit``, made before the first step, with the fix in each message."""

from __future__ import annotations

import warnings
from typing import Any


def check_loaders(train_loader: Any, val_loader: Any) -> None:
    """Refuse a training loader the loop cannot count; warn about an empty validation loader.

    Raises:
        ValueError: a loader built with ``batch_size=None`` (the Trainer needs the per-device batch size
            for the global batch and the sample position), or an empty training loader.
    """
    if getattr(train_loader, "batch_size", None) is None:
        raise ValueError("the training DataLoader has batch_size=None (it yields ready-made batches); build it as "
                         "DataLoader(dataset, batch_size=N) with the per-device batch size")
    if len(train_loader) == 0:
        raise ValueError("the training DataLoader is empty on this rank (a dataset of no samples, or drop_last with "
                         "fewer samples than one batch); give it data, or a smaller batch_size")
    if val_loader is not None and len(val_loader.dataset) == 0:
        warnings.warn("the validation DataLoader is empty: no val_ metrics will be recorded", stacklevel=3)
