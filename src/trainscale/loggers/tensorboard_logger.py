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

from trainscale.loggers.base import (check_status, experiment_or_dummy, flatten, process_rank, require,
                                     save_hparams_to_yaml)
from trainscale.loggers.log_dirs import VersionedDir, add_prefix


class TensorBoardLogger(VersionedDir):
    """Each metric a scalar tagged with its name at ``step``; hyperparameters in TensorBoard's HParams tab.

    Where: with a ``save_dir``, Lightning's ``save_dir/name/version_N[/sub_dir]`` (``TensorBoardLogger("tb_logs",
    name="my_model")`` writes ``tb_logs/my_model/version_0``; see ``trainscale.loggers.log_dirs``); without one (the
    default) ``<run dir>/tensorboard[/sub_dir]``. ``name``, ``version``, ``root_dir``, ``log_dir`` and ``save_dir``
    are Lightning's properties (paths as strings). A version directory that holds files of another run is refused
    at :meth:`setup`; a resumed run continues in its own.

    Writes through ``torch.utils.tensorboard.SummaryWriter``
    (https://pytorch.org/docs/stable/tensorboard.html): events reach the file every ``flush_secs`` seconds and
    at :meth:`finalize`, not at each call (metrics.jsonl is the run's flushed record). ``Trainer(tensorboard=True)``
    adds one with the defaults. ``prefix`` goes before every metric name as Lightning's (``prefix-name``).
    Hyperparameters are flattened (``{"optim": {"lr": 0.1}}`` -> ``optim/lr``); numbers are written as
    numbers, None is left out, other values as strings. They are written into the run's own event file,
    as Lightning's TensorBoardLogger does, not into a sub-run as ``SummaryWriter.add_hparams`` would, with the
    metrics given, else (``default_hp_metric=True``, Lightning's placeholder) ``hp_metric`` = -1, also logged as a
    scalar, which ``self.log("hp_metric", value)`` then updates; with ``default_hp_metric=False`` and no metrics the
    HParams tab gets nothing, as in Lightning.
    As Lightning's, the hyperparameters logged so far are also kept in :attr:`hparams` and written, nested, to
    ``<log_dir>/hparams.yaml`` (:attr:`NAME_HPARAMS_FILE`; read it back with ``load_hparams_from_yaml``), rewritten at
    each ``log_hyperparams`` call (``trainscale.loggers.save_hparams_to_yaml``: an Enum as its name; a value YAML cannot
    hold is skipped with Lightning's warning). View with ``tensorboard --logdir runs``.

    The Trainer calls a logger on rank zero only (see :class:`trainscale.loggers.Logger`).

    Args:
        save_dir: the directory of the experiments; None (the default): the run directory.
        name: the experiment's directory under ``save_dir`` (None or "": none); needs a ``save_dir``.
        version: None: the next free ``version_N``; an int ``N``: ``version_N``; a string: that directory's name;
            needs a ``save_dir``.
        log_graph: Lightning's model graph; only False (``logger.experiment.add_graph(model, example)`` draws one).
        default_hp_metric: the ``hp_metric`` = -1 placeholder (above).
        prefix: put before every metric name, joined by "-" (Lightning's ``LOGGER_JOIN_CHAR``).
        sub_dir: a directory under the version directory for the event files (Lightning's).
        flush_secs: seconds between writes of the queued events to the file.
        max_queue: events queued before the training thread waits for the writer thread (SummaryWriter's
            default of 10 made it wait at every record of ~40 scalars).
        **kwargs: other ``SummaryWriter`` arguments (``filename_suffix``, ``purge_step``), as Lightning passes them.

    Raises:
        ModuleNotFoundError: tensorboard is not installed (names the pip command).
        ValueError: ``log_graph=True``; a ``name`` or ``version`` without a ``save_dir``; a ``save_dir`` that is a
            file or cannot be written.
        TypeError: a ``SummaryWriter`` argument that it does not take, or ``log_dir``/``comment`` (the log directory
            is this logger's).
    """

    NAME_HPARAMS_FILE = "hparams.yaml"  # Lightning's: the hyperparameters' file in log_dir

    def __init__(self, save_dir: str | os.PathLike | None = None, name: str | None = "lightning_logs",
                 version: int | str | None = None, log_graph: bool = False, default_hp_metric: bool = True,
                 prefix: str = "", sub_dir: str | os.PathLike | None = None, flush_secs: float = 10.0,
                 max_queue: int = 1000, **kwargs: Any) -> None:
        require("TensorBoardLogger", "tensorboard", "tensorboard")
        if log_graph:
            raise ValueError("TensorBoardLogger(log_graph=True): trainscale does not trace the model for TensorBoard; "
                             "draw the graph yourself once set up, e.g. in on_fit_start: "
                             "trainer.logger.experiment.add_graph(model, example_input) (a SummaryWriter call)")
        _check_writer_kwargs(kwargs)
        super().__init__("TensorBoardLogger", save_dir, name, version, in_run_dir="tensorboard", sub_dir=sub_dir)
        self.default_hp_metric, self.prefix = default_hp_metric, prefix
        self.flush_secs, self.max_queue, self.writer_kwargs = flush_secs, max_queue, kwargs
        self.hparams: dict[str, Any] = {}  # every hyperparameter logged so far (Lightning's attribute)
        self._writer: Any = None  # the SummaryWriter, after setup

    @property
    def experiment(self):
        """The ``torch.utils.tensorboard.SummaryWriter`` (for images, histograms, ...), after setup; on the other
        ranks a no-op ``DummyExperiment`` (``trainscale.loggers.base.experiment_or_dummy``). Read on rank zero before
        setup, a logger with a ``save_dir`` sets itself up there without a run, as Lightning's does at its first use.

        Raises:
            RuntimeError: on rank zero, before setup, without a ``save_dir``.
            FileExistsError: the version directory holds files of another run.
        """
        if self._writer is None and self.writes_alone():
            self._open(self.claim(None))
        return experiment_or_dummy(self._writer, "TensorBoardLogger")

    def setup(self, run_dir: str | os.PathLike) -> None:
        """Choose (or continue in) :attr:`log_dir` for the run ``run_dir`` and open a ``SummaryWriter`` there.

        Raises:
            FileExistsError: the version directory holds files of another run (``log_dirs.VersionedDir.claim``).
        """
        self._open(self.claim(run_dir))

    def _open(self, log_dir: Path) -> None:
        """A ``SummaryWriter`` on ``log_dir``: the one open there already (opened at a first use before setup)."""
        if self._writer is not None:
            if self._writer.get_logdir() == str(log_dir):
                return
            self._writer.close()
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir), max_queue=self.max_queue, flush_secs=self.flush_secs,
                                     **self.writer_kwargs)

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace | None = None,
                        metrics: Mapping[str, Any] | float | None = None, step: int | None = None) -> None:
        """Write ``params`` (a dict, or an ``argparse.Namespace`` as in Lightning) to the HParams tab with ``metrics``
        (a number is ``{"hp_metric": number}``; None: the ``hp_metric`` placeholder when ``default_hp_metric``) and,
        merged with those logged before, to ``hparams.yaml``.

        Raises:
            RuntimeError: called before :meth:`setup` (on rank zero).
        """
        from torch.utils.tensorboard.summary import hparams

        writer = self.experiment
        params = vars(params) if isinstance(params, Namespace) else params or {}
        self.hparams.update(params)
        if self._writer is None:  # another rank's no-op experiment
            return
        save_hparams_to_yaml(Path(self.log_dir) / self.NAME_HPARAMS_FILE, self.hparams)
        if metrics is None:
            metrics = {"hp_metric": -1} if self.default_hp_metric else {}
        elif not isinstance(metrics, Mapping):
            metrics = {"hp_metric": metrics}
        if not metrics:
            return
        self.log_metrics(metrics, step)
        flat = {k: _hparam_value(v) for k, v in flatten(dict(params), sep="/").items()}
        for summary in hparams(flat, dict(metrics)):  # experiment, session start, session end
            writer.file_writer.add_summary(summary, step)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Each metric a scalar at ``step`` (None: TensorBoard's own), its name after ``prefix``; nothing on a rank
        other than zero.

        Raises:
            RuntimeError: before setup on rank zero, without a ``save_dir``.
        """
        writer = self.experiment
        for tag, value in add_prefix(metrics, self.prefix).items():
            writer.add_scalar(tag, value, global_step=step)

    def save(self) -> None:
        """Lightning's ``save``: write the queued events to the event file, and the hyperparameters logged so far to
        ``<log_dir>/hparams.yaml`` when :attr:`log_dir` exists and has none (``log_hyperparams`` keeps it current).
        Nothing on a rank other than zero, nor before a run without a ``save_dir``."""
        if process_rank() != 0:
            return
        if self._writer is not None:
            self._writer.flush()
        log_dir = self.log_dir
        hparams_file = Path(log_dir or "") / self.NAME_HPARAMS_FILE
        if log_dir is not None and Path(log_dir).is_dir() and not hparams_file.is_file():
            save_hparams_to_yaml(hparams_file, self.hparams)

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


def _check_writer_kwargs(kwargs: Mapping[str, Any]) -> None:
    """``kwargs`` are ``SummaryWriter`` arguments other than the log directory's (which the logger sets).

    Raises:
        TypeError: naming the argument.
    """
    if not kwargs:
        return
    import inspect

    from torch.utils.tensorboard import SummaryWriter  # only for extra arguments: it imports tensorboard

    taken = set(inspect.signature(SummaryWriter).parameters) - {"log_dir", "comment", "max_queue", "flush_secs"}
    for key in kwargs:
        if key not in taken:
            raise TypeError(f"TensorBoardLogger(..., {key}=...): not an argument of this logger nor of "
                            f"torch.utils.tensorboard.SummaryWriter's it passes on ({', '.join(sorted(taken))})")
