"""Experiment loggers: where a run's metrics and hyperparameters go, with Lightning's names.

- :class:`CSVLogger` — ``metrics.csv`` and ``hparams.json`` in the run directory, or with a ``save_dir`` in Lightning's
  ``save_dir/name/version_N`` (``log_dirs``; no extra package).
- :class:`TensorBoardLogger` — TensorBoard event files, in the same places (``pip install 'trainscale[tensorboard]'``).
- :class:`WandbLogger` — a Weights & Biases run, online or offline (``pip install 'trainscale[wandb]'``).
- :class:`MLFlowLogger` — an MLflow run, by default in a local SQLite store (``pip install 'trainscale[mlflow]'``).

Each follows the :class:`Logger` protocol (``setup``, ``log_hyperparams``, ``log_metrics``, ``finalize``)
and is called on rank zero only. :func:`resolve_loggers` turns ``Trainer(logger=...)`` into a list;
:func:`record_metrics` turns a telemetry record into the flat metrics ``log_metrics`` takes;
:func:`save_hparams_to_yaml` and :func:`load_hparams_from_yaml` write and read a ``hparams.yaml`` as Lightning's
(:func:`save_hparams_to_tags_csv` and :func:`load_hparams_from_tags_csv` its older ``meta_tags.csv``).
Importing this package imports no logging library (nor torch): a logger checks at construction that its
library is installed and imports it at ``setup``. User guide: docs/loggers.md.
"""

from typing import TYPE_CHECKING

from trainscale.loggers.base import (DummyLogger, Logger, load_hparams_from_tags_csv, load_hparams_from_yaml,
                                     record_metrics, resolve_loggers, save_hparams_to_tags_csv, save_hparams_to_yaml)

if TYPE_CHECKING:  # the same names as _LAZY, for type checkers and the API reference (docs/api.md)
    from trainscale.loggers.csv_logger import CSVLogger
    from trainscale.loggers.mlflow_logger import MLFlowLogger
    from trainscale.loggers.tensorboard_logger import TensorBoardLogger
    from trainscale.loggers.wandb_logger import WandbLogger

_LAZY = {  # each logger's module is imported on first use (a run without it never loads it)
    "CSVLogger": "trainscale.loggers.csv_logger",
    "TensorBoardLogger": "trainscale.loggers.tensorboard_logger",
    "WandbLogger": "trainscale.loggers.wandb_logger",
    "MLFlowLogger": "trainscale.loggers.mlflow_logger",
}

__all__ = ["Logger", "DummyLogger", "resolve_loggers", "record_metrics", "save_hparams_to_yaml", "load_hparams_from_yaml",
           "save_hparams_to_tags_csv", "load_hparams_from_tags_csv", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trainscale.loggers' has no attribute {name!r}")
