"""The one checkpoint system of a fit (Lightning's ``ModelCheckpoint``)."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from trainscale.callbacks.base import Callback

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer

OWNER = ".trainscale-run"  # in a user's dirpath: the run directory whose checkpoints it holds
LAST_LINK = "last.ckpt"  # Lightning's CHECKPOINT_NAME_LAST + FILE_EXTENSION


class ModelCheckpoint(Callback):
    """Save full, resumable checkpoints and keep the best ones (Lightning's ``ModelCheckpoint``).

    It is the only thing that writes a fit's scheduled checkpoints. When the user gives none (and
    ``enable_checkpointing`` is on), the Trainer adds one from its own flags:
    ``ModelCheckpoint(every_n_epochs=1, every_n_train_steps=checkpoint_every_n_steps, save_top_k=keep_last)``
    (``keep_last=None``: ``save_top_k=-1``). The Trainer asks every ``ModelCheckpoint`` at the end of each
    optimizer step and each epoch (:meth:`save_if_due`, called by name in ``Trainer._checkpoint_if_due``).

    Names: by default ``epoch=EEEEEE-step=SSSSSSSSSS`` (+ ".pt" for a one-file checkpoint, none for a sharded
    directory), EEEEEE the epochs completed; with ``filename``, Lightning's template (:meth:`format_checkpoint_name`)
    + the same suffix. Written atomically with its SHA-256. After each save ``<run dir>/checkpoints/last`` names it,
    so ``fit(ckpt_path="last")`` resumes from the newest save; with ``save_last``, ``<dirpath>/last.ckpt`` is
    also a symbolic link to it (for ``load_from_checkpoint``, ``ckpt_path=".../last.ckpt"``).

    One pruning rule: the ``save_top_k`` best by ``monitor`` (without a monitor: the newest) are kept, and the
    newest (the one "last" names); only files this callback wrote into its own ``dirpath`` during this run are ever
    deleted (never another run's, e.g. the checkpoints a run resumed into a new ``version_N`` started from). A run
    resumed in place (``fit(ckpt_path="last")`` continuing its directory) is the same run: the files its earlier
    processes kept, the one it resumed from included, are ranked by their scores and pruned as its own (each
    checkpoint's callback state already counts the checkpoint itself, as Lightning's ``best_k_models``).
    A non-finite monitored value ranks worst, as in Lightning: a NaN epoch never evicts a good checkpoint. A name
    that exists already (a template without ``{step}``, a run resumed in place) gets Lightning's version suffix
    ``-v1``, ``-v2``...: no file is ever overwritten.

    Args:
        dirpath: where to write; default ``<run dir>/checkpoints``. A directory that holds another run's
            checkpoints is refused at the start of ``fit`` (two runs would replace each other's files).
        filename: Lightning's template, e.g. ``"{epoch}-{val_loss:.2f}"`` → ``epoch=3-val_loss=0.12``: fields
            are ``epoch`` (the epoch being trained, from 0, as Lightning), ``step`` (optimizer steps so far)
            and any metric in ``trainer.callback_metrics`` (0 when missing, as Lightning). None: the default name.
        monitor: metric name in ``trainer.callback_metrics`` (e.g. "val_loss"); None: keep the newest.
        save_last: True or "link": keep ``last.ckpt`` in ``dirpath`` pointing at the newest checkpoint. Both are a
            link here (Lightning's True writes a second copy; trainscale keeps the newest checkpoint anyway).
        save_top_k: checkpoints kept besides the newest (``-1``: all; ``0``: none, and nothing is saved
            unless ``save_last``, which then keeps only the newest).
        mode: "min" or "max".
        auto_insert_metric_name: the template's ``{name}`` becomes ``name={name}`` (Lightning's default).
        every_n_train_steps: save every N optimizer steps (mid-epoch).
        every_n_epochs: save at the end of every N-th epoch; default 1 without ``every_n_train_steps``, else 0
            (never at epoch ends). With both, a step that ends an epoch saves once, at the epoch end.

    Raises:
        ValueError: bad arguments (a ``filename`` of "last" or one that formats to a path with "/"); at an
            epoch-end save, a ``monitor`` not among the metrics (at a step save before the first validation: a
            warning, and the checkpoint ranks last).
    """

    monitors_metrics = True  # its on_train_epoch_end after the module's (Lightning's monitoring callbacks)

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None, monitor: str | None = None,
                 save_last: bool | str | None = None, save_top_k: int = 1, mode: str = "min",
                 auto_insert_metric_name: bool = True, every_n_train_steps: int | None = None,
                 every_n_epochs: int | None = None) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}; choose 'min' or 'max'")
        if isinstance(save_top_k, bool) or not isinstance(save_top_k, int) or save_top_k < -1:
            raise ValueError(f"save_top_k={save_top_k!r} must be an int >= 0, or -1 to keep every checkpoint")
        _check_naming(filename, save_last)
        self.filename, self.save_last, self.auto_insert_metric_name = filename, save_last, auto_insert_metric_name
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}={value!r} must be an int >= 0 or None")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.monitor, self.mode, self.save_top_k = monitor, mode, save_top_k
        self.every_n_train_steps = every_n_train_steps or None
        self.every_n_epochs = (1 if self.every_n_train_steps is None else 0) if every_n_epochs is None else every_n_epochs
        self.best_k: dict[str, float] = {}  # path -> score (lower is better after the sign for "max")
        self._directory: Path | None = None  # this fit's resolved dirpath
        self._written: list[str] = []  # this run's files in _directory, oldest first
        self._newest: str | None = None  # the last checkpoint this callback wrote (kept, as "last" names it)
        self._warned_missing = False

    @property
    def state_key(self) -> str:
        """Lightning's key: the class name and ``monitor``, ``mode``, ``every_n_train_steps`` (0 for none),
        ``every_n_epochs`` and ``train_time_interval`` (None: trainscale has no time trigger)."""
        return self._generate_state_key(monitor=self.monitor, mode=self.mode,
                                        every_n_train_steps=self.every_n_train_steps or 0,
                                        every_n_epochs=self.every_n_epochs, train_time_interval=None)

    def setup_directory(self, trainer: Trainer) -> None:
        """At the start of a fit, after its run directory is chosen (every rank): resolve ``dirpath`` and claim
        it for this run.

        Raises:
            ValueError: ``dirpath`` holds the checkpoints of another run.
        """
        self._directory = Path(trainer.run_dir) / "checkpoints" if self.dirpath is None else self.dirpath
        self._adopt_earlier_files(trainer)
        if self.dirpath is None:
            return
        owner_file = self.dirpath / OWNER
        owner = owner_file.read_text().strip() if owner_file.is_file() else None
        run = str(Path(trainer.run_dir).resolve())
        if owner is not None and owner != run:
            raise ValueError(f"ModelCheckpoint(dirpath={str(self.dirpath)!r}) holds the checkpoints of the run {owner}; "
                             "two runs writing there would replace each other's files: give this run its own dirpath")
        trainer.runtime.barrier()  # every rank has read the owner before rank zero writes it
        if owner is None and trainer.runtime.is_rank_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            owner_file.write_text(run + "\n")

    def _adopt_earlier_files(self, trainer: Trainer) -> None:
        """Resumed in place: the kept files of the run's earlier processes are this run's too, and so is the one it
        resumed from (e.g. a checkpoint saved on a signal); another run's directory is never this one. One this
        callback did not rank (a save on a signal, another configuration) ranks by its step (no monitor), else last."""
        resumed_from = [str(trainer.ckpt_path)] if trainer.ckpt_path is not None else []
        earlier = dict.fromkeys([*self.best_k, *([self._newest] if self._newest else []), *resumed_from])
        self._written = [p for p in earlier if Path(p).parent.resolve() == self._directory.resolve()]
        for path in resumed_from:
            if path in self._written and path not in self.best_k:
                self.best_k[path] = -float(trainer.global_step) if self.monitor is None else math.inf

    def format_checkpoint_name(self, metrics: dict, filename: str | None = None, ver: int | None = None) -> str:
        """Lightning's ``ModelCheckpoint.format_checkpoint_name`` (``_format_checkpoint_name``), without the
        directory and extension (the strategy adds ".pt" for a file): ``"{epoch}-{val_loss:.2f}"`` with
        ``{"epoch": 2, "val_loss": 0.123456}`` → ``"epoch=2-val_loss=0.12"``; a missing field formats 0;
        ``ver`` adds ``-v<ver>``.

        Raises:
            ValueError: no template (``filename`` None); a name with "/" (a metric named "a/b": pass
                ``auto_insert_metric_name=False`` and a template without it).
        """
        template = filename or self.filename
        if not template:
            raise ValueError("format_checkpoint_name needs a filename template (ModelCheckpoint(filename=...))")
        metrics = dict(metrics)
        # longest first, so that "{epoch}" does not replace part of "{epoch_test}" (as Lightning)
        for group in sorted(re.findall(r"(\{.*?)[:\}]", template), key=len, reverse=True):
            name = group[1:]
            if self.auto_insert_metric_name:
                template = template.replace(group, f"{name}={{{name}")
            template = template.replace(group, f"{{0[{name}]")  # keys with dots, as Lightning
            metrics.setdefault(name, 0)
        name = template.format(metrics) + (f"-v{ver}" if ver is not None else "")
        if "/" in name:
            raise ValueError(f"ModelCheckpoint(filename={self.filename!r}) formats to {name!r}, a path: metric names "
                             "with '/' make directories; pass auto_insert_metric_name=False and a template without '/'")
        return name

    def _file_name(self, trainer: Trainer) -> str | None:
        """This save's name (without suffix) from the template, versioned past any existing file (checked on rank
        zero, the same answer on every rank); None for the default name."""
        if self.filename is None:
            return None
        metrics = {**trainer.callback_metrics, "epoch": trainer.current_epoch, "step": trainer.global_step}
        suffix = trainer.runtime.strategy.checkpoint_suffix
        name, ver = self.format_checkpoint_name(metrics), 0
        if trainer.runtime.is_rank_zero:
            while (self._directory / f"{name}{suffix}").exists():
                ver += 1
                name = self.format_checkpoint_name(metrics, ver=ver)
        return trainer.runtime.broadcast_object(name)

    def save_if_due(self, trainer: Trainer, epoch_end: bool, ends_epoch: bool) -> None:
        """Save when this step or epoch end is one of this callback's (every rank calls it at the same point).
        ``ends_epoch``: this optimizer step is the last of its epoch (an epoch-end save follows it)."""
        epoch_due = bool(self.every_n_epochs) and (trainer.current_epoch + 1) % self.every_n_epochs == 0
        if self.monitor is not None and not trainer.config.validates_in(trainer.current_epoch):
            epoch_due = False  # an epoch check_val_every_n_epoch skips: no fresh value to rank by (Lightning saves
                               # at validation ends then)
        if epoch_end:
            due = epoch_due
        else:
            n = self.every_n_train_steps
            due = n is not None and trainer.reached_multiple(n) and not (ends_epoch and epoch_due)
        if due:
            self._save(trainer, epoch_end)

    def _score(self, trainer: Trainer, epoch_end: bool) -> float:
        if self.monitor is None:
            return -float(trainer.global_step)  # newest first
        metrics = trainer.callback_metrics
        if self.monitor not in metrics and not epoch_end:  # a step save before the first validation: as Lightning,
            if not self._warned_missing:                    # a warning, and this checkpoint ranks last
                warnings.warn(f"ModelCheckpoint monitors {self.monitor!r}, not among the metrics yet at step "
                              f"{trainer.global_step}: this checkpoint ranks last", RuntimeWarning, stacklevel=2)
                self._warned_missing = True
            return math.inf
        if self.monitor not in metrics:
            raise ValueError(f"ModelCheckpoint monitors {self.monitor!r}, which is not among the metrics: "
                             f"{', '.join(sorted(metrics))}")
        value = float(metrics[self.monitor])
        if not math.isfinite(value):
            return math.inf  # worst, whatever the mode
        return value if self.mode == "min" else -value

    def _save(self, trainer: Trainer, epoch_end: bool) -> None:
        if self.save_top_k == 0 and not self.save_last:
            return  # Lightning: save_top_k=0 saves nothing (but "last" when asked)
        score = self._score(trainer, epoch_end)
        name = self._file_name(trainer)
        path = str(trainer.checkpoint_path(self._directory, name))
        # ranked before the write (Lightning's order), so that the state this checkpoint holds counts it: a run
        # resumed from it in place knows it as its own, with its score
        self._written.append(path)
        self._newest = path
        self.best_k[path] = score
        if self.save_top_k >= 0:
            for dropped in sorted(self.best_k, key=self.best_k.get)[self.save_top_k:]:  # ties: the older stays
                del self.best_k[dropped]
        trainer.write_checkpoint(self._directory, background=True, name=name)
        keep = set(self.best_k) | {path}  # the newest is "last"
        stale = [p for p in self._written if p not in keep]
        self._written = [p for p in self._written if p in keep]
        if self.save_last:
            trainer.checkpoints.link(Path(path), self._directory / LAST_LINK)  # once the new one is on disk
        trainer.checkpoints.discard([Path(p) for p in stale])  # then, the ones it replaces

    @property
    def last_model_path(self) -> str | None:
        """``<dirpath>/last.ckpt`` with ``save_last`` once a checkpoint is saved, else None (Lightning's name)."""
        return str(self._directory / LAST_LINK) if self.save_last and self._written else None

    @property
    def best_model_path(self) -> str | None:
        """The best checkpoint kept (the newest without a monitor), or None before the first save."""
        return min(self.best_k, key=self.best_k.get) if self.best_k else None

    def state_dict(self) -> dict:
        return {"best_k": dict(self.best_k), "newest": self._newest}

    def load_state_dict(self, state: dict) -> None:
        self.best_k = dict(state["best_k"])
        self._newest = state.get("newest")  # absent from checkpoints written before it was kept


def _check_naming(filename: str | None, save_last: bool | str | None) -> None:
    """Raise ValueError for a ``save_last`` other than None/False/True/"link", or a ``filename`` that is not a
    non-empty template or is "last" (the name of the link to the newest checkpoint)."""
    if save_last not in (None, False, True, "link"):
        raise ValueError(f"save_last={save_last!r}; choose True, 'link', False or None")
    if filename is not None and (not isinstance(filename, str) or not filename or filename in ("last", LAST_LINK)):
        raise ValueError(f"filename={filename!r}: give a template such as '{{epoch}}-{{val_loss:.2f}}' (not "
                         "'last', the name of the link to the newest checkpoint), or None for the default name")
