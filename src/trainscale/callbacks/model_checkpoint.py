"""The one checkpoint system of a fit (Lightning's ``ModelCheckpoint``)."""

import math
import os
import re
import time
import warnings
import weakref
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch

from trainscale.callbacks.base import Callback
from trainscale.runtime.checkpoint_io import is_url

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer


class ModelCheckpoint(Callback):
    """Save full, resumable checkpoints and keep the best ones (Lightning's ``ModelCheckpoint``).

    It is the only thing that writes a fit's scheduled checkpoints. When the user gives none (and
    ``enable_checkpointing`` is on), the Trainer adds one from its own flags (:meth:`trainer_default`: epoch saves,
    ``checkpoint_every_n_steps`` saves, the newest ``keep_last`` kept). The Trainer asks every ``ModelCheckpoint`` at
    the end of each optimizer step and each epoch (:meth:`save_if_due`, called by name in
    ``Trainer._checkpoint_if_due``).

    Names: Lightning's (:meth:`format_checkpoint_name`): the template ``filename``, by default ``"{epoch}-{step}"``
    (``epoch=0-step=4.ckpt``: the epoch being trained, from 0, and the optimizer steps taken), + ``FILE_EXTENSION``
    (".ckpt"), for a one-file checkpoint and a sharded (DCP) directory alike, as Lightning's FSDP checkpoints.
    Written atomically, its SHA-256 inside the file (``runtime/checkpoint_io.py``), so the directory
    lists the checkpoints and nothing else. After each save ``<run dir>/checkpoints/last`` names it,
    so ``fit(ckpt_path="last")`` resumes from the newest save; with ``save_last``, ``<dirpath>/last.ckpt``
    (``CHECKPOINT_NAME_LAST`` + ``FILE_EXTENSION``, a template such as ``"{epoch}-last"`` too) is also a symbolic link
    to it (for ``load_from_checkpoint``, ``ckpt_path=".../last.ckpt"``), or, where there is nothing to link to
    (``save_top_k=0``; a fit that saved nothing writes it at its end, as Lightning), the checkpoint itself.

    With a monitor, a checkpoint is written only when its score enters the top ``save_top_k`` (Lightning's
    ``check_monitor_top_k``: fewer kept, or strictly better than the worst kept), so the newest save is always kept
    and "last" stays on it until the next save. One pruning rule: the ``save_top_k`` best by ``monitor`` (without a
    monitor: the newest) are kept; only files this callback wrote into its own ``dirpath`` during this run are ever
    deleted (never another run's, e.g. the checkpoints a run resumed into a new ``version_N`` started from, and never
    the checkpoint the fit resumed from, as Lightning). A run resumed in place (``fit(ckpt_path="last")`` continuing
    its directory) is the same run: the files its earlier processes kept, the one it resumed from included, are
    ranked by their scores as its own (each checkpoint's callback state already counts the checkpoint itself, as
    Lightning's ``best_k_models``); a run in another directory ranks by its own scores only.
    A non-finite monitored value ranks worst, as in Lightning: a NaN epoch never evicts a good checkpoint.
    A name that exists already (a template without ``{step}``, a second run in the same ``dirpath``) gets
    Lightning's version suffix ``-v1``, ``-v2``..., so no file of another run is ever overwritten; the name of a
    file of this run that the same save prunes is taken over (Lightning's rule: ``filename="model"`` with
    ``save_top_k=1`` keeps one ``model.ckpt``, replaced atomically). While a fit runs, rank zero holds an advisory
    lock on ``dirpath`` (``fcntl.flock`` on the directory itself): a second fit writing there at the same time is
    refused at its start.

    Args:
        dirpath: where to write (``~`` expanded, made absolute, as Lightning); default ``<run dir>/checkpoints``. The
            attribute ``dirpath`` is the directory in use once a fit has started (Lightning's, after its setup).
        filename: Lightning's template, e.g. ``"{epoch}-{val_loss:.2f}"`` → ``epoch=3-val_loss=0.12.ckpt``: fields
            are ``epoch`` (the epoch being trained, from 0, as Lightning), ``step`` (optimizer steps so far)
            and any metric in ``trainer.callback_metrics`` (0 when missing, as Lightning). None: the default name.
        monitor: metric name in ``trainer.callback_metrics`` (e.g. "val_loss"), or "epoch" or "step" (the epoch
            being trained and the optimizer steps taken, as Lightning's ``_monitor_candidates``); None: keep the
            newest.
        verbose: rank zero prints a line at each save (the score, the best, the path).
        save_last: True or "link": keep ``last.ckpt`` in ``dirpath`` pointing at the newest checkpoint. Both are a
            link here (Lightning's True writes a second copy; trainscale keeps the newest checkpoint anyway), but with
            ``save_top_k=0``, or at the end of a fit that saved nothing, ``last.ckpt`` is the checkpoint itself.
        save_top_k: the best checkpoints kept (``-1``: all; ``0``: none, and only ``last.ckpt`` is written, with
            ``save_last``). Without a monitor only -1, 0 or 1 (as Lightning: no value to rank more by; the Trainer's
            ``keep_last`` keeps the newest N).
        save_on_exception: when ``fit`` ends in an exception, save a checkpoint of the state at that moment
            (Lightning's; :meth:`on_exception`).
        save_weights_only: the checkpoints hold the weights and the loop's position, but no optimizer or scheduler
            state (Lightning's ``weights_only``): ``load_from_checkpoint`` reads them, ``fit(ckpt_path=...)`` cannot
            resume from them.
        mode: "min" or "max".
        auto_insert_metric_name: the template's ``{name}`` becomes ``name={name}`` (Lightning's default).
        every_n_train_steps: save every N optimizer steps (mid-epoch).
        train_time_interval: save after the first optimizer step that ends this much training time (a
            ``datetime.timedelta``) after the fit's start or the last such save; rank zero's clock decides.
        every_n_epochs: save at the end of every N-th epoch; default 1 when none of ``every_n_train_steps``,
            ``every_n_epochs`` and ``train_time_interval`` is given, else 0 (never at epoch ends). The three are
            exclusive, as in Lightning: for two schedules use two ``ModelCheckpoint``.
        save_on_train_epoch_end: False: the epoch saves happen at the end of each validation of ``fit`` (also a
            mid-epoch one, with ``val_check_interval``), as Lightning; a fit without validation saves at its epoch
            ends. True: at the end of each training epoch, after its validation. None (Lightning's default): at
            validation ends when ``val_check_interval`` is not 1.0 (several validations an epoch), else at epoch ends.
        enable_version_counter: False: a name that exists is replaced rather than versioned when this run wrote
            it; one this run did not write is never replaced (a ``ValueError``).

    Raises:
        ValueError: bad arguments (Lightning's ``MisconfigurationException`` cases: a ``mode`` other than "min"/"max",
            ``save_top_k`` below -1 or above 1 without ``monitor``, a negative ``every_n_*``, two of
            ``every_n_train_steps``, ``every_n_epochs``, ``train_time_interval`` together; and a ``filename`` of
            "last" or one that formats to a path with "/"); at a save after the fit's first validation, a
            ``monitor`` not among the metrics (before it, as Lightning, a warning, and the checkpoint ranks last: a
            fit without validation warns); at the start of ``fit``, a ``dirpath`` another running fit holds.
    """

    monitors_metrics = True  # its on_train_epoch_end after the module's (Lightning's monitoring callbacks)
    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"  # the save_last link's name (a template: "{epoch}-last")
    FILE_EXTENSION = ".ckpt"  # of every name this callback writes (a file, a sharded directory, the save_last link)
    STARTING_VERSION = 1

    def __init__(self, dirpath: Optional[str | Path] = None, filename: Optional[str] = None,
                 monitor: Optional[str] = None, verbose: bool = False,
                 save_last: Optional[Literal[True, False, "link"]] = None, save_top_k: int = 1,
                 save_on_exception: bool = False, save_weights_only: bool = False, mode: str = "min",
                 auto_insert_metric_name: bool = True,
                 every_n_train_steps: Optional[int] = None, train_time_interval: Optional[timedelta] = None,
                 every_n_epochs: Optional[int] = None, save_on_train_epoch_end: Optional[bool] = None,
                 enable_version_counter: bool = True) -> None:
        if every_n_train_steps is None and every_n_epochs is None and train_time_interval is None:
            every_n_epochs = 1  # Lightning's __init_triggers: an epoch save when no schedule is given
        _check_arguments(mode, save_top_k, monitor)
        _check_schedule(every_n_train_steps, every_n_epochs or 0, train_time_interval)
        _check_naming(filename, save_last)
        self.filename, self.save_last, self.auto_insert_metric_name = filename, save_last, auto_insert_metric_name
        # the dirpath given (None: the run's own directory), in the state and its rules; ``dirpath``: Lightning's
        # attribute, the directory the checkpoints go to once a fit has set it (os.listdir(callback.dirpath))
        self._given_dirpath = (None if dirpath is None else str(dirpath) if is_url(dirpath)  # refused at setup
                               else os.path.realpath(os.path.expanduser(dirpath)))
        self.dirpath = self._given_dirpath
        self.monitor, self.mode, self.save_top_k, self.verbose = monitor, mode, save_top_k, verbose
        self.save_weights_only, self.save_on_train_epoch_end = save_weights_only, save_on_train_epoch_end
        self.enable_version_counter, self.train_time_interval = enable_version_counter, train_time_interval
        self.save_on_exception = save_on_exception
        self.every_n_train_steps = every_n_train_steps or None
        self.every_n_epochs = every_n_epochs or 0
        # Lightning's public record of the ranking (kept in step with ``_kept`` after each save; state_dict's keys)
        self.best_k_models: dict[str, torch.Tensor] = {}  # path -> score, with a monitor
        self.kth_best_model_path = ""
        self.kth_value = torch.tensor(math.inf if mode == "min" else -math.inf)
        self.best_model_score: torch.Tensor | None = None
        self.best_model_path = ""  # the best checkpoint kept (the newest without a monitor)
        self.last_model_path = ""  # the save_last link, once made
        self.current_score: torch.Tensor | None = None  # the monitored value of the latest save
        self._kept: dict[str, float] = {}  # path -> rank (lower is better: the score, negated for "max")
        self._directory: Path | None = None  # this fit's resolved dirpath
        self._written: list[str] = []  # this run's files in _directory, oldest first
        self._newest: str | None = None  # the last checkpoint this callback wrote (kept, as "last" names it)
        self._warned_missing = False
        self._lock: int | None = None  # rank zero's descriptor of dirpath, flock'ed during a fit
        self._last_time_save = 0.0  # time.monotonic() of the fit's start or the last train_time_interval save
        self._saved_step = -1  # global_step of the latest save
        self._deferred = False  # a step save waiting for the next validation's end (_defers)
        self._links: list[str] = []  # the save_last link this callback made (an earlier "{epoch}-last" goes)

    @property
    def state_key(self) -> str:
        """Lightning's key: the class name and ``monitor``, ``mode``, ``every_n_train_steps`` (0 for none),
        ``every_n_epochs`` and ``train_time_interval``."""
        return self._generate_state_key(monitor=self.monitor, mode=self.mode,
                                        every_n_train_steps=self.every_n_train_steps or 0,
                                        every_n_epochs=self.every_n_epochs,
                                        train_time_interval=self.train_time_interval)

    @classmethod
    def trainer_default(cls, every_n_epochs: int, every_n_train_steps: Optional[int],
                        keep_last: Optional[int]) -> "ModelCheckpoint":
        """The Trainer's own callback, from its flags ``enable_checkpointing`` (``every_n_epochs`` 1, else 0),
        ``checkpoint_every_n_steps`` and ``keep_last`` (None: keep all): epoch saves and step saves together (a step
        that ends an epoch saves once, at the epoch end) and the newest ``keep_last`` kept without a monitor, two
        things the arguments refuse as Lightning's do; the rules of one callback serve both."""
        callback = cls(save_top_k=-1)
        callback.every_n_epochs, callback.every_n_train_steps = every_n_epochs, every_n_train_steps
        callback.save_top_k = -1 if keep_last is None else keep_last
        return callback

    def setup_directory(self, trainer: "Trainer") -> None:
        """At the start of a fit, after its run directory is chosen (every rank): resolve ``dirpath`` and lock it
        for this fit (rank zero).

        Raises:
            ValueError: another running fit holds ``dirpath``.
        """
        given = self._given_dirpath
        self._check_local()
        self._directory = Path(trainer.run_dir) / "checkpoints" if given is None else Path(given)
        self.dirpath = str(self._directory)
        self._saved_step = -1  # no save yet in this fit
        self._deferred = False  # a step save waiting for the next validation's end (_defers)
        self._adopt_earlier_files(trainer)
        self._last_time_save = time.monotonic()
        if given is None:
            return
        rt, refusal = trainer.runtime, None
        if rt.is_rank_zero:
            self.release_directory()  # a second fit of this callback: its own lock again
            self._directory.mkdir(parents=True, exist_ok=True)
            try:
                self._lock = _lock_directory(self._directory)
            except ValueError as err:
                refusal = str(err)
        refusal = rt.broadcast_object(refusal)  # every rank raises together, none waits at a collective
        if refusal:
            raise ValueError(refusal)

    def setup(self, trainer: "Trainer", pl_module: Any, stage: str) -> None:
        """Lightning's hook: a ``dirpath`` that is a URL is refused here (:meth:`_check_local`). Under
        ``fast_dev_run``, which writes nothing (no run directory, no :meth:`setup_directory`): ``dirpath`` is named as
        Lightning names it there (the one given, else ``<default_root_dir>/checkpoints``), and not made."""
        self._check_local()
        if not trainer.config.writes_files and self._given_dirpath is None:
            self.dirpath = str(Path(trainer.config.default_root_dir) / "checkpoints")

    def _check_local(self) -> None:
        """Raise ValueError for a ``dirpath`` that is a URL (``s3://``, ``memory://``): trainscale writes, links and
        locks checkpoints on local file paths only (Lightning refuses such a path with ``save_last='link'``, in its
        words, and writes the rest through fsspec)."""
        if self._given_dirpath is None or not is_url(self._given_dirpath):
            return
        said = (f"`ModelCheckpoint(save_last='link')` is only supported for local file paths, got "
                f"`dirpath={self._given_dirpath}`" if self.save_last == "link" else
                f"ModelCheckpoint(dirpath={self._given_dirpath!r}) is a URL")
        raise ValueError(f"{said}: trainscale writes checkpoints to local file paths only; give a local directory "
                         "(a mounted bucket, for instance) and copy the checkpoints from it")

    def release_directory(self) -> None:
        """Drop the lock on ``dirpath`` (the Trainer calls it when a fit ends or fails; the process's end drops it too)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _adopt_earlier_files(self, trainer: "Trainer") -> None:
        """Resumed in place: the kept files of the run's earlier processes are this run's too, and so is the one it
        resumed from (e.g. a checkpoint saved on a signal); another run's directory is never this one. One this
        callback did not rank (a save on a signal, another configuration) ranks by its step (no monitor), else last."""
        resumed_from = [str(trainer.ckpt_path)] if trainer.ckpt_path is not None else []
        earlier = dict.fromkeys([*self._kept, *([self._newest] if self._newest else []), *resumed_from])
        self._written = [p for p in earlier if Path(p).parent.resolve() == self._directory.resolve()]
        # another directory's ranking is not this one's (Lightning reloads best_k_models only for the same dirpath):
        # a run resumed from another run's checkpoint saves by its own scores
        self._kept = {p: rank for p, rank in self._kept.items() if p in self._written}
        for path in resumed_from:
            if path in self._written and path not in self._kept:
                self._kept[path] = -float(trainer.global_step) if self.monitor is None else math.inf

    def format_checkpoint_name(self, metrics: dict, filename: str | None = None, ver: int | None = None,
                               prefix: str | None = None) -> str:
        """Lightning's ``ModelCheckpoint.format_checkpoint_name``: the template (``filename``, else this callback's,
        else ``"{epoch}-{step}"``) formatted with ``metrics``, ``prefix`` + "-" before it, ``-v<ver>`` after it,
        + ``FILE_EXTENSION``, under ``dirpath`` when one was given: ``"{epoch}-{val_loss:.2f}"`` with
        ``{"epoch": 2, "val_loss": 0.123456}`` → ``<dirpath>/epoch=2-val_loss=0.12.ckpt``; a missing field
        formats 0.

        Raises:
            ValueError: a name with "/" (a metric named "a/b": pass ``auto_insert_metric_name=False`` and a template
                without it).
        """
        template = filename or self.filename or f"{{epoch}}{self.CHECKPOINT_JOIN_CHAR}{{step}}"
        metrics = dict(metrics)
        # longest first, so that "{epoch}" does not replace part of "{epoch_test}" (as Lightning)
        for group in sorted(re.findall(r"(\{.*?)[:\}]", template), key=len, reverse=True):
            name = group[1:]
            if self.auto_insert_metric_name:
                template = template.replace(group, f"{name}{self.CHECKPOINT_EQUALS_CHAR}{{{name}")
            template = template.replace(group, f"{{0[{name}]")  # keys with dots, as Lightning
            metrics.setdefault(name, 0)
        name = self.CHECKPOINT_JOIN_CHAR.join([*([prefix] if prefix is not None else []), template.format(metrics)])
        name += f"{self.CHECKPOINT_JOIN_CHAR}v{ver}" if ver is not None else ""
        if "/" in name:
            raise ValueError(f"ModelCheckpoint(filename={self.filename!r}) formats to {name!r}, a path: metric names "
                             "with '/' make directories; pass auto_insert_metric_name=False and a template without '/'")
        return os.path.join(self.dirpath, name + self.FILE_EXTENSION) if self.dirpath else name + self.FILE_EXTENSION

    def _free_name(self, trainer: "Trainer", template: str, metrics: dict, reusable) -> str:
        """The file name of ``template`` (:meth:`format_checkpoint_name`), or its first version (``-v1``...) that does
        not exist in the directory or is ``reusable`` (a set of paths, or a predicate: this run's files the save
        replaces); decided on rank zero, the same on every rank.

        Raises:
            ValueError: with ``enable_version_counter=False``, the name is a file this run did not write.
        """
        chosen, refusal = os.path.basename(self.format_checkpoint_name(metrics, template)), None
        if trainer.runtime.is_rank_zero:
            ver = self.STARTING_VERSION
            free = reusable if callable(reusable) else reusable.__contains__
            while _exists(self._directory / chosen) and not free(str(self._directory / chosen)):
                if not self.enable_version_counter:
                    if str(self._directory / chosen) in self._written:
                        break  # this run's own file: replaced, as Lightning does without the counter
                    refusal = (f"ModelCheckpoint(enable_version_counter=False) would replace "
                               f"{str(self._directory / chosen)!r}, which this run did not write; no file of "
                               "another run is ever overwritten: keep the version counter, or give this run its own "
                               "dirpath")
                    break
                chosen, ver = os.path.basename(self.format_checkpoint_name(metrics, template, ver=ver)), ver + 1
        chosen, refusal = trainer.runtime.broadcast_object((chosen, refusal))
        if refusal:
            raise ValueError(refusal)
        return chosen

    def _metrics(self, trainer: "Trainer") -> dict:
        """The values a template formats and ``monitor`` reads (Lightning's ``_monitor_candidates``):
        ``callback_metrics``, with ``epoch`` (``trainer.current_epoch``) and ``step`` (``trainer.global_step``), names
        a module cannot log here (``self.log("epoch", ...)`` is refused)."""
        return {**trainer.callback_metrics, "epoch": trainer.current_epoch, "step": trainer.global_step}

    def _file_name(self, trainer: "Trainer", reusable: set[str]) -> str:
        """This save's file name: the template's, versioned past an existing file (a sharded directory's name is
        never taken over: it is renamed into place, which needs a free name)."""
        sharded = trainer.runtime.strategy.sharded_checkpoints
        return self._free_name(trainer, self.filename, self._metrics(trainer), set() if sharded else reusable)

    def save_if_due(self, trainer: "Trainer", epoch_end: bool, ends_epoch: bool) -> None:
        """Save when this step or epoch end is one of this callback's (every rank calls it at the same point).
        ``ends_epoch``: this optimizer step is the last of its epoch (an epoch-end save follows it)."""
        if epoch_end:
            due = self._epoch_save_due(trainer) and not self._saves_at_validation(trainer)
        else:  # the epoch's rules only where a step save would also end an epoch
            n = self.every_n_train_steps
            due = n is not None and trainer.reached_multiple(n) and not (ends_epoch and self._epoch_save_due(trainer))
            if self.train_time_interval is not None:  # off by default: no clock read (or broadcast) per step
                due = self._time_due(trainer) or due
            if due and self._defers(trainer, ends_epoch):  # saved at the next validation's end instead
                self._deferred, due = True, False
        if due:
            self._save(trainer, epoch_end)

    def _defers(self, trainer: "Trainer", ends_epoch: bool) -> bool:
        """Whether a step save (``every_n_train_steps``, ``train_time_interval``) waits for the next validation's
        end, to rank by a fresh value (Lightning 2.6's ``_defer_save_until_validation``): the monitored value is not
        logged yet, or this step ends an epoch whose validation follows, with the saves at validation ends (its value
        is the last validation's). Only in a fit that validates: without validation the step save is made (ranked
        last while its value is missing, with a warning)."""
        if self.monitor is None or not trainer.enable_validation:  # its loaders may be asked for later (lazily)
            return False
        if self.monitor not in self._metrics(trainer):
            return True
        return ends_epoch and self._saves_at_validation(trainer) and trainer.config.validates_in(trainer.current_epoch)

    def _epoch_due(self, trainer: "Trainer") -> bool:
        return bool(self.every_n_epochs) and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def _epoch_save_due(self, trainer: "Trainer") -> bool:
        """This epoch's end saves by ``every_n_epochs``, unless it ranks by a monitored value and the epoch is one
        ``check_val_every_n_epoch`` skips: no fresh value to rank by (Lightning saves at validation ends then)."""
        if self.monitor is not None and not trainer.config.validates_in(trainer.current_epoch):
            return False
        return self._epoch_due(trainer)

    def _saves_at_validation(self, trainer: "Trainer") -> bool:
        """Whether the epoch saves happen at validation ends: in a fit that validates, with
        ``save_on_train_epoch_end=False``, or by default when it validates more often than once an epoch
        (``val_check_interval`` other than 1.0: Lightning's ``_should_save_on_train_epoch_end``)."""
        if self.save_on_train_epoch_end is True or not any(trainer.num_val_batches):
            return False
        return self.save_on_train_epoch_end is False or trainer.config.val_check_interval not in (None, 1.0)

    def _time_due(self, trainer: "Trainer") -> bool:
        """``train_time_interval`` has passed since the fit's start or the last such save (rank zero's clock, the same
        answer on every rank); called only with ``train_time_interval`` set."""
        now = time.monotonic()
        due = now - self._last_time_save >= self.train_time_interval.total_seconds()
        if trainer.runtime.world_size > 1:
            due = bool(trainer.runtime.broadcast_object(due))
        if due:
            self._last_time_save = now
        return due

    def on_validation_end(self, trainer: "Trainer", module: Any) -> None:
        """A step save deferred until this validation (:meth:`_defers`), on its fresh values; else, with
        ``save_on_train_epoch_end=False``, the epoch save, after each validation of a fit (Lightning's)."""
        if self._deferred and self._directory is not None and trainer.fitting and not trainer.sanity_checking:
            self._deferred = False
            self._save(trainer, epoch_end=False)
            return
        if (self._directory is not None and trainer.fitting and not trainer.sanity_checking
                and self._saves_at_validation(trainer) and self._epoch_due(trainer)
                and self._saved_step != trainer.global_step):
            self._save(trainer, epoch_end=True)

    def on_exception(self, trainer: "Trainer", module: Any, exception: BaseException) -> None:
        """With ``save_on_exception``: when ``fit`` ends in an exception, a checkpoint of the state at that moment
        (Lightning's ``on_exception``; not when ``validate``/``test``/``predict`` raise, where the fit's run directory
        is no longer this Trainer's), named by the template (``epoch=E-step=S.ckpt`` by default), which "last" and
        the save_last link then name, so ``fit(ckpt_path="last")`` resumes from it. Not ranked, so no later save
        prunes it. Skipped where Lightning skips it (``fast_dev_run``, the sanity check, no step taken, a save of
        this callback at this step) and where a checkpoint of this step was just written (the one a signal writes
        before ``Preempted``, another ``ModelCheckpoint``'s): "last" names it already.

        Unlike Lightning, which writes over a file of that name (with ``filename="model"``, the kept best one), it
        takes the next free version (``model-v1.ckpt``): no checkpoint is ever overwritten. Every rank must get here
        (an error every rank meets, a KeyboardInterrupt under torchrun): with several ranks the save is a
        collective, and one that cannot finish (a rank that died: a ``CollectiveTimeout``) is a warning; ``fit``
        raises the original exception either way."""
        if (not self.save_on_exception or self._directory is None or not trainer.config.writes_files
                or not trainer.fitting or trainer.sanity_checking or trainer.global_step in (0, self._saved_step)
                or trainer.checkpoints.saved_step == trainer.global_step):
            return
        try:
            name = self._free_name(trainer, self.filename, self._metrics(trainer), set())
            last = self._last_name(trainer) if self.save_last else None
            trainer.write_checkpoint(self._directory, name=name, weights_only=self.save_weights_only)
            self._notify_loggers(trainer)
            self._saved_step = trainer.global_step
            trainer.checkpoints.discard([Path(p) for p in self._link_last(trainer, str(self._directory / name), last)])
        except Exception as err:
            warnings.warn(f"ModelCheckpoint(save_on_exception=True) could not save after {type(exception).__name__}: "
                          f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=2)
            return
        trainer.runtime.print(f"An {type(exception).__name__} was raised with message: {exception}; saved checkpoint "
                              f"to {self._directory / name}")

    def _score(self, trainer: "Trainer", epoch_end: bool) -> float:
        """This save's rank (:meth:`_own_score`), rank zero's on every rank: a value logged per step differs by rank,
        and the ranks must agree on whether to write (every rank writes, or none; Lightning reduces that decision)
        and on the ranking (one ``best_model_path`` for ``ckpt_path="best"``)."""
        score = self._own_score(trainer, epoch_end)
        if self.monitor is not None and trainer.runtime.world_size > 1:
            score = float(trainer.runtime.broadcast_object(score))
        return score

    def _own_score(self, trainer: "Trainer", epoch_end: bool) -> float:
        """This rank's rank of this save: lower is better (the monitored value, negated for "max"; a non-finite one
        ranks last; without a monitor, newer is better)."""
        if self.monitor is None:
            return -float(trainer.global_step)  # newest first
        metrics = self._metrics(trainer)
        # before this fit's first validation, as Lightning (its val loop's ``_has_run``): a warning; it ranks last
        if self.monitor not in metrics and not trainer.validated_at:
            if not self._warned_missing:
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

    def _value(self, rank: float) -> float:
        """The monitored value of a rank (a non-finite one: inf for "min", -inf for "max", as Lightning's)."""
        return rank if self.mode == "min" else -rank

    def _save(self, trainer: "Trainer", epoch_end: bool) -> None:
        if self.save_top_k == 0:  # Lightning: save_top_k=0 saves nothing but "last", when asked
            if self.save_last:
                self._save_last_file(trainer)
            return
        score = self._score(trainer, epoch_end)
        if not self._enters_top_k(trainer, score):  # Lightning's check_monitor_top_k: no file, "last" stays put
            return
        ranked = sorted([*self._kept.items(), (None, score)], key=lambda kv: kv[1])  # ties: the older first
        top = {p for p, _ in (ranked[:self.save_top_k] if self.save_top_k >= 0 else ranked)}
        name = self._file_name(trainer, {p for p in self._written if p not in top})
        path = str(self._directory / name)
        # ranked before the write (Lightning's order), so that the state this checkpoint holds counts it: a run
        # resumed from it in place knows it as its own, with its score
        self._rank(path, score, trainer.global_step)
        last = self._last_name(trainer) if self.save_last else None
        trainer.write_checkpoint(self._directory, background=True, name=name, weights_only=self.save_weights_only)
        self._notify_loggers(trainer)
        if self.verbose:
            self._say_saved(trainer, path)
        keep = set(self._kept) | {path}  # the newest is "last"
        stale = [p for p in self._written if p not in keep]
        self._written = [p for p in self._written if p in keep]
        trainer.checkpoints.discard([Path(p) for p in self._removable(trainer, stale)
                                     + self._link_last(trainer, path, last)])

    def _enters_top_k(self, trainer: "Trainer", score: float) -> bool:
        """Whether a checkpoint of rank ``score`` is saved: always without a monitor or with ``save_top_k=-1``, else
        while fewer than ``save_top_k`` are kept or when it ranks strictly better than the worst kept (Lightning's
        ``check_monitor_top_k``; a non-finite value ranks worst, so it enters only an unfilled top k). With
        ``verbose``, a miss is said (Lightning's words)."""
        if self.monitor is None or self.save_top_k < 0 or len(self._kept) < self.save_top_k:
            return True
        if score < max(self._kept.values()):
            return True
        if self.verbose:
            trainer.runtime.print(f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: "
                                  f"{self.monitor!r} was not in top {self.save_top_k}")
        return False

    @staticmethod
    def _removable(trainer: "Trainer", paths: list[str]) -> list[str]:
        """``paths`` less the checkpoint this fit resumed from, which is never deleted (Lightning's
        ``_should_remove_checkpoint``), even when a better one pushes it out of the top k."""
        if trainer.ckpt_path is None:
            return paths
        resumed = {os.path.abspath(trainer.ckpt_path), os.path.realpath(trainer.ckpt_path)}  # a link: its target too
        return [p for p in paths if os.path.abspath(p) not in resumed]

    def _save_last_file(self, trainer: "Trainer") -> None:
        """With ``save_last`` and nothing to link to (``save_top_k=0``, or a fit that ends without a save): the
        checkpoint itself under the save_last name (``last.ckpt``, a file, as Lightning's), replacing this run's
        previous one atomically (a sharded directory takes a free name: it is renamed into place)."""
        if trainer.runtime.strategy.sharded_checkpoints:
            name = self._free_name(trainer, self.CHECKPOINT_NAME_LAST, self._metrics(trainer), set())
            self.last_model_path = str(self._directory / name)
        else:
            name = self._last_name(trainer)
        path = self.last_model_path
        self._written = [p for p in self._written if p != path] + [path]
        self._newest, self._saved_step = path, trainer.global_step
        trainer.write_checkpoint(self._directory, background=True, name=name, weights_only=self.save_weights_only)
        self._notify_loggers(trainer)
        stale = [p for p in self._written if p != path and p not in self._kept]
        self._written = [p for p in self._written if p not in stale]
        old_links, self._links = [p for p in self._links if p != path], []
        trainer.checkpoints.discard([Path(p) for p in self._removable(trainer, stale) + old_links])

    def on_train_end(self, trainer: "Trainer", module: Any) -> None:
        """With ``save_last``: a fit that saved no checkpoint writes ``last.ckpt`` at its end (Lightning's), e.g.
        with ``save_top_k=0`` and no scheduled save, or ``every_n_epochs`` above the epochs trained."""
        if (self.save_last and self._directory is not None and trainer.config.writes_files
                and self._saved_step < 0):
            self._save_last_file(trainer)
            trainer.checkpoints.wait()  # published before the fit's end, as the saves before it

    def _link_last(self, trainer: "Trainer", path: str, last: str | None) -> list[str]:
        """With ``save_last``: the link ``last`` (a name in the directory) to checkpoint ``path``, made once the
        checkpoint is on disk. Returns the links it replaces (an earlier ``"{epoch}-last"``), to discard after it."""
        if last is None:
            return []
        trainer.checkpoints.link(Path(path), self._directory / last)
        stale = [p for p in self._links if p != self.last_model_path]
        self._links = [self.last_model_path]
        return stale

    def _rank(self, path: str, score: float, step: int) -> None:
        """``path`` (the newest) into the ranking with ``score``; the top ``save_top_k`` kept; Lightning's records."""
        self._written = [p for p in self._written if p != path] + [path]
        self._newest, self._saved_step = path, step
        self._kept.pop(path, None)
        self._kept[path] = score
        if self.save_top_k >= 0:
            for dropped in sorted(self._kept, key=self._kept.get)[self.save_top_k:]:  # ties: the older stays
                del self._kept[dropped]
        self.current_score = torch.tensor(self._value(score)) if self.monitor is not None else None
        self._publish_ranking()

    def _notify_loggers(self, trainer: "Trainer") -> None:
        """After each checkpoint it writes, on rank zero, each logger's ``after_save_checkpoint(callback)`` where
        the logger defines it (Lightning's ``Logger`` hook, given a ``weakref.proxy`` of this callback, as
        Lightning's ``ModelCheckpoint._save_checkpoint`` does: a logger that uploads checkpoints reads
        ``last_model_path``, ``best_k_models`` there). With ``checkpoint_async`` the write may still be going on."""
        if not trainer.runtime.is_rank_zero:
            return
        for logger in trainer.loggers:
            hook = getattr(logger, "after_save_checkpoint", None)
            if callable(hook):
                hook(weakref.proxy(self))

    def _say_saved(self, trainer: "Trainer", path: str) -> None:
        scores = (f" ({self.monitor} {float(self.current_score):.5g}, best {float(self.best_model_score):.5g})"
                  if self.best_model_score is not None else "")
        trainer.runtime.print(f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: saving model to "
                              f"{path}{scores}")

    def _last_name(self, trainer: "Trainer") -> str:
        """The save_last link's name: ``CHECKPOINT_NAME_LAST`` formatted (``"{epoch}-last"``) + ``FILE_EXTENSION``,
        versioned past a file that is not this callback's link (another run's ``last.ckpt``). Its path becomes
        ``last_model_path`` now, before the checkpoint is written, so that the state it holds names it (Lightning's
        order)."""
        name = self._free_name(trainer, self.CHECKPOINT_NAME_LAST, self._metrics(trainer), self._is_own_link)
        self.last_model_path = str(self._directory / name)
        return name

    def _is_own_link(self, path: str) -> bool:
        """Whether ``path`` is a save_last link of this run: one this callback made, any in the run's own directory
        (no ``dirpath``), or one to a checkpoint of this run (a run resumed in place with a new callback)."""
        if self._given_dirpath is None or path in self._links or path == self.last_model_path:
            return True
        own = {str(Path(p).resolve()) for p in self._written}
        return os.path.islink(path) and str(Path(path).resolve()) in own

    def _publish_ranking(self) -> None:
        """Lightning's attributes from the ranking: ``best_model_path`` (the newest without a monitor), and with a
        monitor ``best_k_models`` (path -> score tensor), ``best_model_score``, ``kth_best_model_path``,
        ``kth_value``."""
        ranked = sorted(self._kept, key=self._kept.get)
        self.best_model_path = ranked[0] if ranked else ""
        if self.monitor is None:
            return
        self.best_k_models = {p: torch.tensor(self._value(self._kept[p])) for p in ranked}
        self.best_model_score = self.best_k_models[ranked[0]] if ranked else None
        self.kth_best_model_path = ranked[-1] if ranked else ""
        if ranked:
            self.kth_value = self.best_k_models[ranked[-1]]

    def to_yaml(self, filepath: str | Path | None = None) -> None:
        """Write ``best_k_models`` (path: score) as YAML to ``filepath`` (default ``<dirpath>/best_k_models.yaml``),
        as Lightning's."""
        import yaml

        best_k = {path: float(score) for path, score in self.best_k_models.items()}
        filepath = Path(filepath) if filepath is not None else Path(self._directory or self.dirpath) / "best_k_models.yaml"
        filepath.write_text(yaml.dump(best_k))

    def state_dict(self) -> dict:
        """Lightning's keys (``monitor``, ``best_model_score``, ``best_model_path``, ``current_score``, ``dirpath``,
        ``best_k_models``, ``kth_best_model_path``, ``kth_value``, ``last_model_path``) and trainscale's ranking
        (``best_k``: path -> rank, also without a monitor; ``newest``)."""
        return {"monitor": self.monitor, "best_model_score": self.best_model_score,
                "best_model_path": self.best_model_path, "current_score": self.current_score,
                "dirpath": self._given_dirpath,
                "best_k_models": self.best_k_models, "kth_best_model_path": self.kth_best_model_path,
                "kth_value": self.kth_value, "last_model_path": self.last_model_path,
                "best_k": dict(self._kept), "newest": self._newest}

    def load_state_dict(self, state: dict) -> None:
        """Lightning's rule: with the same ``dirpath`` everything is restored; with another one (a warning) only
        ``best_model_path``. A checkpoint written before Lightning's keys were kept holds ``best_k`` alone."""
        if "best_model_path" not in state:  # trainscale's former state: the ranking alone
            self._kept, self._newest = dict(state["best_k"]), state.get("newest")
            self._publish_ranking()
            return
        saved_dir = state.get("dirpath", self._given_dirpath)
        if saved_dir == self._given_dirpath:
            self.best_model_score = state["best_model_score"]
            self.kth_best_model_path = state.get("kth_best_model_path", self.kth_best_model_path)
            self.kth_value = state.get("kth_value", self.kth_value)
            self.best_k_models = state.get("best_k_models", self.best_k_models)
            self.last_model_path = state.get("last_model_path", self.last_model_path)
            self._links = [self.last_model_path] if self.last_model_path else []
            self._newest = state.get("newest")
            if "best_k" in state:
                self._kept = dict(state["best_k"])
            else:  # a Lightning-shaped state: its scores are the ranking
                self._kept = {p: self._value(float(v)) for p, v in self.best_k_models.items()}
        else:
            warnings.warn(f"The dirpath has changed from {saved_dir!r} to {self._given_dirpath!r}, therefore "
                          "`best_model_score`, `kth_best_model_path`, `kth_value`, `last_model_path` and "
                          "`best_k_models` won't be reloaded. Only `best_model_path` will be reloaded.", UserWarning,
                          stacklevel=2)
        self.best_model_path = state["best_model_path"]


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _lock_directory(directory: Path) -> int | None:
    """Rank zero's advisory lock on ``directory`` (``fcntl.flock`` on the directory's own descriptor, so no file is
    added there), or None where the file system cannot lock a directory (some network file systems).

    Raises:
        ValueError: another process holds it (a fit writing its checkpoints there now).
    """
    import fcntl

    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"ModelCheckpoint(dirpath={str(directory)!r}) is in use by another fit running now (it holds "
                         "a lock on that directory); two fits writing and pruning there together would take each "
                         "other's names: give this run its own dirpath") from None
    except OSError:
        os.close(fd)
        return None
    return fd


def _check_arguments(mode: str, save_top_k: int, monitor: Optional[str]) -> None:
    """Raise ValueError, with Lightning's words (``ModelCheckpoint.__validate_init_configuration``) and the fix, for a
    ``mode`` other than "min"/"max" and a ``save_top_k`` below -1, or above 1 without a ``monitor`` (nothing to rank
    by)."""
    if mode not in ("min", "max"):
        raise ValueError(f"`mode` can be 'min' or 'max' but got {mode}; choose one of the two")
    if isinstance(save_top_k, bool) or not isinstance(save_top_k, int) or save_top_k < -1:
        raise ValueError(f"Invalid value for save_top_k={save_top_k!r}. Must be >= -1: an int >= 0, or -1 to keep "
                         "every checkpoint")
    if monitor is None and save_top_k not in (-1, 0, 1):
        raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) is not a valid configuration. No "
                         "quantity for top_k to track: pass monitor='<a logged metric>' to keep the best "
                         f"{save_top_k}, or save_top_k=-1 (keep all) or 1 (keep the newest); Trainer(keep_last="
                         f"{save_top_k}) keeps the newest {save_top_k}")


def _check_schedule(every_n_train_steps: Optional[int], every_n_epochs: int,
                    train_time_interval: Optional[timedelta]) -> None:
    """Raise ValueError, with Lightning's words and the fix, for an ``every_n_*`` below 0, a ``train_time_interval``
    that is no ``timedelta``, and more than one of the three schedules (``every_n_epochs`` after its default)."""
    for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"Invalid value for {name}={value!r}. Must be >= 0 (an int, or None)")
    if train_time_interval is not None and not isinstance(train_time_interval, timedelta):
        raise ValueError(f"train_time_interval={train_time_interval!r}; pass a datetime.timedelta "
                         "(e.g. timedelta(minutes=30)) or None")
    if sum([(every_n_train_steps or 0) >= 1, every_n_epochs >= 1, train_time_interval is not None]) > 1:
        raise ValueError(f"Combination of parameters every_n_train_steps={every_n_train_steps or 0}, every_n_epochs="
                         f"{every_n_epochs} and train_time_interval={train_time_interval} should be mutually exclusive:"
                         " give one of them (0 or None for the others), and a second ModelCheckpoint for a second "
                         "schedule")


def _check_naming(filename: str | None, save_last: bool | str | None) -> None:
    """Raise ValueError for a ``save_last`` other than None/False/True/"link", or a ``filename`` that is not a
    non-empty template or is "last" (the name of the link to the newest checkpoint)."""
    if save_last not in (None, False, True, "link"):
        raise ValueError(f"save_last={save_last!r}; choose True, 'link', False or None")
    if filename is not None and (not isinstance(filename, str) or not filename or filename in ("last", "last.ckpt")):
        raise ValueError(f"filename={filename!r}: give a template such as '{{epoch}}-{{val_loss:.2f}}' (not "
                         "'last', the name of the link to the newest checkpoint), or None for the default name")
