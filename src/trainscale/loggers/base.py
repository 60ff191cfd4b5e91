"""The ``Logger`` protocol, ``resolve_loggers``, ``record_metrics`` and what the loggers share.

Lightning's names (``lightning.pytorch.loggers.logger.Logger``): ``log_metrics``,
``log_hyperparams``, ``finalize``; plus ``setup``, which hands a logger the run directory.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import os
from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

STATUSES = ("success", "failed")


@runtime_checkable
class Logger(Protocol):
    """Where a run's metrics and hyperparameters go. The Trainer calls a logger on rank zero only.

    The calls, in order, once per run:

    1. ``setup(run_dir)`` — before the first record; ``run_dir`` is the run's directory
       (``runs/version_N``), which exists. A logger opens its files or its remote run here.
    2. ``log_hyperparams(params)`` — the run's configuration (may be called again; keys merge).
    3. ``log_metrics(metrics, step)`` — flat ``{name: number}`` (:func:`record_metrics` turns a
       telemetry record into that) at the global optimizer step ``step``; many times.
    4. ``finalize(status)`` — "success" or "failed"; the logger flushes and closes. Calling it again
       does nothing.

    Optional, as Lightning's (not protocol members, so loggers without them still match):
    ``log_graph(model)``, called once in ``fit`` after ``log_hyperparams`` with the module being fitted (a logger
    that draws the model's graph: ``experiment.add_graph``); ``after_save_checkpoint(checkpoint_callback)``, called on
    rank zero after each checkpoint a ``ModelCheckpoint`` writes, with that callback (a ``weakref.proxy``).

    A resumed run calls ``setup`` with the same ``run_dir``: the file loggers append, W&B and MLflow
    continue the same run (its id is kept in ``run_dir``).
    """

    def setup(self, run_dir: str | os.PathLike) -> None: ...

    def log_hyperparams(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def finalize(self, status: str) -> None: ...


def resolve_loggers(logger: Any, tensorboard: bool = False, fast_dev_run: bool = False) -> list[Logger]:
    """``Trainer(logger=..., tensorboard=..., fast_dev_run=...)`` as a list of loggers.

    None or True: ``[CSVLogger()]`` (the default); False: ``[]``; one logger: ``[logger]``; a list or tuple
    of loggers: a list of them. A logger is any object with ``setup``, ``log_hyperparams``,
    ``log_metrics`` and ``finalize`` (:class:`Logger`). ``tensorboard=True`` adds a ``TensorBoardLogger()``
    unless the list holds one. ``fast_dev_run``: one :class:`DummyLogger` in place of them (none stays none), as
    Lightning's ``_init_debugging_flags``, so that a debug run calls no logger.

    Raises:
        TypeError: for anything else (a string such as "wandb", a class instead of an instance, a list
            holding a non-logger), naming the value and the fix.
        ValueError: the same logger object twice in a list (it would receive every record twice).
        ModuleNotFoundError: ``tensorboard=True`` without the tensorboard package (names the pip command).
    """
    loggers = _given_loggers(logger)
    if tensorboard:
        from trainscale.loggers.tensorboard_logger import TensorBoardLogger

        if not any(isinstance(lg, TensorBoardLogger) for lg in loggers):
            loggers.append(TensorBoardLogger())
    return [DummyLogger()] if loggers and fast_dev_run else loggers


def _given_loggers(logger: Any) -> list[Logger]:
    if logger is None or logger is True:
        from trainscale.loggers.csv_logger import CSVLogger

        return [CSVLogger()]
    if logger is False:
        return []
    loggers = list(logger) if isinstance(logger, (list, tuple)) else [logger]
    for item in loggers:
        if isinstance(item, type) or not isinstance(item, Logger):
            raise TypeError(f"logger={item!r} is not a logger: pass an instance such as trainscale.loggers."
                            "CSVLogger(), TensorBoardLogger(), WandbLogger() or MLFlowLogger() (or a list of them; "
                            "True for the default CSVLogger, False for none)")
    if len({id(item) for item in loggers}) < len(loggers):
        raise ValueError("logger=[...] holds the same logger object twice: pass each logger once")
    return loggers


def flatten(record: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """``{"phase_s": {"data": 1.0}}`` -> ``{"phase_s.data": 1.0}`` (``sep`` joins the keys); other values
    unchanged."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}{sep}", sep))
        else:
            out[f"{prefix}{key}"] = value
    return out


# Record fields that are not metrics: the position (``step`` is passed beside the metrics), labels, the
# wall clock, and ``straggler_ranks`` (a list of rank numbers, not one value per rank).
_NOT_METRICS = frozenset(("kind", "rank", "time", "step", "straggler_ranks"))


def record_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a telemetry record as the flat metrics a logger's ``log_metrics`` takes.

    ``{"kind": "step", "step": 8, "epoch": 0, "train_loss": 0.5, "phase_s": {"data": 0.01},
    "peak_memory_bytes": [10, 20], "mfu": None}`` ->
    ``{"epoch": 0, "step/train_loss": 0.5, "step/phase_s/data": 0.01,
    "step/peak_memory_bytes/rank0": 10, "step/peak_memory_bytes/rank1": 20}``.

    Names are ``<kind>/<field>`` (the record's ``kind``, "step" or "epoch", keeps an interval's
    ``train_loss`` apart from an epoch's), nested fields joined by "/", per-rank lists as ``/rank<i>``;
    ``epoch`` is kept as it is. Left out: ``kind``, ``rank``, ``time``, ``step`` (give it beside the
    metrics), ``straggler_ranks``, and every value that is not a finite real number (None, strings,
    NaN, inf; metrics.jsonl keeps them). Integers stay ``int``, other numbers become ``float``.
    """
    kind = record.get("kind", "record")
    out: dict[str, float] = {}
    for key, value in flatten(record, sep="/").items():
        if key in _NOT_METRICS:
            continue
        name = key if key == "epoch" else f"{kind}/{key}"
        pairs = ([(f"{name}/rank{i}", v) for i, v in enumerate(value)] if isinstance(value, (list, tuple))
                 else [(name, value)])
        out.update((n, int(v) if isinstance(v, numbers.Integral) else float(v)) for n, v in pairs
                   if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v))
    return out


def check_status(status: str) -> None:
    """Raises ValueError unless ``status`` is "success" or "failed"."""
    if status not in STATUSES:
        raise ValueError(f"finalize(status={status!r}): the status is one of {', '.join(map(repr, STATUSES))}")


def require(owner: str, extra: str, *modules: str) -> None:
    """Raises ModuleNotFoundError naming ``pip install 'trainscale[extra]'`` when a module is not installed
    (found without importing it)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(f"{owner} needs {', '.join(missing)}: pip install 'trainscale[{extra}]'")


def check_save_dir(owner: str, save_dir: Path | None) -> None:
    """A logger's own ``save_dir`` can be written: it, or the nearest parent that exists (where it will be made).
    Checked when the logger is made, on every rank, so that a bad directory stops the job before training rather
    than rank zero alone at its first record (the run directory, the default, is checked by the Trainer).

    Raises:
        ValueError: a file, or a directory this user cannot write, naming it and the fix.
    """
    if save_dir is None:
        return
    existing = next(p for p in (save_dir, *save_dir.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{owner}(save_dir={str(save_dir)!r}): {str(existing)!r} is a file; pass a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{owner}(save_dir={str(save_dir)!r}) cannot be written ({str(existing)!r} is read-only for "
                         "this user); pass a directory you can write, or save_dir=None (the run directory)")


def not_set_up(owner: str) -> RuntimeError:
    return RuntimeError(f"{owner}.setup(run_dir) must be called before logging (the Trainer calls it on rank "
                        "zero before the first record)")


def save_hparams_to_yaml(config_yaml: str | os.PathLike, hparams: Mapping[str, Any] | Any,
                         use_omegaconf: bool = True) -> None:
    """``hparams`` (a dict or an ``argparse.Namespace``) as YAML at ``config_yaml``, through a temporary file renamed
    over it, as Lightning's ``save_hparams_to_yaml`` (``lightning.pytorch.core.saving``): an ``Enum`` as its name;
    a value ``yaml.safe_dump`` cannot write (a dtype, an object) is left out with Lightning's ``UserWarning``
    ("Skipping '<name>' parameter ..."), so the file reads back with :func:`load_hparams_from_yaml` or
    ``yaml.safe_load`` (Lightning writes some objects with Python tags instead). ``use_omegaconf``: Lightning's
    argument, accepted (trainscale does not use OmegaConf).

    Raises:
        FileNotFoundError: the directory of ``config_yaml`` does not exist.
    """
    import enum
    import warnings

    import yaml

    kept = {}
    for name, value in (vars(hparams) if not isinstance(hparams, Mapping) else hparams).items():
        value = value.name if isinstance(value, enum.Enum) else value
        try:
            yaml.safe_dump(value)
        except yaml.YAMLError:
            warnings.warn(f"Skipping '{name}' parameter because it is not possible to safely dump to YAML.",
                          UserWarning, stacklevel=2)
            continue
        kept[name] = value
    path = Path(config_yaml)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(kept), encoding="utf-8")
    os.replace(tmp, path)


def load_hparams_from_yaml(config_yaml: str | os.PathLike, use_omegaconf: bool = True) -> dict[str, Any]:
    """The hyperparameters in the YAML file ``config_yaml`` (``yaml.safe_load``), as Lightning's
    ``load_hparams_from_yaml``: a missing file gives ``{}`` with Lightning's ``RuntimeWarning`` ("Missing Tags: ...").
    ``use_omegaconf``: Lightning's argument, accepted; the result is always a plain dict."""
    import warnings

    import yaml

    path = Path(config_yaml)
    if not path.is_file():
        warnings.warn(f"Missing Tags: {path}.", RuntimeWarning, stacklevel=2)
        return {}
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def save_hparams_to_tags_csv(tags_csv: str | os.PathLike, hparams: Mapping[str, Any] | Any) -> None:
    """``hparams`` (a dict or an ``argparse.Namespace``) as a two-column CSV (a ``key,value`` header, then one row per
    hyperparameter, each value as ``str``; None as an empty field, read back as ""), Lightning's older
    ``meta_tags.csv`` form (``save_hparams_to_tags_csv``).

    Raises:
        RuntimeError: the directory of ``tags_csv`` does not exist (Lightning's "Missing folder: ...").
    """
    import csv

    path = Path(tags_csv)
    if not path.parent.is_dir():
        raise RuntimeError(f"Missing folder: {path.parent}.")
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["key", "value"])
        writer.writerows((key, value) for key, value in (hparams if isinstance(hparams, Mapping)
                                                         else vars(hparams)).items())


def load_hparams_from_tags_csv(tags_csv: str | os.PathLike) -> dict[str, Any]:
    """The hyperparameters :func:`save_hparams_to_tags_csv` wrote, each value read back as the Python literal it
    spells (``ast.literal_eval``: numbers, booleans, None, lists, dicts), else as the string, as Lightning's
    ``load_hparams_from_tags_csv``; a missing file gives ``{}`` with Lightning's ``RuntimeWarning``."""
    import ast
    import csv
    import warnings

    path = Path(tags_csv)
    if not path.is_file():
        warnings.warn(f"Missing Tags: {path}.", RuntimeWarning, stacklevel=2)
        return {}
    with path.open(newline="", encoding="utf-8") as file:
        rows = list(csv.reader(file))[1:]
    out = {}
    for key, text in rows:
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text
    return out


class DummyExperiment:
    """``logger.experiment`` on a rank other than zero, where the Trainer sets no logger up: every method a
    no-op, as Lightning's ``DummyExperiment`` (``lightning.fabric.loggers.logger.rank_zero_experiment``), so that
    ``self.logger.experiment.add_image(...)`` in a hook runs on every rank."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None

    def __getitem__(self, index: Any) -> DummyExperiment:
        return self

    def __setitem__(self, index: Any, value: Any) -> None:
        pass


class DummyLogger:
    """The logger the Trainer puts in place of the user's under ``fast_dev_run``, as Lightning's ``DummyLogger``
    (``lightning.pytorch.loggers.logger``): ``trainer.logger`` is one, ``self.logger.experiment`` is a
    :class:`DummyExperiment`, and every method (``log_metrics``, ``log_hyperparams``, any other) does nothing, so
    a debug run calls none of the user's loggers yet runs the code that calls them. ``name`` and ``version`` are
    ``""``; ``save_dir`` and ``log_dir`` are None (``trainer.log_dir`` is None, as nothing is written)."""

    name = version = ""
    save_dir = log_dir = None

    def __init__(self) -> None:
        self.experiment = DummyExperiment()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and the like see a plain object
            raise AttributeError(name)
        return lambda *args, **kwargs: None

    def __getitem__(self, index: Any) -> DummyLogger:  # ``self.logger[0].experiment...`` as in Lightning
        return self


def experiment_or_dummy(experiment: Any, owner: str) -> Any:
    """A logger's ``experiment``: ``experiment`` once set up (not None); before that a :class:`DummyExperiment` on a
    rank other than zero (``torch.distributed``'s rank, else the ``RANK`` variable).

    Raises:
        RuntimeError: not set up, on rank zero.
    """
    if experiment is not None:
        return experiment
    if process_rank() != 0:
        return DummyExperiment()
    raise not_set_up(owner)


def process_rank() -> int:
    """This process's rank: ``torch.distributed``'s once initialized, else the ``RANK`` variable, else 0."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def run_id(run_dir: Path, filename: str) -> str | None:
    """The id of the remote run this run directory logged to, kept in ``run_dir/filename``; None if none."""
    path = run_dir / filename
    return path.read_text().strip() if path.is_file() else None


def keep_run_id(run_dir: Path, filename: str, value: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / filename).write_text(value + "\n")
