"""The Trainer's own flags, validated once into a frozen value (the runtime's flags go to ``Runtime``).

``resolve_trainer_config(**flags)`` is pure logic: every rule is unit-tested, and a bad value raises
``ValueError`` naming the fix in ``Trainer.__init__``, on every rank, before any process group exists
(the same pattern as ``trainscale.runtime.connector.resolve``).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from trainscale.callbacks import ModelCheckpoint
from trainscale.utilities.warnings import PossibleUserWarning
from trainscale.runtime.checkpoint_io import refuse_url
from trainscale.runtime.flags import (FlagTypeError, check_flags, check_int, check_number, flag, make_flags,
                                     parse_duration)

_log = logging.getLogger(__name__)  # Lightning's notes at INFO (say_one_batch_limits)

_LIGHTNING_MAX_EPOCHS = 1000  # Lightning's max_epochs when none is set (loops/utilities.py, _parse_loop_limits)


# The rules of single flags that are more than a least value or a list of choices (see ``flag``).
def _seed(name: str, value) -> None:
    if value is None:  # the seed of seed_everything(), else 0 (checkpointing.rng.fit_seed)
        return
    check_int(name, value, 0)
    if value >= 2**32:
        raise ValueError(f"{name}={value} must be < 2**32 (numpy's limit)")


def _accumulate(name: str, value) -> None:
    """An int >= 1. A dict (Lightning 1.x's ``{epoch: factor}``, which Lightning 2 no longer takes here) names the
    callback that takes it."""
    if isinstance(value, dict):
        raise ValueError(f"{name}={value!r}: a schedule is the GradientAccumulationScheduler callback's, as in "
                         f"Lightning 2: Trainer(callbacks=[GradientAccumulationScheduler(scheduling={value!r})]) "
                         "(from trainscale.callbacks)")
    check_int(name, value, 1)


# What 0 turns off, for each limit (Lightning's meaning of ``limit_*_batches=0``)
_ZERO_TURNS_OFF = {"limit_train_batches": "training", "limit_val_batches": "validation",
                   "limit_test_batches": "testing", "limit_predict_batches": "prediction"}


def _limit(name: str, value) -> None:
    """None, an int >= 0 (a count) or a float in [0, 1] (a fraction), as Lightning's ``limit_*_batches``; 0 or 0.0
    turns the stage off (``limit_val_batches=0``: no validation; ``limit_train_batches=0``: no training;
    ``limit_test_batches=0``/``limit_predict_batches=0``: ``test``/``predict`` run their setup and teardown hooks
    and nothing between)."""
    count = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    fraction = isinstance(value, float) and 0.0 <= value <= 1.0
    if not (value is None or count or fraction):
        raise ValueError(f"You have passed invalid value {value} for {name}, it has to be in [0.0, 1.0] or an int. "
                         f"{name}={value!r} must be an int >= 0 (batches per epoch), a float in [0, 1] (a fraction "
                         f"of them) or None (all); 0 turns {_ZERO_TURNS_OFF[name]} off")


def _clip_val(name: str, value) -> None:
    """None or a finite number >= 1e-12; another type is a ``TypeError`` as in Lightning (``FlagTypeError``: also
    the ``ValueError`` of trainscale's other flags)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise FlagTypeError(f"`{name}` should be an int or a float. Got {value!r}: pass a number such as "
                            f"{name}=1.0 (the largest gradient norm), or None")
    check_number(name, value, 1e-12, optional=True)


def _clip_algorithm(name: str, value) -> None:
    if value not in ("norm", "value"):  # Lightning's words, then the choices
        raise ValueError(f"`{name}` {value} is invalid. Allowed algorithms: ['norm', 'value']; "
                         f"{name}={value!r}; choose 'norm' or 'value'")


def _every_n_epoch(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):  # Lightning's words first
        raise ValueError(f"`{name}` should be an integer, found {value!r}: {name} must be an int >= 1 (validate "
                         "in every N-th epoch) or None")
    check_int(name, value, 1, optional=True)


def _fast_dev_run(name: str, fast) -> None:
    if not isinstance(fast, bool) and (not isinstance(fast, int) or fast < 0):
        raise ValueError(f"{name}={fast!r} is not a valid configuration. It should be >= 0. {name} must be True, "
                         "False or an int >= 0 (batches to run)")


def _reload_every(name: str, every) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:  # Lightning's words first
        raise ValueError(f"`{name}` should be an int >= 0, got {every}. {name}={every!r}: 0 builds the loaders once, "
                         "N > 0 asks the data hooks for new ones every N epochs")


def _overfit_batches(name: str, overfit) -> None:
    if isinstance(overfit, bool) or not isinstance(overfit, (int, float)) or not 0 <= overfit <= (
            math.inf if isinstance(overfit, int) else 1.0):
        raise ValueError(f"You have passed invalid value {overfit} for {name}, it has to be in [0.0, 1.0] or an int. "
                         f"{name}={overfit!r} must be an int >= 0 (batches) or a float in [0, 1] (a fraction of the "
                         "training batches); 0 turns it off")


@dataclass(frozen=True)
class TrainerConfig:
    """Resolved Trainer flags. ``Trainer.__init__`` names each of them in its signature, with these types, defaults
    and descriptions (tests/test_trainer_config.py keeps them equal).

    Attributes:
        max_epochs: epochs to train (>= 0; -1: no limit). None (the default): no limit when ``max_steps`` or
            ``max_time`` is set (Lightning's rule); 1000 with a warning when only ``min_epochs``/``min_steps`` is
            (Lightning's default); else 1 (Lightning: 1000 with a warning).
        max_steps: stop after this many optimizer steps (0: no training; None or -1: no limit; resolved to None).
        accumulate_grad_batches: micro-batches per optimizer step (gradients all-reduced on the last only); a
            schedule by epoch is the ``GradientAccumulationScheduler`` callback's (a dict here is refused).
        gradient_clip_val: clip the total gradient norm (or each value: ``gradient_clip_algorithm="value"``).
        gradient_clip_algorithm: "norm" (clip the total gradient norm to ``gradient_clip_val``) or "value" (clip each
            gradient value to it).
        seed: at the start of each ``fit``, Python's ``random``, numpy and torch (CPU and every CUDA device) are seeded
            with it on every rank alike (``trainscale.seed_everything``), before the model is set up (a model built on
            the meta device is initialised from it); the training samplers shuffle epoch ``e`` with ``seed + e``.
            None (the default): the seed of the script's last ``seed_everything(n)`` (Lightning's
            ``PL_GLOBAL_SEED``), else 0, so runs repeat unless it is changed. A model built before ``fit`` takes its
            initial weights from the script's own random state: seed before building it. A resumed run restores each
            rank's saved RNG states instead.
        default_root_dir: runs are written to ``default_root_dir/version_N`` (None: ``runs``, the default).
        log_every_n_steps: optimizer steps between step records (one host sync and, with telemetry, one all_gather of a
            small tensor each).
        enable_progress_bar: a tqdm bar on rank zero.
        enable_checkpointing: checkpoint at each epoch end.
        checkpoint_every_n_steps: also checkpoint every N optimizer steps, mid-epoch, with the exact position.
        keep_last: checkpoints kept on disk besides "last" (None keeps all). With ``enable_checkpointing`` and
            ``checkpoint_every_n_steps`` it configures the default :class:`~trainscale.callbacks.ModelCheckpoint`, added
            when the user's callbacks hold none.
        checkpoint_async: write the epoch-end and ``checkpoint_every_n_steps`` checkpoints in the background (torch's
            ``async_save``; sharded strategies only: fsdp, model_parallel, hsdp, tp): the loop waits only while the
            state is copied to host memory; each is published ("last" moved to it) once written, at a later step or the
            end of ``fit`` (``checkpointing/writes.py``; docs/fault-tolerance.md).
        on_nonfinite: "raise" (a non-finite loss raises at the next check, about a second of steps later and at most
            ``log_every_n_steps`` apart, naming step, epoch and rank) or "skip" (skip optimizer steps whose gradients
            are not finite; more than ``max_nonfinite_skips`` in a row raise).
        max_nonfinite_skips: under ``on_nonfinite="skip"``, more than this many skipped steps in a row raise.
        handle_signals: on SIGTERM/SIGUSR1 checkpoint at the next check (about a second of steps later), requeue a SLURM
            job (SIGUSR1) and exit with ``trainscale.faults.tolerance.Preempted``; a rank that cannot get there exits 20
            s after SIGTERM with its stacks (docs/fault-tolerance.md).
        enable_telemetry: measure the step-phase split, throughput, MFU, memory, GPU utilisation and stragglers
            (docs/telemetry.md).
        straggler_margin: a rank computing this fraction longer than the median (step time less exposed communication)
            is a straggler.
        tensorboard: add a ``TensorBoardLogger()`` to the loggers (``trainscale[tensorboard]``).
        batch_size: "max" rebuilds the training DataLoader with the largest per-device batch that trains on every rank
            (``trainscale.tune.batch_size``); None keeps the loader's.
        max_memory: the bytes each rank's step may peak at in the ``batch_size="max"`` search (required on CPU).
        lr_scaling: "linear" (SGD; Goyal et al. 2017) or "sqrt" (Adam/AdamW; Malladi et al. 2022): every step uses each
            param group's lr × the rule's factor of global batch / ``base_batch_size`` (the global batch size the
            learning rates were tuned at); None: unscaled.
        base_batch_size: the global batch size the learning rates were tuned at (what ``lr_scaling`` scales from).
        lr_warmup_steps: ramp ``lr_scaling``'s factor linearly from 1 to its value over this many optimizer steps (Goyal
            et al.'s warm-up; 0: none). See :mod:`trainscale.scaling.batch_scaling`.
        limit_train_batches: train on at most this many micro-batches per epoch (an int >= 1), or on this fraction of
            them (a float in (0, 1], at least one batch), as Lightning's flag; None: all (:meth:`train_batches`); 0 (or
            0.0): no training, as Lightning's: ``fit`` runs its sanity check and hooks but no epoch, as with
            ``max_steps=0``. A whole float above 1 (10.0) is a count (10), as Lightning's; this holds for the other
            limits, ``overfit_batches`` and ``val_check_interval`` too.
        limit_val_batches: as ``limit_train_batches``, for each rank's validation batches in ``fit`` and
            ``validate``; 0 (or 0.0): no validation (nor sanity check) in ``fit``, none in ``validate``.
        limit_test_batches: as ``limit_train_batches``, for ``test``; 0 (or 0.0) turns it off, as Lightning's:
            its ``setup``/``teardown`` hooks run, no loader is asked for, it returns ``[]``.
        limit_predict_batches: as ``limit_test_batches``, for ``predict`` (returning None when 0).
        min_epochs: a stop asked by a callback (``trainer.should_stop``, e.g. ``EarlyStopping``) waits until this many
            epochs are done, as Lightning's (None: no minimum).
        min_steps: as ``min_epochs``, in optimizer steps.
        count_flops: count the FLOPs of the run's first micro-batch with ``FlopCounterMode`` for MFU (None: on CUDA
            only, never under ``compile``).
        peak_flops: FLOP/s of one device for MFU (None: the table of ``trainscale.telemetry.flops``).
        val_check_interval: when to validate, as Lightning: an int N validates after every N-th training batch
            (micro-batch) of the epoch (with ``check_val_every_n_epoch=None``: of the run, across epochs; it may then
            exceed an epoch's batches), a float in (0, 1] after every ``int(batches × f)``-th (at least 1); None (=
            1.0): at each epoch end; a duration ("DD:HH:MM:SS", a ``datetime.timedelta`` or a dict of its keywords,
            Lightning 2.6) after the first optimizer step that ends once that much training time has passed since
            training began or validation last ended, by rank zero's clock (an epoch's end validates only when that time
            is up). Validation runs at the end of the optimizer step that holds that batch (with
            ``accumulate_grad_batches`` > 1, Lightning validates mid-step), before the step's checkpoints, so a
            checkpoint written there resumes exactly.
        check_val_every_n_epoch: validate only in every N-th epoch (None: by ``val_check_interval`` alone, which must
            then be an int, counting the run's batches, or a duration).
        num_sanity_val_steps: validation batches run before training (Lightning's sanity check, default 2; -1: all; 0:
            none), with ``trainer.sanity_checking`` True; its results are not recorded, ``callback_metrics`` and the
            random states are as before it. A resumed fit runs it after a completed epoch, not mid-epoch nor with
            ``max_steps`` set (Lightning 2.6).
        fast_dev_run: True or an int N (True = 1): N batches of training (``max_steps=N``, one epoch), validation, test
            and predict, no sanity check, and nothing written: no run directory, checkpoint, logger or record
            (Lightning's; its loggers become a dummy).
        max_time: stop training once this much time has passed since ``fit`` began training (Lightning's ``Timer``):
            "DD:HH:MM:SS", a ``datetime.timedelta`` or a dict of its keyword arguments; resolved to a ``timedelta``.
            A ``Timer(duration=max_time, interval="step")`` in ``trainer.callbacks`` (unless you give a ``Timer``),
            as Lightning's: it stops ``fit`` at its start or after the training batch where the time ran out, the
            epoch ending as usual; ``min_epochs``/``min_steps`` hold it back; a resume counts the time before.
        overfit_batches: train on the first N batches (an int) or fraction (a float in (0, 1]) of the training set,
            unshuffled, every epoch, and validate on as many of the validation batches (Lightning 2's; 0: off). It
            replaces ``limit_train_batches`` and ``limit_val_batches``.
        deterministic: True: ``torch.use_deterministic_algorithms(True)``, ``cudnn.benchmark`` off and
            ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (Lightning's accelerator connector); "warn": the same with
            ``warn_only=True``; False: deterministic algorithms off; None: left as they are. Set in ``Trainer()``.
        use_distributed_sampler: True: on several data-parallel ranks the training loader gets trainscale's
            distributed sampler (each rank its share, each sample once per epoch, resumable mid-epoch), in the
            loader's own order: shuffled when it shuffled, sequential (with a warning: Lightning shuffles it) when not.
            False: the training loader is used as given on every rank (Lightning's meaning: your sampler decides
            what each rank reads; a mid-epoch resume then skips the batches done, on the same world size).
        reload_dataloaders_every_n_epochs: N > 0: at the start of every N-th epoch since the loaders were made, ask the
            data hooks (``train_dataloader()``, ``val_dataloader()`` of the data module or the model; not ``setup``)
            for new loaders, as Lightning's; loaders passed to ``fit`` stay. 0: never.
        enable_model_summary: print a :class:`~trainscale.callbacks.ModelSummary` (layers, parameters, size) on rank
            zero at the start of ``fit``, unless the callbacks hold one (Lightning's default).
        detect_anomaly: run ``fit`` under ``torch.autograd.set_detect_anomaly(True)`` (Lightning's flag): a backward
            that produces NaN names the forward operation that made it, with its traceback; much slower, for
            debugging. The previous mode is restored when ``fit`` ends, also on an error.
        benchmark: the value ``torch.backends.cudnn.benchmark`` is set to in ``Trainer()`` (Lightning's flag: True
            lets cuDNN try its convolution algorithms for each input shape and keep the fastest); None: False with
            ``deterministic``, else left as it is.
        barebones: Lightning's mode for measuring the loop's own overhead: no checkpoints, progress bar, model
            summary, sanity check, telemetry, loggers or profiler, nothing written (no run directory), and
            ``self.log`` ignored with a warning; ``fast_dev_run``, ``detect_anomaly``, ``checkpoint_every_n_steps``,
            ``tensorboard``, a ``num_sanity_val_steps`` other than 0 (or the default), a ``logger`` or a ``profiler``
            with it are a ``ValueError``, as in Lightning.
        inference_mode: Lightning's flag: ``validate``, ``test``, ``predict`` and ``fit``'s validation run under
            ``torch.inference_mode()`` (True) or ``torch.no_grad()`` (False: tensors made there can later enter
            autograd, and ``torch.enable_grad()`` inside a step works). As Lightning's, ``no_grad`` in either case on
            a gloo process group and under strategies whose forward runs collectives (fsdp, hsdp, tp, pp:
            pytorch/pytorch#95957).
    """

    max_epochs: int | None = None  # the rules of max_epochs and max_steps: _loop_limits
    max_steps: int | None = None
    accumulate_grad_batches: int = flag(1, check=_accumulate)
    gradient_clip_val: float | None = flag(None, check=_clip_val)
    gradient_clip_algorithm: Literal["norm", "value"] = flag("norm", check=_clip_algorithm)
    seed: int | None = flag(None, check=_seed)
    default_root_dir: str | Path | None = Path("runs")  # made a Path, and checked, by _root_dir (None: "runs")
    log_every_n_steps: int = flag(50, low=1)
    enable_progress_bar: bool = flag(True)
    enable_checkpointing: bool = flag(True)
    checkpoint_every_n_steps: int | None = flag(None, low=1)
    keep_last: int | None = flag(3, low=1)
    checkpoint_async: bool = flag(False)
    on_nonfinite: Literal["raise", "skip"] = flag("raise")
    max_nonfinite_skips: int = flag(10, low=0)
    handle_signals: bool = flag(True)
    enable_telemetry: bool = flag(True)
    straggler_margin: float = flag(0.2, low=0.0, hint=" (0.2 means 20 % over the median)")
    tensorboard: bool = flag(False)
    batch_size: Literal["max"] | None = flag(None)
    max_memory: int | None = flag(None, low=1)
    lr_scaling: Literal["linear", "sqrt"] | None = flag(None)  # with base_batch_size: _check_lr_scaling
    base_batch_size: int | None = flag(None, low=1)
    lr_warmup_steps: int = flag(0, low=0)
    limit_train_batches: int | float | None = flag(None, check=_limit)
    limit_val_batches: int | float | None = flag(None, check=_limit)
    limit_test_batches: int | float | None = flag(None, check=_limit)
    limit_predict_batches: int | float | None = flag(None, check=_limit)
    min_epochs: int | None = flag(None, low=0)
    min_steps: int | None = flag(None, low=0)
    count_flops: bool | None = flag(None)
    peak_flops: float | None = flag(None, low=1.0)
    # with check_val_every_n_epoch: _check_val_schedule; a duration made a timedelta by parse_duration
    val_check_interval: int | float | str | timedelta | dict | None = None
    check_val_every_n_epoch: int | None = flag(1, check=_every_n_epoch)
    num_sanity_val_steps: int = flag(2, low=-1)
    fast_dev_run: bool | int = flag(False, check=_fast_dev_run)
    max_time: str | timedelta | dict | None = None  # made a timedelta, and checked, by parse_duration
    overfit_batches: int | float = flag(0.0, check=_overfit_batches)
    deterministic: bool | Literal["warn"] | None = flag(None)
    enable_model_summary: bool = flag(True)
    use_distributed_sampler: bool = flag(True)
    reload_dataloaders_every_n_epochs: int = flag(0, check=_reload_every)
    detect_anomaly: bool = flag(False)
    benchmark: bool | None = flag(None)
    barebones: bool = flag(False)
    inference_mode: bool = flag(True)

    def train_batches(self, full: float) -> float:
        """An epoch's micro-batches under ``limit_train_batches``, of ``full`` without it (infinite: an iterable's)."""
        return _limited(self.limit_train_batches, full)

    def val_batches(self, full: float) -> float:
        """A rank's validation batches under ``limit_val_batches``, of ``full`` without it (infinite: an iterable's)."""
        return _limited(self.limit_val_batches, full)

    def eval_batches(self, stage: str, full: float) -> float:
        """A rank's batches of ``stage`` ("validation", "test" or "predict") under its ``limit_*_batches``."""
        limit = {"validation": self.limit_val_batches, "test": self.limit_test_batches,
                 "predict": self.limit_predict_batches}[stage]
        return _limited(limit, full)

    def can_stop(self, epochs_done: int, global_step: int) -> bool:
        """Whether a stop asked by a callback may happen now (``min_epochs``, ``min_steps``: Lightning's
        ``_FitLoop._can_stop_early``)."""
        return epochs_done >= (self.min_epochs or 0) and global_step >= (self.min_steps or 0)

    @property
    def epoch_limit(self) -> float:
        """``max_epochs``, or infinity for -1."""
        assert self.max_epochs is not None, "resolve_trainer_config resolves max_epochs None to 1 or -1"
        return math.inf if self.max_epochs == -1 else self.max_epochs

    @property
    def step_limit(self) -> float:
        """``max_steps``, or infinity when there is none."""
        return math.inf if self.max_steps is None else self.max_steps

    def validates_in(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` (0-based) validates at all: Lightning's ``_should_check_val_epoch``."""
        every = self.check_val_every_n_epoch
        return every is None or (epoch + 1) % every == 0

    def val_check_batch(self, epoch_batches: float) -> float:
        """Training batches between validations (Lightning's ``trainer.val_check_batch``) in an epoch of
        ``epoch_batches`` (after ``limit_train_batches``; infinite for an iterable data set): the int
        ``val_check_interval``, or ``max(1, int(epoch_batches × fraction))``; infinite: at the epoch end only.

        Raises:
            ValueError: an int interval above the epoch's batches while ``check_val_every_n_epoch`` is set; a
                fraction below 1.0 of an iterable data set's unknown number of batches (Lightning's errors).
        """
        interval = self.val_check_interval
        if isinstance(interval, (timedelta, str, dict)):  # a duration (a timedelta once resolved): by the clock
            return math.inf
        if isinstance(interval, int):
            if interval > epoch_batches and self.check_val_every_n_epoch is not None:  # Lightning's words first
                raise ValueError(f"`val_check_interval` ({interval}) must be less than or equal to the number of the "
                                 f"training batches ({epoch_batches}) of an epoch; to validate every N batches across "
                                 "epochs pass check_val_every_n_epoch=None")
            return interval
        fraction = 1.0 if interval is None else interval
        if epoch_batches == math.inf:
            if fraction < 1.0:
                raise ValueError(f"val_check_interval={interval} is a fraction of an IterableDataset's epoch, whose "
                                 "number of batches is unknown; pass an int (every N batches) or None")
            return math.inf
        return max(1, int(epoch_batches * fraction))

    def validation_due(self, epoch: int, batches: range, total_before: int, epoch_batches: float) -> bool:
        """Whether validation runs after an optimizer step of epoch ``epoch`` that trained the epoch's batches
        ``batches`` (0-based indices; ``total_before``: batches of the run before them): Lightning's
        ``_should_check_val_fx`` for any of them (``(batch_idx + 1) % val_check_batch == 0``, the run's batch
        index with ``check_val_every_n_epoch=None``), or the epoch's last batch of an iterable data set."""
        if not self.validates_in(epoch):
            return False
        every = self.val_check_batch(epoch_batches)
        if every == math.inf:
            return batches.stop >= epoch_batches
        offset = total_before - batches.start if self.check_val_every_n_epoch is None else 0
        return any((offset + i + 1) % every == 0 for i in batches)

    @property
    def val_check_seconds(self) -> float:
        """Seconds between time-based validations (``val_check_interval`` a duration); infinity otherwise."""
        interval = self.val_check_interval
        return interval.total_seconds() if isinstance(interval, timedelta) else math.inf

    @property
    def sanity_val_batches(self) -> float:
        """Validation batches of the sanity check (``num_sanity_val_steps``; -1: all)."""
        return math.inf if self.num_sanity_val_steps == -1 else self.num_sanity_val_steps

    @property
    def writes_files(self) -> bool:
        """False under ``fast_dev_run`` and ``barebones``: no run directory, checkpoint, logger or record."""
        return not (self.fast_dev_run or self.barebones)

    @property
    def why_no_files(self) -> str:
        """Why nothing is written, for the run's header line (when :attr:`writes_files` is False)."""
        if self.fast_dev_run:
            return f"fast_dev_run: {self.max_steps} batch(es) of each loop, nothing written"
        return "barebones: nothing written"




def _limited(limit: int | float | None, full: float) -> float:
    """``full`` batches cut to ``limit``: a count, or a fraction (at least one batch when there are any). ``full``
    infinite (an iterable data set, whose iterator ends the epoch): a count, or the fraction 1.0.

    Raises:
        ValueError: a fraction below 1.0 of an iterable's unknown number of batches (Lightning refuses it too).
    """
    if limit is None or full == 0:
        return full
    if limit == 0:
        return 0
    if full == math.inf and isinstance(limit, float) and limit < 1.0:
        raise ValueError(f"a limit_*_batches fraction ({limit}) of an IterableDataset, whose number of batches is "
                         "unknown; pass a number of batches (an int) or 1.0")
    return min(full, limit) if isinstance(limit, int) else full if full == math.inf else max(1, int(full * limit))


def _root_dir(value) -> Path:
    if value is None:  # Lightning's None (there: the working directory); here trainscale's default
        value = Path("runs")
    if not isinstance(value, (str, Path)) or str(value) == "":
        raise ValueError(f"default_root_dir={value!r} must be a directory path (str or Path)")
    refuse_url("default_root_dir", value)
    path = Path(value)
    too_long = [part for part in path.parts if len(part.encode()) > 255]  # NAME_MAX of Linux and macOS filesystems
    if too_long:
        raise ValueError(f"default_root_dir has a name of {len(too_long[0].encode())} bytes ({too_long[0][:40]}...); "
                         "file systems allow 255: pass a shorter directory name")
    if path.exists() and not path.is_dir():
        raise ValueError(f"default_root_dir={str(path)!r} is a file; pass a directory (runs go to "
                         "<default_root_dir>/version_N)")
    existing = next((p for p in (path, *path.absolute().parents) if p.exists()), None)
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"default_root_dir={str(path)!r} cannot be written ({str(existing)!r} is read-only for this "
                         "user); pass a writable directory")
    return path


def _loop_limits(cfg: TrainerConfig) -> TrainerConfig:
    """``max_epochs`` and ``max_steps`` with Lightning's spellings of "no limit" (``_parse_loop_limits``):
    ``max_steps`` -1 becomes None; ``max_epochs`` None becomes -1 (no limit) when ``max_steps`` or ``max_time`` is
    set; 1000 (Lightning's default, with its warning) when only ``min_epochs`` or ``min_steps`` is, so that the
    minimum can be met; else 1 (trainscale's default; Lightning's is 1000 epochs, with a warning). ``max_epochs=0``
    trains nothing, as Lightning, and so does ``max_steps=0``.

    Raises:
        ValueError: ``max_epochs`` not an int >= 0, -1 or None; ``max_steps`` not an int >= 0, -1 or None.
    """
    max_steps = None if cfg.max_steps == -1 else cfg.max_steps
    _check_loop_limit("max_steps", cfg.max_steps)
    max_epochs = cfg.max_epochs
    if max_epochs is None and (max_steps is not None or cfg.max_time is not None):
        max_epochs = -1
    elif max_epochs is None and (cfg.min_epochs or cfg.min_steps):
        # one epoch could not honour the minimum the user asked for; Lightning's default, with its warning
        warnings.warn(f"`max_epochs` was not set. Setting it to {_LIGHTNING_MAX_EPOCHS} epochs. To train without an "
                      "epoch limit, set `max_epochs=-1`. (Lightning's default, taken here so that min_epochs/min_steps "
                      "can be met)", PossibleUserWarning, stacklevel=3)
        max_epochs = _LIGHTNING_MAX_EPOCHS
    elif max_epochs is None:
        max_epochs = 1
    _check_loop_limit("max_epochs", max_epochs)
    return replace(cfg, max_epochs=max_epochs, max_steps=max_steps)


def _check_loop_limit(name: str, value) -> None:
    """``max_epochs`` or ``max_steps``: None, -1 or an int >= 0, in Lightning's words (``fit_loop.py``,
    ``training_epoch_loop.py``) and then the meaning of each."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < -1):
        raise ValueError(f"{name}={value!r}: `{name}` must be a non-negative integer or -1 (0: no training; "
                         "-1 or None: no limit)")


_ONE_BATCH = {"limit_train_batches": ("1 batch per epoch will be used.", "100% of the batches per epoch will be used"),
              "val_check_interval": ("validation will run after every batch.",
                                     "validation will run at the end of the training epoch")}


def say_one_batch_limits(cfg: TrainerConfig, say: bool) -> None:
    """When ``say`` (rank zero): each of :func:`one_batch_messages` at INFO through this module's logger where logging
    shows INFO, printed otherwise (``utilities.rank_zero.log_info``), as Lightning's ``rank_zero_info``."""
    from trainscale.utilities.rank_zero import log_info

    for message in one_batch_messages(cfg) if say else ():
        log_info(_log, message)


def one_batch_messages(cfg: TrainerConfig) -> list[str]:
    """Lightning's notes for a limit given as exactly ``1`` or ``1.0``, which mean different things (an int counts
    batches, a float is a fraction): ``"`Trainer(limit_val_batches=1)` was configured so 1 batch will be used."``
    (``trainer/setup.py``, ``_determine_batch_limits``), for ``limit_*_batches``, ``val_check_interval`` and
    ``overfit_batches``; none for values left at their defaults."""
    out = []
    for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                 "val_check_interval", "overfit_batches"):
        if cfg.overfit_batches and name in ("limit_train_batches", "limit_val_batches"):
            continue  # set from overfit_batches, not given
        value = getattr(cfg, name)
        count, fraction = _ONE_BATCH.get(name, ("1 batch will be used.", "100% of the batches will be used"))
        if isinstance(value, int) and not isinstance(value, bool) and value == 1:
            out.append(f"`Trainer({name}=1)` was configured so {count}")
        elif isinstance(value, float) and value == 1.0:
            out.append(f"`Trainer({name}=1.0)` was configured so {fraction}.")
    return out


def warn_default_max_epochs(cfg: TrainerConfig, given: int | None, say: bool) -> None:
    """At ``fit``, when ``say`` (rank zero): a ``PossibleUserWarning`` that ``max_epochs`` was left unset and
    :func:`_loop_limits` gave trainscale's 1 (``given``: the flag as passed), as Lightning's fit warns that it sets 1000
    (``loops/utilities.py``, ``_parse_loop_limits``); none under ``fast_dev_run``, which sets its own limits."""
    if say and given is None and cfg.max_epochs == 1 and not cfg.fast_dev_run:
        warnings.warn("`max_epochs` was not set. Setting it to 1 epoch (trainscale's default; Lightning's is 1000 "
                      "epochs). To train longer, set `max_epochs=N`, or `max_epochs=-1` for no epoch limit",
                      PossibleUserWarning, stacklevel=4)


_BATCH_COUNTS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                 "overfit_batches", "val_check_interval")


def _whole_batch_counts(cfg: TrainerConfig) -> TrainerConfig:
    """Lightning's rule (``_determine_batch_limits``) for the flags that take a count or a fraction of batches: a
    float above 1 that is a whole number counts batches (``limit_train_batches=10.0`` is 10 batches, the int 10);
    any other float above 1 stays, for the flag's check to refuse in Lightning's words."""
    whole: dict[str, Any] = {name: int(value) for name in _BATCH_COUNTS
             if isinstance(value := getattr(cfg, name), float) and value > 1 and value.is_integer()}
    return replace(cfg, **whole) if whole else cfg


def _check_val_schedule(cfg: TrainerConfig) -> None:
    """``val_check_interval`` with ``check_val_every_n_epoch`` (Lightning's ``trainer/setup.py``, ``loops/fit_loop.py``)."""
    interval = cfg.val_check_interval
    count = isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1
    timed = isinstance(interval, timedelta)  # parse_duration's: not negative
    if not (interval is None or count or timed or (isinstance(interval, float) and 0.0 < interval <= 1.0)):
        raise ValueError(f"You have passed invalid value {interval} for val_check_interval, it has to be in [0.0, 1.0] "
                         f"or an int. val_check_interval={interval!r} must be an int >= 1 (every N training batches), a float in "
                         "(0, 1] (a fraction of the epoch), a duration ('DD:HH:MM:SS', a datetime.timedelta or a "
                         "dict of its keywords) or None (each epoch end)")
    if cfg.check_val_every_n_epoch is None and not (count or timed):  # Lightning's words first
        raise ValueError("`val_check_interval` should be an integer or a time-based duration (str 'DD:HH:MM:SS', "
                         "datetime.timedelta, or dict kwargs for timedelta) when `check_val_every_n_epoch=None`. "
                         "check_val_every_n_epoch=None validates by the run's batches or by time, so val_check_interval "
                         f"must be an int (every N training batches of the run) or a duration, not {interval!r}")


# What Trainer(barebones=True) turns off (Lightning's opt-outs, and trainscale's telemetry), and the flags it refuses
# when given (Lightning's opt-ins; trainscale's own checkpoints and TensorBoard), each with its value that is "off".
_BAREBONES_OFF = {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                  "num_sanity_val_steps": 0, "enable_telemetry": False}
_BAREBONES_REFUSED = {"fast_dev_run": False, "detect_anomaly": False, "checkpoint_every_n_steps": None,
                      "tensorboard": False}


def _barebones_overrides(cfg: TrainerConfig) -> dict:
    """What ``barebones`` sets, as Lightning's ``Trainer.__init__``: the features that cost speed off.

    Raises:
        ValueError: a flag it refuses given (``_BAREBONES_REFUSED``), or ``num_sanity_val_steps`` other than 0 or its
            default (Lightning refuses any given value but 0; trainscale cannot tell its default from a given 2).
    """
    if not cfg.barebones:
        return {}
    given = [f"{name}={getattr(cfg, name)!r}" for name, off in _BAREBONES_REFUSED.items() if getattr(cfg, name) != off]
    if cfg.num_sanity_val_steps not in (0, TrainerConfig.num_sanity_val_steps):
        given.append(f"num_sanity_val_steps={cfg.num_sanity_val_steps!r}")
    if given:
        raise ValueError(f"Trainer(barebones=True, {', '.join(given)}): barebones mode turns off what may slow the "
                         "loop down; drop barebones=True, or those flags")
    return dict(_BAREBONES_OFF)


def barebones_logger(cfg: TrainerConfig, logger: Any, profiler: Any, callbacks: Any) -> Any:
    """The ``logger`` flag under ``barebones``: False (no logger); as given without it.

    Raises:
        ValueError: under ``barebones``, a ``logger`` other than None or False, a ``profiler``, or a
            ``ModelCheckpoint`` in ``callbacks`` (Lightning's rules; its words for the last).
    """
    if not cfg.barebones:
        return logger
    given = [f"{name}={value!r}" for name, value in (("logger", logger), ("profiler", profiler))
             if value is not None and value is not False]
    if given:
        raise ValueError(f"Trainer(barebones=True, {', '.join(given)}): barebones mode has no loggers and no profiler; "
                         "drop barebones=True, or those flags")
    given_callbacks = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks]
    if any(isinstance(cb, ModelCheckpoint) for cb in given_callbacks):
        raise ValueError("Trainer was configured with `enable_checkpointing=False` (by barebones=True) but found "
                         "`ModelCheckpoint` in callbacks list.")
    return False


def _debugging_overrides(cfg: TrainerConfig) -> dict:
    """What ``overfit_batches`` and ``fast_dev_run`` set, as Lightning's ``_init_debugging_flags``."""
    out: dict = {}
    if cfg.fast_dev_run:
        n = int(cfg.fast_dev_run)
        out = {"limit_train_batches": n, "limit_val_batches": n, "limit_test_batches": n, "limit_predict_batches": n,
               "max_steps": n, "max_epochs": 1, "num_sanity_val_steps": 0, "val_check_interval": None,
               "check_val_every_n_epoch": 1}
    if cfg.overfit_batches:
        out.update(limit_train_batches=cfg.overfit_batches, limit_val_batches=cfg.overfit_batches)
    return out


def _check_lr_scaling(cfg: TrainerConfig) -> None:
    """``lr_scaling`` with its ``base_batch_size``; neither of its companions without it."""
    if cfg.lr_scaling is not None and cfg.base_batch_size is None:
        raise ValueError(f"lr_scaling={cfg.lr_scaling!r} needs base_batch_size=: the global batch size your learning "
                         "rates were tuned at (e.g. base_batch_size=256)")
    given = [f"{name}={value!r}" for name, value in (("base_batch_size", cfg.base_batch_size),
                                                     ("lr_warmup_steps", cfg.lr_warmup_steps)) if value]
    if cfg.lr_scaling is None and given:
        raise ValueError(f"{' and '.join(given)} has no effect without lr_scaling: pass lr_scaling='linear' (SGD) or "
                         "'sqrt' (Adam, AdamW), or drop it")


def resolve_trainer_config(**flags) -> TrainerConfig:
    """Validate the Trainer's flags and return them as a :class:`TrainerConfig`.

    Raises:
        ValueError: a value of the wrong type or range, naming the flag and what it accepts.
        TypeError: an unknown flag.
    """
    cfg = _whole_batch_counts(_loop_limits(make_flags(TrainerConfig, "Trainer", (), flags)))
    check_flags(cfg)  # each flag by the rule declared on its field
    interval = cfg.val_check_interval
    if isinstance(interval, (str, dict, timedelta)):  # a duration (Lightning 2.6's time-based validation)
        cfg = replace(cfg, val_check_interval=parse_duration("val_check_interval", interval))
    _check_lr_scaling(cfg)  # the rules across flags
    _check_val_schedule(cfg)
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("tensorboard=True needs the tensorboard package: pip install 'trainscale[tensorboard]' "
                         "(or pass tensorboard=False; metrics.jsonl is always written)")
    max_time, root = parse_duration("max_time", cfg.max_time), _root_dir(cfg.default_root_dir)
    resolved = replace(cfg, default_root_dir=root, max_time=max_time,
                       fast_dev_run=cfg.fast_dev_run if cfg.fast_dev_run != 1 else True,
                       **_barebones_overrides(cfg))
    return replace(resolved, **_debugging_overrides(resolved))
