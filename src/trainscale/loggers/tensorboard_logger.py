"""``TensorBoardLogger``: scalars and hyperparameters as TensorBoard event files.

Needs the ``tensorboard`` package (``pip install 'trainscale[tensorboard]'``); it is imported at
:meth:`TensorBoardLogger.setup`, not with this module.
"""

from __future__ import annotations

import numbers
import os
from argparse import Namespace
from pathlib import Path
from typing import Any, Mapping

from trainscale.loggers.base import (check_save_dir, check_status, experiment_or_dummy, flatten, not_set_up, require,
                                     save_hparams_to_yaml)


class TensorBoardLogger:
    """Each metric a scalar tagged with its name at ``step``; hyperparameters in TensorBoard's HParams tab.

    Writes through ``torch.utils.tensorboard.SummaryWriter``
    (https://pytorch.org/docs/stable/tensorboard.html): events reach the file every ``flush_secs`` seconds and
    at :meth:`finalize`, not at each call (metrics.jsonl is the run's flushed record). ``Trainer(tensorboard=True)``
    adds one with the defaults.
    Hyperparameters are flattened (``{"optim": {"lr": 0.1}}`` -> ``optim/lr``); numbers are written as
    numbers, None is left out, other values as strings. They are written into the run's own event file,
    as Lightning's TensorBoardLogger does, not into a sub-run as ``SummaryWriter.add_hparams`` would.
    As Lightning's, the hyperparameters logged so far are also kept in :attr:`hparams` and written, nested, to
    ``<log_dir>/hparams.yaml`` (:attr:`NAME_HPARAMS_FILE`; read it back with ``load_hparams_from_yaml``), rewritten at
    each ``log_hyperparams`` call (``trainscale.loggers.save_hparams_to_yaml``: an Enum as its name; a value YAML cannot
    hold is skipped with Lightning's warning). View with ``tensorboard --logdir runs``.

    The Trainer calls a logger on rank zero only (see :class:`trainscale.loggers.Logger`).

    Args:
        save_dir: the event file directory; None (the default): ``<run dir>/tensorboard``.
        flush_secs: seconds between writes of the queued events to the file.
        max_queue: events queued before the training thread waits for the writer thread (SummaryWriter's
            default of 10 made it wait at every record of ~40 scalars).

    Raises:
        ModuleNotFoundError: tensorboard is not installed (names the pip command).
        ValueError: a ``save_dir`` that is a file or cannot be written.
    """

    NAME_HPARAMS_FILE = "hparams.yaml"  # Lightning's: the hyperparameters' file in log_dir

    def __init__(self, save_dir: str | os.PathLike | None = None, flush_secs: float = 10.0,
                 max_queue: int = 1000) -> None:
        require("TensorBoardLogger", "tensorboard", "tensorboard")
        self.save_dir = Path(save_dir) if save_dir is not None else None
        check_save_dir("TensorBoardLogger", self.save_dir)
        self.flush_secs, self.max_queue = flush_secs, max_queue
        self.log_dir: Path | None = None
        self.hparams: dict[str, Any] = {}  # every hyperparameter logged so far (Lightning's attribute)
        self._writer: Any = None  # the SummaryWriter, after setup

    @property
    def experiment(self):
        """The ``torch.utils.tensorboard.SummaryWriter`` (for images, histograms, ...), after setup; on the other
        ranks a no-op ``DummyExperiment`` (``trainscale.loggers.base.experiment_or_dummy``)."""
        return experiment_or_dummy(self._writer, "TensorBoardLogger")

    def setup(self, run_dir: str | os.PathLike) -> None:
        self.log_dir = self.save_dir or Path(run_dir) / "tensorboard"
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self.log_dir), max_queue=self.max_queue, flush_secs=self.flush_secs)

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace) -> None:
        """Write ``params`` (a dict, or an ``argparse.Namespace`` as in Lightning) to the HParams tab and, merged
        with those logged before, to ``hparams.yaml``.

        Raises:
            RuntimeError: called before :meth:`setup` (on rank zero).
        """
        from torch.utils.tensorboard.summary import hparams

        writer = self.experiment
        params = vars(params) if isinstance(params, Namespace) else params
        self.hparams.update(params)
        if self._writer is not None:  # set up here (not another rank's no-op experiment)
            save_hparams_to_yaml(self.log_dir / self.NAME_HPARAMS_FILE, self.hparams)
        flat = {k: _hparam_value(v) for k, v in flatten(dict(params), sep="/").items()}
        for summary in hparams(flat, {}):  # experiment, session start, session end
            writer.file_writer.add_summary(summary)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._writer is None:
            raise not_set_up("TensorBoardLogger")
        for tag, value in metrics.items():
            self._writer.add_scalar(tag, value, global_step=step)

    def finalize(self, status: str) -> None:
        check_status(status)
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _hparam_value(value: Any) -> float | str | None:
    """What ``torch.utils.tensorboard.summary.hparams`` takes: a Python number, a string, or None (left out)."""
    if value is None or isinstance(value, str):
        return value
    return float(value) if isinstance(value, numbers.Real) else str(value)
