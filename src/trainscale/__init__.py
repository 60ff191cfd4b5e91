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
    from trainscale.callbacks.base import Callback
    from trainscale.checkpointing.rng import seed_everything
    from trainscale.cli.lightning_cli import cli_lightning_logo
    from trainscale.lightning.data_sources import DataModule
    from trainscale.lightning.module import TrainingModule
    from trainscale.loop.trainer import Trainer
    from trainscale.runtime.runtime import Runtime
    from trainscale.runtime.world import World

    LightningModule = TrainingModule
    LightningDataModule = DataModule

_LAZY = {
    "Trainer": "trainscale.loop.trainer",
    "TrainingModule": "trainscale.lightning.module",
    "DataModule": "trainscale.lightning.data_sources",
    "Runtime": "trainscale.runtime.runtime",
    "World": "trainscale.runtime.world",
    "seed_everything": "trainscale.checkpointing.rng",
    "Callback": "trainscale.callbacks.base",
    "cli_lightning_logo": "trainscale.cli.lightning_cli",  # Lightning's example scripts call it first
}
# Lightning's names for the same classes, so that a port that changes only ``import lightning as L`` to
# ``import trainscale as L`` keeps ``class Model(L.LightningModule)`` and ``L.LightningDataModule``.
_ALIASES = {"LightningModule": "TrainingModule", "LightningDataModule": "DataModule"}

__all__ = ["Trainer", "TrainingModule", "DataModule", "Callback", "Runtime", "World", "seed_everything",
           "LightningModule", "LightningDataModule", "cli_lightning_logo", "__version__"]
# The commands' Python forms live in their subpackages, named after the commands:
# ``from trainscale.plan import plan``, ``from trainscale.check import check``, ``from trainscale.bench import sweep``.


def __getattr__(name: str):
    if name in _ALIASES:
        value = globals()[name] = __getattr__(_ALIASES[name])
        return value
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trainscale' has no attribute {name!r}")
