"""tuner: Lightning's ``lightning.pytorch.tuner`` (a port changes only the import).

    from trainscale.tuner import Tuner
    tuner = Tuner(trainer)
    lr_finder = tuner.lr_find(model)            # the learning-rate range test; model.lr set to its suggestion
    new_lr = lr_finder.suggestion()
    tuner.scale_batch_size(model, mode="power")  # the largest batch size that trains; model.batch_size set to it

:class:`~trainscale.tuner.tuning.Tuner` (``tuning.py``) runs short throwaway fits of the trainer's flags
(``scratch.py``); the range test and its result are in ``lr_finder.py``; the batch-size search is
``trainscale.tune.batch_size.search``, the one ``Trainer(batch_size="max")`` uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names of __all__, for type checkers and the API reference (docs/api.md)
    from trainscale.tuner.lr_finder import LRFinder
    from trainscale.tuner.tuning import Tuner

__all__ = ["Tuner", "LRFinder"]
_MODULES = {"Tuner": "trainscale.tuner.tuning", "LRFinder": "trainscale.tuner.lr_finder"}


def __getattr__(name: str):
    if name in _MODULES:
        import importlib

        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module 'trainscale.tuner' has no attribute {name!r}")
