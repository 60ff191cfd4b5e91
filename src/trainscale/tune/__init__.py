"""tune: settings found by trying them on this job's own devices.

    from trainscale.tune import find_batch_size
    bs = find_batch_size(model, F.cross_entropy, train_set, strategy="ddp", max_memory=2 * 2**30)

``find_batch_size`` (:mod:`trainscale.tune.batch_size`; ``Trainer(batch_size="max")`` calls it): the largest
per-device micro-batch that trains, power-of-two growth then a binary search, each trial a real training
step on a copy of the model; under ddp/fsdp every rank searches and the ranks agree on the minimum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names of __all__, for type checkers and the API reference (docs/api.md)
    from trainscale.tune.batch_size import BatchSizeError, Trial, find_batch_size, search

__all__ = ["find_batch_size", "search", "BatchSizeError", "Trial"]


def __getattr__(name: str):
    if name in __all__:
        from trainscale.tune import batch_size

        return getattr(batch_size, name)
    raise AttributeError(f"module 'trainscale.tune' has no attribute {name!r}")
