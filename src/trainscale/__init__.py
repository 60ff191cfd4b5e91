"""trainscale: scale a PyTorch training job from one device to many by changing flags.

    from trainscale import Trainer
    Trainer(devices=2, max_epochs=5).fit(model, train_loader, val_loader)

``import trainscale`` is cheap: the public names below are imported on first use, so
``trainscale --help`` never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # the same names as _LAZY, for type checkers and the API reference (docs/api.md)
    from trainscale.parity.runner import check
    from trainscale.plan.planner import plan
    from trainscale.runtime.runtime import Runtime
    from trainscale.runtime.world import World
    from trainscale.train.data_sources import DataModule
    from trainscale.train.module import TrainingModule
    from trainscale.train.trainer import Trainer

_LAZY = {
    "Trainer": "trainscale.train.trainer",
    "TrainingModule": "trainscale.train.module",
    "DataModule": "trainscale.train.data_sources",
    "Runtime": "trainscale.runtime.runtime",
    "World": "trainscale.runtime.world",
    "plan": "trainscale.plan.planner",
    "check": "trainscale.parity.runner",
}

__all__ = ["Trainer", "TrainingModule", "DataModule", "Runtime", "World", "plan", "check", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trainscale' has no attribute {name!r}")
