"""Trainer: the training loop, built on Runtime. ``Trainer(devices=2).fit(model, train_loader, optimizer=...)``

``model`` is a plain ``nn.Module`` with ``loss_fn``, or a Lightning-style ``trainscale.TrainingModule``.
The loop reads top to bottom: ``fit`` → ``_train_epoch`` → :meth:`Trainer.train_step` (one optimizer step over
its micro-batches, every effect of it named there in order) → ``_end_epoch``; the same code runs at world
size 1 (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import time
import warnings
from pathlib import Path
from datetime import timedelta
from time import perf_counter  # bound at import: a test's patch of time.perf_counter (a callback's clock) misses it
from typing import Any, Callable, Iterator, Literal

import torch
from torch import nn

from trainscale.callbacks import (Callback, EarlyStopping, GradientAccumulationScheduler, ModelCheckpoint, ModelSummary,
                                  TQDMProgressBar, merge_model_callbacks, resolve_callbacks)
from trainscale.callbacks.base import HOOKS, overridden_hooks
from trainscale.utilities.model_helpers import is_overridden
from trainscale.utilities.rank_zero import log_info
from trainscale.utilities.warnings import PossibleUserWarning
from trainscale.loggers import resolve_loggers
from trainscale.loggers.log_dirs import agree_log_dirs, trainer_log_dir
from trainscale.runtime.flags import (AcceleratorFlag, MatmulPrecisionFlag, PipelineScheduleFlag, PrecisionFlag,
                                      StrategyFlag, defaults_from_env_vars, names_closest_flag)
from trainscale.runtime.checkpoint_io import refuse_url
from trainscale.runtime.connector import check_plugins
from trainscale.runtime.runtime import Runtime
from trainscale.runtime.strategies import Strategy
from trainscale.telemetry.flops import resolve_count_flops
from trainscale.telemetry.processor import create_telemetry
from trainscale.checkpointing import checkpointer, run_dirs as ckpt
from trainscale.checkpointing.rng import fit_seed, rng_state, seed_generators, seeds_workers, set_rng_state, worker_init
from trainscale.loop import evaluation
from trainscale.scaling.batch_scaling import BatchScaling, global_batch_size
from trainscale.tune.batch_size import tuned_loader
from trainscale.checkpointing.writes import CheckpointWrites
from trainscale.loop.data_checks import (check_loaders, check_train_loader_type, explain_batch_error, overfit_order,
                                         validation_to_run, warn_few_batches, warn_unshuffled)
from trainscale.lightning.data_sources import EvalLoaders, FitSources, prepare_stage
from trainscale.lightning.hparams import drop_unpicklable
from trainscale.loop.config import (TrainerConfig, barebones_logger, resolve_trainer_config, say_one_batch_limits,
                                    warn_default_max_epochs)
from trainscale.faults.tolerance import STEP_PHASE, FaultTolerance
from trainscale.lightning.metrics import MetricCollector, logged_metrics, progress_bar_metrics
from trainscale.lightning.module import (BatchTransfer, TrainingModule, attach_trainer, batch_end_outputs,
                                         batch_transfer, defined_hooks, module_overrides, refuse_dataloader_iter,
                                         set_up_model, skip_backward, uncalled_hooks)
from trainscale.lightning.optimizers import ManualOptimizer, StepOptimizer, step_schedulers
from trainscale.loop.progress import epoch_bar
from trainscale.loop.records import MetricsProcessor, epoch_label, epoch_line, epoch_record, run_header
from trainscale.loop.spawned import run_spawned
from trainscale.checkpointing.runs import (RunLock, as_ckpt_path, choose_run_dir, overwrite_refusal,
                                          resolve_ckpt_path)
from trainscale.loop.summary import finish_run, hyperparams
from trainscale.lightning.optimizer_setup import build_optimizers
from trainscale.checkpointing.train_state import ResumePoint, RunningStage, TrainerFn, TrainerStatus, TrainState
from trainscale.profilers import Profiler, resolve_profiler
from trainscale.loop.state import EpochLoss, FitRun, MicroBatch, MicroBatchBooks, epoch_batches, micro_batches


_log = logging.getLogger(__name__)  # Lightning's notes at INFO (log_info: printed where logging shows no INFO)


def _stage_flag(stage: RunningStage, doc: str) -> property:
    """A bool view of ``trainer.state.stage`` (Lightning's ``trainer.training`` and its kin): True while ``stage``
    runs; set True, that stage runs; set False, none does when it was the one running (Lightning's setters)."""

    def running(trainer: Trainer) -> bool:
        return trainer.state.stage == stage

    def set_running(trainer: Trainer, on: bool) -> None:
        if on or trainer.state.stage == stage:
            trainer.state.stage = stage if on else None

    return property(running, set_running, doc=doc)


class NoTrainingStateError(RuntimeError, AttributeError):
    """``Trainer.save_checkpoint`` before any ``fit``: a ``RuntimeError``, and the ``AttributeError`` Lightning raises
    (no model attached)."""


class Trainer:
    """Fit, validate, test and predict on any strategy by changing flags (keyword only; :meth:`__init__` names and
    describes each). With ``devices > 1`` outside a launcher the script re-executes under torchrun in ``Trainer()``.
    A flag not given takes the value of the environment variable ``PL_TRAINER_<FLAG>`` when it is set, as Lightning's
    (``PL_TRAINER_MAX_STEPS=7``; :func:`~trainscale.runtime.flags.defaults_from_env_vars`).
    """

    @names_closest_flag
    @defaults_from_env_vars
    def __init__(self, *, callbacks: list[Callback] | None = None, logger: Any = None, runtime: Runtime | None = None,
                 profiler: Profiler | Literal["simple", "advanced", "pytorch"] | None = None, plugins: Any = None,
                 # the Runtime's flags (RuntimeFlags), described in Runtime.__init__
                 accelerator: AcceleratorFlag = "auto", devices: int | Literal["auto"] = "auto",
                 strategy: StrategyFlag | Strategy = "auto", num_nodes: int | None = None,
                 precision: PrecisionFlag = "32-true",
                 timeout: float = 1800.0, strategy_options: dict | None = None, sync_batchnorm: bool = False,
                 activation_checkpointing: Any = None, compile: bool | dict = False,
                 float32_matmul_precision: MatmulPrecisionFlag | None = None, parallel: dict | None = None,
                 tp_plan: dict | None = None, parallelize: Callable | None = None,
                 pp_schedule: PipelineScheduleFlag | None = None, pp_microbatches: int | None = None,
                 pp_split_points: list | None = None,
                 # the loop's flags (TrainerConfig)
                 max_epochs: int | None = None, max_steps: int | None = None, accumulate_grad_batches: int = 1,
                 gradient_clip_val: float | None = None, gradient_clip_algorithm: Literal["norm", "value"] = "norm",
                 seed: int | None = None,
                 default_root_dir: str | Path | None = Path("runs"), log_every_n_steps: int = 50,
                 enable_progress_bar: bool = True, enable_checkpointing: bool = True,
                 checkpoint_every_n_steps: int | None = None, keep_last: int | None = 3,
                 checkpoint_async: bool = False, on_nonfinite: Literal["raise", "skip"] = "raise",
                 max_nonfinite_skips: int = 10, handle_signals: bool = True, enable_telemetry: bool = True,
                 straggler_margin: float = 0.2, tensorboard: bool = False, batch_size: Literal["max"] | None = None,
                 max_memory: int | None = None, lr_scaling: Literal["linear", "sqrt"] | None = None,
                 base_batch_size: int | None = None, lr_warmup_steps: int = 0,
                 limit_train_batches: int | float | None = None, limit_val_batches: int | float | None = None,
                 limit_test_batches: int | float | None = None, limit_predict_batches: int | float | None = None,
                 min_epochs: int | None = None, min_steps: int | None = None, count_flops: bool | None = None,
                 peak_flops: float | None = None,
                 val_check_interval: int | float | str | timedelta | dict | None = None,
                 check_val_every_n_epoch: int | None = 1, num_sanity_val_steps: int = 2,
                 fast_dev_run: bool | int = False, max_time: str | timedelta | dict | None = None,
                 overfit_batches: int | float = 0.0, deterministic: bool | Literal["warn"] | None = None,
                 enable_model_summary: bool = True, use_distributed_sampler: bool = True,
                 reload_dataloaders_every_n_epochs: int = 0, detect_anomaly: bool = False,
                 benchmark: bool | None = None, barebones: bool = False, inference_mode: bool = True) -> None:
        """The Runtime's flags (accelerator, devices, strategy, num_nodes, precision, timeout, strategy_options,
        sync_batchnorm, activation_checkpointing, compile, float32_matmul_precision, parallel, tp_plan, parallelize,
        pp_schedule, pp_microbatches, pp_split_points) are described in ``Runtime.__init__``; the loop's are fields of
        :class:`~trainscale.loop.config.TrainerConfig` with these types, defaults and descriptions
        (tests/test_trainer_config.py keeps them equal).

        Args:
            callbacks: a list of :class:`trainscale.callbacks.Callback` (every record holds the learning rates without
                one).
            logger: one or a list of ``trainscale.loggers`` (None: a ``CSVLogger``; False: none; docs/loggers.md).
            runtime: the Runtime a "ddp_spawn"/"ddp_notebook" rank made from the same flags (None: one is made here).
            profiler: "simple", "advanced", "pytorch" or a ``trainscale.profilers.Profiler`` (Lightning's flag; None:
                none). It times the regions ``train_step`` names (``with prof.profile(...)``) during ``fit``; its
                report at the end of ``fit``; "pytorch" writes a Chrome trace per rank into the run directory.
            plugins: Lightning's flag: None or an empty list. A plugin object is a ``ValueError`` naming the flag that
                does its work here (a precision plugin: ``precision``; ``TorchSyncBatchNorm``: ``sync_batchnorm``) or
                why there is none (cluster environments are read from the launcher; checkpoints are the strategy's).
            max_epochs: epochs to train (>= 0; -1: no limit). None (the default): no limit when ``max_steps`` or
                ``max_time`` is set (Lightning's rule); 1000 with a warning when only ``min_epochs``/``min_steps`` is
                (Lightning's default); else 1 (Lightning: 1000 with a warning).
            max_steps: stop after this many optimizer steps (0: no training; None or -1: no limit; resolved to None).
            accumulate_grad_batches: micro-batches per optimizer step (gradients all-reduced on the last only); a
                schedule by epoch is the ``GradientAccumulationScheduler`` callback's (a dict here is refused).
            gradient_clip_val: clip the total gradient norm (or each value: ``gradient_clip_algorithm="value"``).
            gradient_clip_algorithm: "norm" (clip the total gradient norm to ``gradient_clip_val``) or "value" (clip
                each gradient value to it).
            seed: at the start of each ``fit``, Python's ``random``, numpy and torch (CPU and every CUDA device) are
                seeded with it on every rank alike (``trainscale.seed_everything``), before the model is set up (a model
                built on the meta device is initialised from it); the training samplers shuffle epoch ``e`` with ``seed
                + e``. None (the default): the seed of the script's last ``seed_everything(n)`` (Lightning's
                ``PL_GLOBAL_SEED``), else 0, so runs repeat unless it is changed. A model built before ``fit`` takes its
                initial weights from the script's own random state: seed before building it. A resumed run restores each rank's
                saved RNG states instead.
            default_root_dir: runs are written to ``default_root_dir/version_N`` (None: ``runs``, the default).
            log_every_n_steps: optimizer steps between step records (one host sync and, with telemetry, one all_gather
                of a small tensor each).
            enable_progress_bar: a tqdm bar on rank zero.
            enable_checkpointing: checkpoint at each epoch end.
            checkpoint_every_n_steps: also checkpoint every N optimizer steps, mid-epoch, with the exact position.
            keep_last: checkpoints kept on disk besides "last" (None keeps all). With ``enable_checkpointing`` and
                ``checkpoint_every_n_steps`` it configures the default :class:`~trainscale.callbacks.ModelCheckpoint`,
                added when the user's callbacks hold none.
            checkpoint_async: write the epoch-end and ``checkpoint_every_n_steps`` checkpoints in the background
                (torch's ``async_save``; sharded strategies only: fsdp, model_parallel, hsdp, tp): the loop waits only
                while the state is copied to host memory; each is published ("last" moved to it) once written, at a
                later step or the end of ``fit`` (``checkpointing/writes.py``; docs/fault-tolerance.md).
            on_nonfinite: "raise" (a non-finite loss raises at the next check, about a second of steps later and at most
                ``log_every_n_steps`` apart, naming step, epoch and rank) or "skip" (skip optimizer steps whose
                gradients are not finite; more than ``max_nonfinite_skips`` in a row raise).
            max_nonfinite_skips: under ``on_nonfinite="skip"``, more than this many skipped steps in a row raise.
            handle_signals: on SIGTERM/SIGUSR1 checkpoint at the next check (about a second of steps later), requeue a
                SLURM job (SIGUSR1) and exit with ``trainscale.faults.tolerance.Preempted``; a rank that cannot get
                there exits 20 s after SIGTERM with its stacks (docs/fault-tolerance.md).
            enable_telemetry: measure the step-phase split, throughput, MFU, memory, GPU utilisation and stragglers
                (docs/telemetry.md).
            straggler_margin: a rank computing this fraction longer than the median (step time less exposed
                communication) is a straggler.
            tensorboard: add a ``TensorBoardLogger()`` to the loggers (``trainscale[tensorboard]``).
            batch_size: "max" rebuilds the training DataLoader with the largest per-device batch that trains on every
                rank (``trainscale.tune.batch_size``); None keeps the loader's.
            max_memory: the bytes each rank's step may peak at in the ``batch_size="max"`` search (required on CPU).
            lr_scaling: "linear" (SGD; Goyal et al. 2017) or "sqrt" (Adam/AdamW; Malladi et al. 2022): every step uses
                each param group's lr × the rule's factor of global batch / ``base_batch_size`` (the global batch size
                the learning rates were tuned at); None: unscaled.
            base_batch_size: the global batch size the learning rates were tuned at (what ``lr_scaling`` scales from).
            lr_warmup_steps: ramp ``lr_scaling``'s factor linearly from 1 to its value over this many optimizer steps
                (Goyal et al.'s warm-up; 0: none). See :mod:`trainscale.scaling.batch_scaling`.
            limit_train_batches: train on at most this many micro-batches per epoch (an int >= 1), or on this fraction
                of them (a float in (0, 1], at least one batch), as Lightning's flag; None: all (:meth:`train_batches`);
                0 (or 0.0): no training, as Lightning's: ``fit`` runs its sanity check and hooks but no epoch, as with
                ``max_steps=0``. A whole float above 1 (10.0) is a count (10), as Lightning's; this holds for the
                other limits, ``overfit_batches`` and ``val_check_interval`` too.
            limit_val_batches: as ``limit_train_batches``, for each rank's validation batches in ``fit`` and
                ``validate``; 0 (or 0.0): no validation (nor sanity check) in ``fit``, none in ``validate``.
            limit_test_batches: as ``limit_train_batches``, for ``test``; 0 (or 0.0) turns it off, as Lightning's:
                its ``setup``/``teardown`` hooks run, no loader is asked for, it returns ``[]``.
            limit_predict_batches: as ``limit_test_batches``, for ``predict`` (returning None when 0).
            min_epochs: a stop asked by a callback (``trainer.should_stop``, e.g. ``EarlyStopping``) waits until this
                many epochs are done, as Lightning's (None: no minimum).
            min_steps: as ``min_epochs``, in optimizer steps.
            count_flops: count the FLOPs of the run's first micro-batch with ``FlopCounterMode`` for MFU (None: on CUDA
                only, never under ``compile``).
            peak_flops: FLOP/s of one device for MFU (None: the table of ``trainscale.telemetry.flops``).
            val_check_interval: when to validate, as Lightning: an int N validates after every N-th training batch
                (micro-batch) of the epoch (with ``check_val_every_n_epoch=None``: of the run, across epochs; it may
                then exceed an epoch's batches), a float in (0, 1] after every ``int(batches × f)``-th (at least 1);
                None (= 1.0): at each epoch end; a duration ("DD:HH:MM:SS", a ``datetime.timedelta`` or a dict of its
                keywords, Lightning 2.6) after the first optimizer step that ends once that much training time has
                passed since training began or validation last ended, by rank zero's clock (an epoch's end validates
                only when that time is up). Validation runs at the end of the optimizer step that holds that batch (with
                ``accumulate_grad_batches`` > 1, Lightning validates mid-step), before the step's checkpoints, so a
                checkpoint written there resumes exactly.
            check_val_every_n_epoch: validate only in every N-th epoch (None: by ``val_check_interval`` alone, which
                must then be an int, counting the run's batches, or a duration).
            num_sanity_val_steps: validation batches run before training (Lightning's sanity check, default 2; -1: all; 0:
                none), with ``trainer.sanity_checking`` True; its results are not recorded, ``callback_metrics`` and the
                random states are as before it. A resumed fit runs it after a completed epoch, not mid-epoch nor with
                ``max_steps`` set (Lightning 2.6).
            fast_dev_run: True or an int N (True = 1): N batches of training (``max_steps=N``, one epoch), validation,
                test and predict, no sanity check, and nothing written: no run directory, checkpoint, logger or record
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
            enable_model_summary: print a :class:`~trainscale.callbacks.ModelSummary` (layers, parameters, size) on rank
                zero at the start of ``fit``, unless the callbacks hold one (Lightning's default).
            use_distributed_sampler: True: on several data-parallel ranks the training loader gets trainscale's
                distributed sampler (each rank its share, each sample once per epoch, resumable mid-epoch), in the
                loader's own order: shuffled when it shuffled, sequential (with a warning: Lightning shuffles it) when not.
                False: the training loader is used as given on every rank (Lightning's meaning: your sampler decides
                what each rank reads; a mid-epoch resume then skips the batches done, on the same world size).
            reload_dataloaders_every_n_epochs: N > 0: at the start of every N-th epoch since the loaders were made, ask the
                data hooks (``train_dataloader()``, ``val_dataloader()`` of the data module or the model; not ``setup``)
                for new loaders, as Lightning's; loaders passed to ``fit`` stay. 0: never.
            detect_anomaly: run ``fit`` under ``torch.autograd.set_detect_anomaly(True)`` (Lightning's flag): a backward
                that produces NaN names the forward operation that made it, with its traceback; much slower, for
                debugging. The previous mode is restored when ``fit`` ends, also on an error.
            benchmark: the value ``torch.backends.cudnn.benchmark`` is set to in ``Trainer()`` (Lightning's flag: True
                lets cuDNN try its convolution algorithms for each input shape and keep the fastest); None: False with
                ``deterministic``, else left as it is.
            barebones: Lightning's mode for measuring the loop's own overhead: no checkpoints, progress bar, model
                summary, sanity check, telemetry, loggers or profiler, nothing written (no run directory), and
                ``self.log`` ignored with a warning; ``fast_dev_run``, ``detect_anomaly``, ``checkpoint_every_n_steps``,
                ``tensorboard``, a ``num_sanity_val_steps`` other than 0 (or the default), a ``logger`` or a
                ``profiler`` with it are a ``ValueError``, as in Lightning.
            inference_mode: Lightning's flag: ``validate``, ``test``, ``predict`` and ``fit``'s validation run under
                ``torch.inference_mode()`` (True) or ``torch.no_grad()`` (False: tensors made there can later enter
                autograd, and ``torch.enable_grad()`` inside a step works). As Lightning's, ``no_grad`` in either case on
                a gloo process group and under strategies whose forward runs collectives (fsdp, hsdp, tp, pp:
                pytorch/pytorch#95957).

        Raises:
            TypeError: a misspelt flag (naming the closest one; type checkers refuse it too).
            ValueError: any bad flag, raised on every rank before a process group is created.
        """
        runtime_flags = dict(
            accelerator=accelerator, devices=devices, strategy=strategy, num_nodes=num_nodes, precision=precision,
            timeout=timeout, strategy_options=strategy_options, sync_batchnorm=sync_batchnorm,
            activation_checkpointing=activation_checkpointing, compile=compile,
            float32_matmul_precision=float32_matmul_precision, parallel=parallel, tp_plan=tp_plan,
            parallelize=parallelize, pp_schedule=pp_schedule, pp_microbatches=pp_microbatches,
            pp_split_points=pp_split_points)
        loop_flags = dict(
            max_epochs=max_epochs, max_steps=max_steps, accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm, seed=seed,
            default_root_dir=default_root_dir, log_every_n_steps=log_every_n_steps,
            enable_progress_bar=enable_progress_bar, enable_checkpointing=enable_checkpointing,
            checkpoint_every_n_steps=checkpoint_every_n_steps, keep_last=keep_last, checkpoint_async=checkpoint_async,
            on_nonfinite=on_nonfinite, max_nonfinite_skips=max_nonfinite_skips, handle_signals=handle_signals,
            enable_telemetry=enable_telemetry, straggler_margin=straggler_margin, tensorboard=tensorboard,
            batch_size=batch_size, max_memory=max_memory, lr_scaling=lr_scaling, base_batch_size=base_batch_size,
            lr_warmup_steps=lr_warmup_steps, limit_train_batches=limit_train_batches,
            limit_val_batches=limit_val_batches, limit_test_batches=limit_test_batches,
            limit_predict_batches=limit_predict_batches, min_epochs=min_epochs, min_steps=min_steps,
            count_flops=count_flops, peak_flops=peak_flops, val_check_interval=val_check_interval,
            check_val_every_n_epoch=check_val_every_n_epoch, num_sanity_val_steps=num_sanity_val_steps,
            fast_dev_run=fast_dev_run, max_time=max_time, overfit_batches=overfit_batches, deterministic=deterministic,
            enable_model_summary=enable_model_summary, use_distributed_sampler=use_distributed_sampler,
            reload_dataloaders_every_n_epochs=reload_dataloaders_every_n_epochs, detect_anomaly=detect_anomaly,
            benchmark=benchmark, barebones=barebones, inference_mode=inference_mode)
        self.flags = dict(runtime_flags, **loop_flags, callbacks=callbacks, logger=logger,
                          profiler=profiler)  # a ddp_spawn rank rebuilds the Trainer from them
        check_plugins(plugins)
        self.profiler = resolve_profiler(profiler)  # Lightning's trainer.profiler
        self.config = resolve_trainer_config(**loop_flags)
        logger = barebones_logger(self.config, logger, profiler, callbacks)
        set_torch_flags(self.config.deterministic, self.config.benchmark)
        self.batch_scaling = BatchScaling(self.config)
        self.callbacks = resolve_callbacks(callbacks, self._default_checkpoint(), self.config.enable_checkpointing,
                                           self.config.max_time)  # max_time: a Timer, as Lightning's
        bars = [cb for cb in self.callbacks if isinstance(cb, TQDMProgressBar)]
        if bars and not self.config.enable_progress_bar:  # Lightning refuses the same
            raise ValueError(f"Trainer(enable_progress_bar=False) with a {type(bars[0]).__name__} in callbacks; drop "
                             "one of the two")
        # Lightning's trainer.progress_bar_callback: the one given, or the default bar's settings (None: no bar)
        self.progress_bar_callback = next(iter(bars), TQDMProgressBar() if self.config.enable_progress_bar else None)
        if self.progress_bar_callback is not None:
            self.progress_bar_callback.trainer = self  # its total_*_batches read this Trainer (Lightning's bar too)
        if self.config.enable_model_summary and not any(isinstance(cb, ModelSummary) for cb in self.callbacks):
            self.callbacks.append(ModelSummary())  # Lightning's default, unless the user gave one
        # the ModelCheckpoint callbacks: the user's, or the default one; asked at every step end (_checkpoint_if_due);
        # none under fast_dev_run, which writes nothing (Lightning's ModelCheckpoint skips it too)
        self.checkpoint_callbacks: list[ModelCheckpoint] = [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)
                                                            and self.config.writes_files]
        # on every rank, so a bad value fails everywhere; set up and called on rank zero (MetricsProcessor)
        self._loggers = resolve_loggers(logger, tensorboard=self.config.tensorboard,
                                        fast_dev_run=bool(self.config.fast_dev_run))
        # ``runtime``: the one Runtime.launch made for a ddp_spawn rank, built from the same flags
        self.runtime = runtime if runtime is not None else Runtime(**runtime_flags)
        say_one_batch_limits(self.config, self.runtime.is_rank_zero)  # an int 1 and a float 1.0 differ, as Lightning
        _say_debug_modes(self.config, self.runtime.is_rank_zero)
        self.checkpoints = CheckpointWrites(self.runtime, self.config, self.log_metrics)  # checkpoint_async
        self.count_flops = resolve_count_flops(self.config.count_flops, self.runtime.device.type,
                                               self.runtime.config.compile is not None)
        if not self.runtime.spawns:  # under ddp_spawn, fit/validate start the processes
            self.runtime.launch()
        self.state = TrainState()
        self.run_dir: Path | None = None
        self.fit_seed: int | None = None  # the seed of the last fit (Trainer(seed=...), else seed_everything's, else 0)
        self.datamodule: Any = None  # the data module of the last fit (Lightning's trainer.datamodule)
        # Lightning's trainer.ckpt_path: the checkpoint the running (or last) fit resumed from, or validate/test/predict
        # evaluated, as a str (None: none)
        self.ckpt_path: str | None = None
        # the latest number of each name (epoch records, logs): floats, and step values as device tensors until read
        self._callback_metrics: dict[str, float | torch.Tensor] = {}
        self.should_stop = False  # set by a callback (EarlyStopping, Timer: max_time): stop, on every rank
        self.fitting = False  # True during fit (Lightning's trainer.state.fn == "fit"); validate() after it: False
        self.validated_at: list[int] = []  # global steps at which the last fit validated (sanity check excluded)
        # this rank's batches of each loader of the last test() and predict() (Lightning's lists), set as they start
        self.num_test_batches: list[int | float] = []
        self.num_predict_batches: list[int | float] = []
        # the loaders of the running or last stage as its loop reads them, in the form given (a loader, a list, a
        # dict): "train" and "val" of fit, "val" of validate, "test", "predict"; emptied as each stage starts
        # (Lightning's attach_dataloaders); read as trainer.train_dataloader, val_dataloaders, ...
        self.stage_dataloaders: dict[str, Any] = {}
        self._signals: Any = None  # the running or last fit's SignalWatch (trainer.received_sigterm); None in others
        # trainer.max_epochs: as given until a fit starts (None when not given), as Lightning's fit_loop.max_epochs
        self._max_epochs = self.flags["max_epochs"]
        # the sample indices of each batch predict() has read, per loader (empty where the loader has none: an
        # IterableDataset), as Lightning's predict_loop.epoch_batch_indices; BasePredictionWriter reads them
        self.predict_batch_indices: list[list[list[int]]] = []
        self.optimizers: list = []
        self.schedulers: list = []
        self.manual_optimizers: list[ManualOptimizer] = []
        self.metric_collector = MetricCollector(self.runtime, "train")
        self._pending: dict[str, dict[str, float]] = {}  # log_metrics() values for the next "step" or "epoch" record
        self._fit: FitRun | None = None
        # the module of the last fit, for validate/test/predict without one (also in the process that started a
        # ddp_spawn fit, whose FitRun was in the ranks)
        self.fitted_module: nn.Module | None = None
        self.last_setup: tuple | None = None  # (model, LoopModule, wrapped) of the last fit or evaluation: reused
        self.is_step_end = False  # in on_train_batch_end: this micro-batch ended an optimizer step
        self._step_before = 0  # global_step before the last optimizer step (is_log_step)
        self._active_hooks = HOOKS  # the hooks someone defines (_arm_hooks); all until a model is set up
        self.batch_transfer: BatchTransfer | None = None  # the module's batch-transfer hooks, if any (_arm_hooks)
        self.running_hook: str | None = None  # the Lightning hook running now: where self.log may log (metrics.py)

    def _default_checkpoint(self) -> ModelCheckpoint | None:
        """The checkpoint callback the Trainer's flags ask for, used when the user gives no ``ModelCheckpoint``."""
        cfg = self.config
        if not (cfg.enable_checkpointing or cfg.checkpoint_every_n_steps):
            return None
        return ModelCheckpoint.trainer_default(1 if cfg.enable_checkpointing else 0, cfg.checkpoint_every_n_steps,
                                               cfg.keep_last)

    global_step = property(lambda self: self.state.global_step, doc="Optimizer steps taken so far (int).")
    current_epoch = property(lambda self: self.state.current_epoch,
                             doc="The epoch running (from 0), or the epochs completed once an epoch has ended "
                                 "(Lightning's: 2 after fit with max_epochs=2; TrainState.current_epoch).")
    history = property(lambda self: self.state.history, doc="One record (a dict) per finished epoch.")
    @property
    def callback_metrics(self) -> dict[str, float | torch.Tensor]:
        """The latest value of each name logged (Lightning's ``trainer.callback_metrics``): epoch values, and the
        training step values as device tensors: in ``fit`` after each optimizer step (and its
        ``on_train_batch_end``), outside a fit as soon as ``self.log`` is called (a ``training_step`` run by hand
        after ``model.trainer = trainer``), as Lightning's; evaluation step values are not, as in Lightning."""
        collector = self.metric_collector
        if collector.unpublished and not self.fitting and collector.stage == "train":  # fit's loop publishes its own
            self._callback_metrics.update(collector.step_metrics())
        return self._callback_metrics

    @callback_metrics.setter
    def callback_metrics(self, values: dict[str, float | torch.Tensor]) -> None:
        self._callback_metrics = values

    # Lightning's views of callback_metrics: the names logged with logger=True (tensors), with prog_bar=True (floats)
    logged_metrics = property(lambda self: logged_metrics(self.callback_metrics, self.metric_collector),
                              doc="The self.log values logged with logger=True (Lightning's; name_step/name_epoch).")
    progress_bar_metrics = property(lambda self: progress_bar_metrics(self.callback_metrics, self.metric_collector),
                                    doc="The self.log values logged with prog_bar=True, as floats (Lightning's).")
    @property
    def lightning_module(self) -> nn.Module | None:
        """The module of the running (or last) fit or evaluation, as the user built it; before any, the one given
        to ``trainer.strategy.connect(module)``, else None (Lightning's ``trainer.lightning_module``: the strategy's)."""
        if self.last_setup is not None:
            return self.last_setup[0]
        return None if self.runtime.strategy is None else self.runtime.strategy.lightning_module

    model = property(lambda self: self.lightning_module,
                     doc="Lightning's ``trainer.model``: here the user's module (:attr:`lightning_module`); Lightning's "
                         "is the strategy's wrapper (``DistributedDataParallel``) around it, where one wraps it.")
    checkpoint_callback = property(lambda self: next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)),
                                                     None),
                                   doc="The first ModelCheckpoint in the callbacks, or None (Lightning's "
                                       "``trainer.checkpoint_callback``; there under fast_dev_run, which saves none).")
    early_stopping_callback = property(lambda self: next(iter(self.early_stopping_callbacks), None),
                                       doc="The first EarlyStopping in the callbacks, or None (Lightning's "
                                           "``trainer.early_stopping_callback``).")
    early_stopping_callbacks = property(lambda self: [cb for cb in self.callbacks if isinstance(cb, EarlyStopping)],
                                        doc="Every EarlyStopping in the callbacks (Lightning's list).")
    # Lightning's names for this process's place in the job (``runtime.world``: trainscale.runtime.world.World)
    global_rank = property(lambda self: self.runtime.world.rank, doc="This process's rank in the job, 0 .. world_size-1.")
    local_rank = property(lambda self: self.runtime.world.local_rank, doc="This process's rank on its node.")
    node_rank = property(lambda self: self.runtime.world.node_rank, doc="The index of this process's node.")
    world_size = property(lambda self: self.runtime.world.world_size, doc="Processes in the job (all nodes).")
    num_nodes = property(lambda self: self.runtime.world.num_nodes, doc="Nodes in the job.")
    is_global_zero = property(lambda self: self.runtime.world.rank == 0, doc="True on rank 0 (Lightning's name).")
    # Lightning's names for the loop's limits and what callbacks read of it
    max_epochs = property(lambda self: 1 if self.config.fast_dev_run else self._max_epochs,
                          doc="Epochs to train; -1: no limit. Not given: None until the first fit starts, then the "
                              "value it resolves to (Lightning's _parse_loop_limits); 1 under fast_dev_run from "
                              "Trainer() on, as Lightning's.")
    max_steps = property(lambda self: -1 if self.config.max_steps is None else self.config.max_steps,
                         doc="Optimizer steps to train; -1: no limit (Lightning's spelling).")
    min_epochs = property(lambda self: self.config.min_epochs, doc="Epochs before a callback may stop the fit.")
    min_steps = property(lambda self: self.config.min_steps, doc="Steps before a callback may stop the fit.")
    num_sanity_val_steps = property(lambda self: self.config.sanity_val_batches,
                                    doc="Validation batches of the sanity check (inf for -1).")
    log_every_n_steps = property(lambda self: self.config.log_every_n_steps,
                                 doc="Optimizer steps between step records (Lightning's attribute).")
    lr_scheduler_configs = property(lambda self: list(self.schedulers),
                                    doc="The schedulers with their interval, frequency and monitor, Lightning's "
                                        "``LRSchedulerConfig`` (``trainscale.utilities.types``), in "
                                        "``configure_optimizers``' order.")

    @property
    def loggers(self) -> list:
        """The loggers, a list (empty without any): Lightning's ``trainer.loggers``. Settable as Lightning's, before a
        fit (its start sets them up): a list or tuple of loggers, or None or ``[]`` for none.

        Raises:
            TypeError: an item that is not a logger (``trainscale.loggers.resolve_loggers``).
            ValueError: the same logger twice."""
        return self._loggers

    @loggers.setter
    def loggers(self, loggers: list | tuple | None) -> None:
        self._loggers = resolve_loggers(list(loggers)) if loggers else []

    @property
    def logger(self) -> Any:
        """The first of :attr:`loggers`, None without any (Lightning's ``trainer.logger``). Setting a logger makes it
        the only one (``loggers == [logger]``); setting None (or False) leaves none."""
        return self._loggers[0] if self._loggers else None

    @logger.setter
    def logger(self, logger: Any) -> None:
        self.loggers = [logger] if logger else []

    @property
    def log_dir(self) -> str | None:
        """Lightning's ``trainer.log_dir`` (a str), where a module or callback writes its own files: the first
        logger's ``log_dir`` (CSV, TensorBoard: ``save_dir/name/version_N``) or ``save_dir`` (W&B, MLflow); without
        a logger, ``default_root_dir``. A logger without a ``save_dir`` (the default ``CSVLogger``) writes into the run
        directory, and ``log_dir`` names it: the last fit's, and before the first fit the one a new fit takes
        (``default_root_dir/version_N``, the next free ``N``; a fit that resumes in place, ``ckpt_path="last"``,
        continues its own run directory instead). None under ``fast_dev_run``/``barebones`` with a logger (nothing is
        written, as Lightning's ``DummyLogger``). Read on each rank, no collective: the same on every rank once
        ``fit`` has chosen the run directory (rank zero's)."""
        run_dir = self.run_dir
        if run_dir is None and self.config.writes_files:
            run_dir = ckpt.next_run_dir(self.config.default_root_dir)  # only listed: the fit claims it (claim_run_dir)
        return trainer_log_dir(self.loggers, run_dir, self.config.default_root_dir)

    fast_dev_run = property(lambda self: self.config.fast_dev_run, doc="The flag as given (False, True or N).")
    received_sigterm = property(
        lambda self: self._signals is not None and self._signals.received_sigterm,
        doc="Whether SIGTERM arrived during the running or last ``fit`` (Lightning's ``trainer.received_sigterm``; "
            "False again as the next stage starts). trainscale watches signals in ``fit`` only (with "
            "``handle_signals=True``, the default): the loop then writes a checkpoint and raises ``Preempted``; "
            "``validate``/``test``/``predict`` leave SIGTERM to Python's handler (False there).")
    barebones = property(lambda self: self.config.barebones,
                         doc="Whether ``Trainer(barebones=True)`` turned off what may slow the loop (Lightning's).")
    limit_train_batches = property(lambda self: self.config.limit_train_batches,
                                   doc="The flag (None: all batches); under ``overfit_batches``, its value.")
    limit_val_batches = property(lambda self: self.config.limit_val_batches, doc="The flag (None: all batches).")
    limit_test_batches = property(lambda self: self.config.limit_test_batches, doc="The flag (None: all batches).")
    limit_predict_batches = property(lambda self: self.config.limit_predict_batches, doc="The flag (None: all).")
    # Lightning's views of flags that callbacks and modules read (self.trainer.gradient_clip_val, ...)
    gradient_clip_val = property(lambda self: self.config.gradient_clip_val, doc="The flag (None: no clipping).")
    gradient_clip_algorithm = property(lambda self: self.config.gradient_clip_algorithm,
                                       doc='"norm" or "value" (Lightning: None until given; trainscale\'s default "norm").')
    check_val_every_n_epoch = property(lambda self: self.config.check_val_every_n_epoch,
                                       doc="The flag (None: by val_check_interval alone).")
    val_check_interval = property(lambda self: 1.0 if self.config.val_check_interval is None
                                  else self.config.val_check_interval,
                                  doc="The flag, 1.0 when not given (Lightning's value: once per epoch); a duration "
                                      "as a timedelta.")
    reload_dataloaders_every_n_epochs = property(lambda self: self.config.reload_dataloaders_every_n_epochs,
                                                 doc="The flag (0: the loaders are built once).")
    overfit_batches = property(lambda self: self.config.overfit_batches, doc="The flag (0.0: off).")
    precision = property(lambda self: self.runtime.config.precision,
                         doc='The precision in Lightning\'s spelling ("32-true", "bf16-mixed", ...), as '
                             "Lightning's trainer.precision.")
    train_dataloader = property(lambda self: self.stage_dataloaders.get("train"),
                                doc="The training loader of the running or last fit as the loop reads it (rebuilt "
                                    "with trainscale's sampler, on one rank too: docs/lightning.md), from the moment "
                                    "it is asked for; None before, and once another stage starts (Lightning's).")
    val_dataloaders = property(lambda self: self.stage_dataloaders.get("val"),
                               doc="The validation loaders of the running or last fit or validate, as the loop reads "
                                   "them, in the form given: the loader alone, or the list (tuple, dict) of them. None "
                                   "until the stage asks for them (fit: its sanity check, else training's start when "
                                   "epoch 0 validates, else the first validation) and once another stage starts, as "
                                   "Lightning's.")
    enable_validation = property(lambda self: self._fit is not None and self._fit.validates,
                                 doc="Whether the running or last fit validates (Lightning's: it has validation "
                                     "loaders or a val_dataloader() hook, a validation_step, limit_val_batches > 0).")
    test_dataloaders = property(lambda self: self.stage_dataloaders.get("test"),
                                doc="The test loaders of the running or last test(), as :attr:`val_dataloaders`.")
    predict_dataloaders = property(lambda self: self.stage_dataloaders.get("predict"),
                                   doc="The loaders of the running or last predict(), as :attr:`val_dataloaders`.")
    default_root_dir = property(lambda self: str(self.config.default_root_dir),
                                doc="The flag as a path string (``runs`` when not given; Lightning's: the working "
                                    "directory); each fit's run directory is a ``version_N`` in it.")
    is_last_batch = property(lambda self: self._fit is not None and self.state.batches == self._fit.epoch_batches,
                             doc="Whether the training batch just run is its epoch's last (Lightning's attribute, "
                                 "read in on_train_batch_end); an IterableDataset's last is known only once its "
                                 "iterator has ended, so it is False there.")
    interrupted = property(lambda self: self.state.status == TrainerStatus.INTERRUPTED,
                           doc="Whether the last fit, validate, test or predict ended in an exception (Lightning's "
                               "``trainer.interrupted``).")

    # Lightning's views of trainer.state.stage (TrainState.stage), each settable as Lightning's
    training = _stage_flag(RunningStage.TRAINING, "True in fit, except while it validates or runs the sanity check.")
    sanity_checking = _stage_flag(RunningStage.SANITY_CHECKING,
                                  "True while the sanity check runs (num_sanity_val_steps).")
    validating = _stage_flag(RunningStage.VALIDATING, "True while validate() runs, and while fit validates.")
    testing = _stage_flag(RunningStage.TESTING, "True while test() runs.")
    predicting = _stage_flag(RunningStage.PREDICTING, "True while predict() runs.")
    evaluating = property(lambda self: self.state.stage is not None and self.state.stage.evaluating,
                          doc="True while a validation (the sanity check's too) or a test runs (Lightning's).")

    @property
    def device_ids(self) -> list[int]:
        """The indexes of the devices this node's ranks use, as Lightning's: ``[0, ..., devices - 1]``; with one
        device, its index (0 on a CPU)."""
        devices = self.runtime.config.devices
        return [self.runtime.device.index or 0] if devices == 1 else list(range(devices))

    num_devices = property(lambda self: len(self.device_ids), doc="Devices per node (Lightning's: len(device_ids)).")

    @property
    def strategy(self) -> Any:
        """Lightning's ``trainer.strategy``: the Runtime's :class:`~trainscale.runtime.strategies.base.Strategy`, from
        ``Trainer()`` on, with Lightning's public members (``root_device``, ``barrier``, ``broadcast``, ``reduce``,
        ``all_gather``, ``is_global_zero``, ``world_size``, ``global_rank``, ``local_rank``, ``model``,
        ``lightning_module``).

        Raises:
            AttributeError: in the process that starts a "ddp_spawn"/"ddp_notebook" job, whose strategy exists in
                the ranks ``fit``/``validate``/``test``/``predict`` start."""
        if self.runtime.strategy is None:
            raise AttributeError(f"trainer.strategy of strategy={self.runtime.flags.strategy!r} exists in the ranks that "
                                 "fit/validate/test/predict start, not in this process: read it there (in a hook, "
                                 "self.trainer.strategy)")
        return self.runtime.strategy

    @property
    def num_training_batches(self) -> int | float:
        """Training micro-batches of this rank's epoch, after ``limit_train_batches``/``overfit_batches`` (Lightning's
        attribute; inf before ``fit`` has its training loader and for an iterable data set until its iterator ends)."""
        fit = self._fit
        if fit is None:
            return math.inf
        # before the first epoch counts them (from configure_optimizers on): the loader's, limited
        batches = fit.epoch_batches or self.config.train_batches(evaluation.loader_length(fit.train_loader))
        return int(batches) if batches != math.inf else batches

    @property
    def estimated_stepping_batches(self) -> int | float:
        """Optimizer steps the whole ``fit`` will take, as Lightning's (``trainer.estimated_stepping_batches``): with
        ``max_epochs=-1``, ``max_steps`` (inf without it); else ``ceil(num_training_batches / accumulate_grad_batches)
        × max(max_epochs, 1)``, at most ``max_steps`` (``num_training_batches``: this rank's share of the loader, after
        ``limit_train_batches``); for an iterable data set ``max_steps`` (-1 without it, Lightning's value). Under a
        ``GradientAccumulationScheduler`` the sum over the epochs of each one's steps (:meth:`accumulate_for`;
        Lightning divides every epoch by the factor in force when it is read). Readable
        from ``configure_optimizers`` on: ``OneCycleLR(opt, max_lr, total_steps=self.trainer.estimated_stepping_batches)``.

        Raises:
            RuntimeError: read before ``fit`` has its training loader (``configure_optimizers`` is the first place)."""
        cfg = self.config
        if cfg.max_epochs == -1:
            return math.inf if cfg.max_steps is None else cfg.max_steps
        if self._fit is None:
            raise RuntimeError("trainer.estimated_stepping_batches needs the training loader of a fit: read it from "
                               "configure_optimizers or a hook of fit (self.trainer.estimated_stepping_batches)")
        batches = self.num_training_batches
        if batches == math.inf:  # an iterable data set: its epochs' length is unknown
            return self.max_steps
        steps = sum(math.ceil(batches / self.accumulate_for(epoch)) for epoch in range(max(cfg.max_epochs, 1)))
        return steps if cfg.max_steps is None else min(steps, cfg.max_steps)

    @property
    def num_val_batches(self) -> list[int | float]:
        """Validation batches per validation run of this rank in ``fit``, one per loader (Lightning's list; empty
        without validation or before ``fit``)."""
        loaders = self._fit.val_loader if self._fit is not None else None
        return [] if loaders is None else [self.config.val_batches(evaluation.loader_length(dl)) for dl in loaders]

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step: the training loader's ``batch_size`` × data-parallel ranks ×
        :attr:`accumulate_grad_batches` (the epoch's); None before fit, and for a loader without a fixed batch size."""
        fit = self._fit
        return None if fit is None else global_batch_size(fit.train_loader, self.runtime, self.accumulate_grad_batches)

    @property
    def accumulate_grad_batches(self) -> int:
        """Micro-batches per optimizer step, as Lightning's attribute: the flag until a fit's first epoch starts, then
        the epoch's (:meth:`accumulate_for`, which a ``GradientAccumulationScheduler`` answers), kept after the fit."""
        fit = self._fit
        return fit.accumulate if fit is not None and fit.accumulate else self.config.accumulate_grad_batches

    @accumulate_grad_batches.setter
    def accumulate_grad_batches(self, value: int) -> None:
        """Refused: the loop asks :meth:`accumulate_for` at each epoch start, so a value set from a hook (as
        Lightning's callback sets it) would hold for part of an epoch only. Raises AttributeError naming the fix."""
        raise AttributeError(
            f"trainer.accumulate_grad_batches = {value!r}: trainscale reads the factor at each epoch's start; pass "
            "Trainer(accumulate_grad_batches=k), or callbacks=[GradientAccumulationScheduler(scheduling={epoch: k})] "
            "to change it by epoch")

    def accumulate_for(self, epoch: int) -> int:
        """Micro-batches per optimizer step in (0-based) ``epoch``: the ``GradientAccumulationScheduler``'s factor
        when the callbacks hold one, else the ``accumulate_grad_batches`` flag. The one answer to the question: the
        loop asks it at each epoch start (:meth:`_train_epoch`, on every rank alike; a resumed epoch asks again, so
        the factor is never saved), :attr:`estimated_stepping_batches` for every epoch."""
        scheduler = next((cb for cb in self.callbacks if isinstance(cb, GradientAccumulationScheduler)), None)
        return self.config.accumulate_grad_batches if scheduler is None else scheduler.get_accumulate_grad_batches(epoch)

    @property
    def is_log_step(self) -> bool:
        """True right after an optimizer step whose step record is written: every ``log_every_n_steps`` optimizer
        steps; under manual optimization every ``log_every_n_steps`` training batches that took a step, as
        Lightning counts them there (``_batches_that_stepped``: two optimizers stepping on each batch log every N
        batches, not every N/2)."""
        n = self.config.log_every_n_steps
        if self.manual_optimizers:
            return self.is_step_end and self.state.global_step != self._step_before and self.batches_that_stepped % n == 0
        return self.reached_multiple(n)

    @property
    def batches_that_stepped(self) -> int:
        """What Lightning's step records count (``fit_loop.epoch_loop._batches_that_stepped``): optimizer steps, and
        under manual optimization training batches, however many optimizer steps each took."""
        return self.state.total_batches if self.manual_optimizers else self.state.global_step

    def reached_multiple(self, n: int) -> bool:
        """True right after an optimizer step that brought ``global_step`` to a multiple of ``n`` (Lightning's
        ``global_step % n == 0``; under manual optimization a ``training_step`` that took no step reaches none)."""
        step = self.state.global_step
        return self.is_step_end and step != self._step_before and step % n == 0

    def log_metrics(self, metrics: dict[str, float], epoch: bool = False) -> None:
        """Add numbers to the next step record (or, ``epoch=True``, to this epoch's record)."""
        self._pending.setdefault("epoch" if epoch else "step", {}).update(metrics)

    # -- fit ----------------------------------------------------------------------------------------
    def fit(self, model: nn.Module, train_dataloaders: torch.utils.data.DataLoader | None = None,
            val_dataloaders: torch.utils.data.DataLoader | None = None, *, loss_fn: Callable | None = None,
            optimizer: Callable | torch.optim.Optimizer | None = None, ckpt_path: str | Path | None = None,
            ckpt_verify: bool = True, datamodule: Any = None, weights_only: bool | None = None) -> dict:
        """Train ``model``; validate and checkpoint at each epoch end (or as ``val_check_interval``,
        ``check_val_every_n_epoch`` and the ``ModelCheckpoint`` say). Returns the run summary (``summary.json``).

        ``model``: a plain ``nn.Module`` (``(inputs, targets)`` batches, ``loss_fn``, default cross-entropy) or
        one with ``training_step``. ``train_dataloaders``: a DataLoader with the per-device ``batch_size``; its sampler
        is replaced by a distributed one (None: ``datamodule``'s or the model's ``train_dataloader()``, asked for in
        Lightning's order: ``lightning/data_sources.py``, ``FitSources``). ``val_dataloaders``: a DataLoader or a
        list, tuple or dict of them (on one data-parallel rank any iterable), evaluated on all ranks, each sample
        once. ``optimizer``: a factory
        ``params -> Optimizer`` (built after the strategy wraps the model) or None for ``configure_optimizers()``;
        either may return any of Lightning's forms. ``ckpt_path``: a checkpoint, "last" (this script's newest
        run under ``default_root_dir``; a warning and a fresh start when there is none) or None; resuming a
        run's newest checkpoint continues its directory, any other starts a new ``version_N``. After a
        torchrun restart or a SLURM requeue, None resumes this job's "last". ``ckpt_verify=False`` loads a
        checkpoint whose ``.sha256`` is missing (refused by default). Under "ddp_spawn"/"ddp_notebook" the body
        runs in processes started here and rank 0's weights are loaded back into ``model``. ``weights_only``
        (Lightning's): a checkpoint is always read with ``torch.load(weights_only=True)``; what an
        ``on_save_checkpoint`` hook or a callback's ``state_dict`` saved that such a load refuses (an object of a
        class of your own) is kept apart in it, pickled, and ``weights_only=False`` unpickles it back into the
        checkpoint the ``on_load_checkpoint`` hooks and the callbacks' ``load_state_dict`` see (it runs pickled
        code: only for a checkpoint you trust); without it such a checkpoint is refused before anything is restored.
        ``validate``/``test``/``predict`` take it too and read only the weights, which never need it.

        Raises:
            FileNotFoundError / CheckpointError: a missing or corrupted ``ckpt_path``, or one holding pickled
                entries without ``weights_only=False``.
            ValueError / TypeError: a bad model, optimizer, loader or batch, named with its fix.
            trainscale.runtime.hangs.CollectiveTimeout: a collective timed out or a peer crashed.
            trainscale.faults.tolerance.NonFiniteLossError, trainscale.faults.tolerance.Preempted: docs/fault-tolerance.md.
        """
        if self.runtime.spawns:
            with self._on_exception():  # the ranks' error, raised here: this process's callbacks hear of it too
                return run_spawned(self, "fit", model, train_dataloaders=train_dataloaders,
                                   val_dataloaders=val_dataloaders, loss_fn=loss_fn, optimizer=optimizer,
                                   ckpt_path=ckpt_path, ckpt_verify=ckpt_verify, datamodule=datamodule,
                                   weights_only=weights_only)
        attach_trainer(model, self)  # self.trainer inside the module's setup(stage), as Lightning
        # Lightning's state from here: in configure_callbacks, setup and the data hooks too
        self.state.status, self.state.fn, self.training = TrainerStatus.RUNNING, TrainerFn.FITTING, True
        with self._interrupted_on_error():
            self.start_stage(model)
            sources = FitSources(model, train_dataloaders, val_dataloaders, datamodule)  # its checks before any hook
            self.datamodule = sources.datamodule
            prepare_stage(self.runtime, sources.datamodule, model, "fit", lambda: self.set_up_callbacks(model, "fit"))
        cfg = self.config
        self._fit, self._run_lock = None, RunLock()  # the run directory's lock: taken by _run_fit, released below
        self._faults = FaultTolerance(self.runtime, cfg.on_nonfinite, cfg.max_nonfinite_skips, cfg.log_every_n_steps,
                                      cfg.handle_signals)
        self._signals = self._faults.signals
        self.fitting = True
        try:
            # Lightning's detect_anomaly: on for the fit, the previous mode back after it (also on an error)
            with torch.autograd.set_detect_anomaly(True) if cfg.detect_anomaly else contextlib.nullcontext():
                summary = self._run_fit(model, sources, loss_fn, optimizer, ckpt_path, (ckpt_verify, weights_only))
            self.state.status = TrainerStatus.FINISHED
            return summary
        except BaseException as err:
            self._exception_hooks(err)
            explained = explain_batch_error(err) or self._faults.diagnose(
                err, f"at epoch {self.current_epoch}, step {self.global_step}")
            if explained is None:
                raise
            raise explained from err
        finally:
            self.fitting, self.state.stage = False, None
            self.profiler.describe()  # its report (and files), as Lightning's teardown, also after an error
            self._faults.stop()
            self._run_lock.release()
            for cb in self.checkpoint_callbacks:
                cb.release_directory()  # its dirpath's lock
            if self._fit is not None and self._fit.metrics is not None:  # fit raised (finish_run closed it otherwise)
                self._fit.metrics.close("failed")
            # self._fit stays: save_checkpoint() after fit writes the fitted state

    def _run_fit(self, model, sources: FitSources, loss_fn, optimizer, ckpt_path, reading) -> dict:
        """``fit``'s body; ``sources``: where its loaders come from; ``reading``: ``(ckpt_verify, weights_only)``, how
        ``ckpt_path`` is read."""
        rt, cfg = self.runtime, self.config
        resume_from, in_place = resolve_ckpt_path(rt, ckpt_path, cfg.default_root_dir)
        self.ckpt_path = as_ckpt_path(resume_from)
        self.metric_collector.drop_values()  # nothing logged before this fit counts in it
        warn_default_max_epochs(cfg, self.flags["max_epochs"], rt.is_rank_zero)
        self._max_epochs = cfg.max_epochs  # trainer.max_epochs: resolved from here on, as Lightning's
        drop_unpicklable(getattr(model, "hparams", None), warn=rt.is_rank_zero)  # Lightning's clean_namespace
        fit, asked_first = self._start_fit(model, sources, loss_fn, optimizer)
        _warn_eval_mode(fit.model, rt.is_rank_zero)  # it trains in the modes it comes in, as Lightning
        point = self._load(resume_from, *reading) if resume_from is not None else None
        if point is not None:  # saved at a validation's end: that step's ReduceLROnPlateau update is made now
            self._make_pending_plateau_update(fit, point)
        fit.loaded_epoch = point.next_epoch if point else 0
        self._take_asked_first(fit, asked_first)
        self.batch_scaling.attach(rt, fit.train_loader, self.optimizers,
                                  functools.partial(getattr, self, "global_step"))  # picklable
        if cfg.writes_files:  # fast_dev_run, barebones: no run directory, records, loggers or checkpoints
            self.run_dir, self._run_lock = choose_run_dir(rt, cfg.default_root_dir, resume_from, in_place)  # held by fit
            agree_log_dirs(self.loggers, self.run_dir, rt.broadcast_object, rt.is_rank_zero)  # rank zero's versions
            self._faults.start(self.run_dir)
        for cb in self.checkpoint_callbacks:
            cb.setup_directory(self)
        # the one output path: metrics.jsonl and the loggers, written by rank zero
        fit.metrics = MetricsProcessor(fit.telemetry, self.metric_collector,
                                       self.run_dir if rt.is_rank_zero and cfg.writes_files else None, self.loggers,
                                       hyperparams(self, model), model)
        # the header's global batch: that of the first epoch to train (fit.loaded_epoch, whose loader this is)
        rt.print(run_header(rt, global_batch_size(fit.train_loader, rt, self.accumulate_for(fit.loaded_epoch)),
                            self.run_dir if cfg.writes_files else f"none ({cfg.why_no_files})"))
        self.validated_at = []
        self.profiler.setup("fit", rt.rank if rt.world_size > 1 else None, self.run_dir)  # its files: the run dir
        self._hook("on_fit_start")
        model.zero_grad()  # Lightning's _run_stage frees the gradients before each stage runs
        self._sanity_check(fit, point)
        started = time.monotonic()  # training's start, for a time-based val_check_interval
        fit.validate_at = started + cfg.val_check_seconds
        self._ask_val_before_training(fit)
        self._hook("on_train_start")
        for epoch in itertools.count(point.next_epoch if point else 0):
            if self._fit_done(epoch):
                break
            self._train_epoch(fit, epoch, point if point is not None and point.resumes(epoch) else None)
            self._end_epoch(fit, epoch)
        self.checkpoints.wait()  # a background checkpoint write still in flight is published
        self._hook("on_train_end")
        summary = finish_run(self, fit, self.global_batch_size, resume_from, self._faults.skipped)  # the last epoch's
        self._hook("on_fit_end")
        evaluation.teardown(self, model, "fit")  # the data module's, the callbacks', the module's (Lightning's order)
        return summary

    def _fit_done(self, epoch: int) -> bool:
        """Whether ``fit`` ends before epoch ``epoch`` (0-based): ``max_epochs`` trained, ``max_steps`` reached, a
        stop asked by a callback once ``min_epochs``/``min_steps`` are met (Lightning's ``_FitLoop.done``), or no
        training at all (``limit_train_batches=0``: Lightning's ``_FitLoop.skip``)."""
        cfg = self.config
        return (epoch >= cfg.epoch_limit or self.state.global_step >= cfg.step_limit or cfg.limit_train_batches == 0
                or self._stop_now(epoch))

    def _stop_now(self, epochs_done: int) -> bool:
        """Whether a stop asked by a callback (``should_stop``) may happen now, after ``epochs_done`` epochs: when
        ``min_epochs``/``min_steps`` hold it back, Lightning's note says so, once per fit (INFO, rank zero)."""
        if not self.should_stop:
            return False
        cfg = self.config
        if cfg.can_stop(epochs_done, self.global_step):
            return True
        if not self._fit.held_back_said and self.runtime.is_rank_zero:
            log_info(_log, f"Trainer was signaled to stop but the required `min_epochs={cfg.min_epochs!r}` or "
                           f"`min_steps={cfg.min_steps!r}` has not been met. Training will continue...")
        self._fit.held_back_said = True
        return False

    def _setup(self, model, loss_fn, optimizer, train_dataloaders) -> FitRun:
        rt = self.runtime
        if isinstance(model, TrainingModule) and not is_overridden("training_step", model):  # Lightning's check
            raise ValueError("No `training_step()` method defined. Lightning `Trainer` expects as minimum a "
                             "`training_step()`, `train_dataloader()` and `configure_optimizers()` to be defined: "
                             f"define {type(model).__name__}.training_step(self, batch, batch_idx) returning the loss")
        refuse_dataloader_iter(model, ("training_step", "validation_step"))
        self.last_setup = set_up_model(rt, model, loss_fn, self.last_setup)  # reused from an earlier fit or evaluation
        _, loop_module, wrapped = self.last_setup
        self._arm_hooks(model)
        # the loader first, so that configure_optimizers can read estimated_stepping_batches (as Lightning's loads it)
        train_loader = self._distribute_train(train_dataloaders)
        self._fit = fit = FitRun(model, loop_module, wrapped, train_loader, None, None, datamodule=self.datamodule)
        self.fitted_module = model
        with self._running("configure_optimizers"):
            self.optimizers, self.schedulers, self.manual_optimizers = build_optimizers(
                model, wrapped, optimizer, self.config, rt, scaled_lr=self.batch_scaling.scaled_lr,
                before_step=lambda opt: self._hook("on_before_optimizer_step", opt))
        # FLOPs are counted on a plain forward and backward only: the user's manual training_step steps optimizers
        # (a retry after a failed count would step them twice) and a pipeline stage holds part of the model (and
        # its schedule's sends must not run twice); there MFU comes from the model's declared FLOPs, if any
        counted = self.count_flops and not self.manual_optimizers and not rt.strategy.pipelined
        telemetry = create_telemetry(rt, self.config.enable_telemetry, count_flops=counted,
                                     peak_flops=self.config.peak_flops, straggler_margin=self.config.straggler_margin)
        telemetry.attach(wrapped)  # its parameter count and declared FLOPs per token, for MFU
        if self.config.enable_telemetry and rt.world_size > 1:  # DDP's gradient all-reduce, timed by a comm hook
            telemetry.comm_timed = rt.strategy.time_allreduce(wrapped, telemetry.clock, telemetry.record_comm)
        fit.telemetry = telemetry
        return fit

    def _start_fit(self, model, sources: FitSources, loss_fn, optimizer) -> tuple[FitRun, tuple | None]:
        """The fit's loaders asked for in Lightning's order, and its objects (:meth:`_setup`). Lightning's sanity check
        asks for the validation loaders before training asks for its own, so when that check will run they are
        asked first (:meth:`_sanity_val`), returned as ``(loaders,)`` for :meth:`_take_asked_first`; else (None)
        training's first, validation's when it first validates (:meth:`_ask_val`). Then ``batch_size="max"``
        (``tuned_loader``) and the fit's seed."""
        rt, cfg = self.runtime, self.config
        validates = self._fit_validates(model, sources)
        asked_first = (self._sanity_val(sources),) if validates and cfg.sanity_val_batches != 0 else None
        train_dataloaders = tuned_loader(rt, cfg, model, loss_fn, optimizer, sources.train())
        self.fit_seed = seed_generators(fit_seed(cfg.seed))  # Trainer(seed=...), else seed_everything's, else 0
        fit = self._setup(model, loss_fn, optimizer, train_dataloaders)
        fit.sources, fit.validates = sources, validates
        return fit, asked_first

    def _take_asked_first(self, fit: FitRun, asked_first: tuple | None) -> None:
        """The validation loaders :meth:`_start_fit` asked for first, set up once the checkpoint (if any) has set the
        epoch: that asking counts as the epoch's only when the epoch validates (Lightning's
        ``_last_val_dl_reload_epoch``, for ``reload_dataloaders_every_n_epochs``)."""
        if asked_first is None:
            return
        epoch = self.current_epoch
        fit.val_asked_epoch = epoch if self.config.validates_in(epoch) else -math.inf
        fit.val_loader = self._distribute_val(asked_first[0])

    def _fit_validates(self, model: nn.Module, sources: FitSources) -> bool:
        """Whether this fit validates (Lightning's ``trainer.enable_validation``, with its checks and warnings:
        ``data_checks.validation_to_run``)."""
        return validation_to_run(model, getattr(model, "training_step", None) is not None, sources.has_val,
                                 self.config.limit_val_batches, warn=self.runtime.is_rank_zero)

    def _sanity_val(self, sources: FitSources) -> EvalLoaders | None:
        """The validation loaders asked for as Lightning's sanity check asks: ``trainer.sanity_checking`` True in
        ``val_dataloader()``, the random state put back after it (so that ``train_dataloader()`` sees the state it
        would see alone: two data sets drawn alike are the same)."""
        saved, stage = rng_state(), self.state.stage
        self.sanity_checking = True
        try:
            return sources.val()
        finally:
            self.state.stage = stage
            set_rng_state(saved)

    def _distribute_train(self, train_dataloaders: Any) -> Any:
        """The training loader as the loop reads it (``trainer.train_dataloader``): this rank's share
        (``Runtime.setup_dataloader``), or the loader as given with ``use_distributed_sampler=False``; checked, and
        Lightning's warning when an epoch holds fewer batches than ``log_every_n_steps``."""
        rt, cfg = self.runtime, self.config
        check_train_loader_type(train_dataloaders)
        if cfg.overfit_batches:  # the same first batches every epoch, in order (Lightning's, with its warning)
            train_dataloaders = overfit_order(train_dataloaders, "train", warn=rt.is_rank_zero)
        if not cfg.use_distributed_sampler:  # Lightning's flag: the loader as given, on every rank
            train_loader = train_dataloaders
        else:
            if rt.is_rank_zero and not cfg.overfit_batches:
                warn_unshuffled(train_dataloaders, rt.data_parallel_size)  # Lightning would shuffle it
            train_loader = rt.setup_dataloader(train_dataloaders, seed=self.fit_seed)
        check_loaders(train_loader, None)
        if seeds_workers():  # seed_everything(..., workers=True), as Lightning's pl_worker_init_function
            _seed_workers((train_loader,), (train_dataloaders,), rt.rank)
        if rt.is_rank_zero:
            warn_few_batches(cfg.train_batches(evaluation.loader_length(train_loader)), cfg.log_every_n_steps,
                             bool(self.loggers) and not cfg.fast_dev_run)
        self.stage_dataloaders["train"] = train_loader
        return train_loader

    def _distribute_val(self, val_dataloaders: EvalLoaders | None) -> list | None:
        """The validation loaders as the loop reads them (each rank's share: ``evaluation.eval_loader``), checked;
        ``trainer.val_dataloaders`` holds them in the form given. None for none."""
        rt = self.runtime
        if val_dataloaders is None:
            self.stage_dataloaders["val"] = None
            return None
        given = ([overfit_order(dl, "val", warn=rt.is_rank_zero) for dl in val_dataloaders]
                 if self.config.overfit_batches else val_dataloaders)
        val_loader = [evaluation.eval_loader(rt, dl, self.fit_seed) for dl in given]
        check_loaders(None, val_loader)
        if seeds_workers():
            _seed_workers(tuple(val_loader), tuple(given), rt.rank)
        self.stage_dataloaders["val"] = val_dataloaders.in_given_form(val_loader)
        return val_loader

    def _ask_val(self, fit: FitRun) -> None:
        """Lightning's ``_EvaluationLoop.setup_data`` in ``fit``: the validation loaders asked for (``FitSources.val``)
        when validation first needs them (training's start, when its epoch validates; else the first validation),
        and again from the data hooks under ``reload_dataloaders_every_n_epochs=N``: in the first validation of an
        epoch N or more epochs after the one they were last asked in (the sanity check's asking counts only when
        epoch 0 validates: Lightning's ``_last_val_dl_reload_epoch``)."""
        every, epoch = self.config.reload_dataloaders_every_n_epochs, self.current_epoch
        if fit.val_asked_epoch is not None and not (every and fit.sources.val_hooked
                                                    and epoch - fit.val_asked_epoch >= every):
            return
        fit.val_asked_epoch = epoch
        fit.val_loader = self._distribute_val(fit.sources.val())

    def _ask_val_before_training(self, fit: FitRun) -> None:
        """Lightning's ``_FitLoop.on_run_start``: when the first epoch to train validates, its validation loaders are
        asked for before ``on_train_start`` (if not already), so that the progress bar knows their batches."""
        if fit.validates and self.config.validates_in(self.current_epoch):
            self._ask_val(fit)

    def _reload_train(self, fit: FitRun, epoch: int) -> None:
        """Lightning's ``reload_dataloaders_every_n_epochs`` for training: at the start of every N-th epoch since the
        training loader was last made, ask ``train_dataloader()`` (not ``setup``) for a new one. A loader passed to
        ``fit`` is the same object again, so nothing changes. (Validation's: :meth:`_ask_val`.)"""
        every = self.config.reload_dataloaders_every_n_epochs
        if not fit.sources.train_hooked or not every or epoch - fit.loaded_epoch < every:
            return
        fit.train_loader = self._distribute_train(fit.sources.train())
        fit.loaded_epoch = epoch

    # -- one epoch ----------------------------------------------------------------------------------
    def _train_epoch(self, fit: FitRun, epoch: int, resume: ResumePoint | None) -> None:
        rt, cfg = self.runtime, self.config
        self.state.epoch, self.state.epoch_ended = epoch, False
        fit.accumulate = self.accumulate_for(epoch)  # this epoch's micro-batches per optimizer step
        self._reload_train(fit, epoch)
        batches = epoch_batches(fit, self.state, epoch, resume, rt.world_size, cfg.train_batches)
        remaining = fit.epoch_batches - fit.epoch_offset  # inf: an iterable data set, until its iterator ends
        fit.bar = epoch_bar(self.progress_bar_callback, rt.is_rank_zero, remaining, epoch_label(epoch, cfg.max_epochs))
        fit.epoch_loss = EpochLoss(rt.device, resume.totals if resume else (0.0, 0.0, 0.0, 0.0), rt)
        fit.books = MicroBatchBooks(fit.telemetry, self._faults, self.state, self.metric_collector, fit.epoch_loss,
                                    fit.bar)
        fit.started = perf_counter() - (resume.totals[-1] if resume else 0.0)
        fit.validated_after = -1
        if fit.validates and cfg.validates_in(epoch):
            cfg.val_check_batch(fit.epoch_batches)  # a val_check_interval the epoch cannot hold fails here
        with self.metric_collector.epoch_hook():
            self._hook("on_train_epoch_start")
        fit.telemetry.start()
        # prefetch moves each batch ahead of its step; the module's batch-transfer hooks move it in the step instead
        ahead = rt.prefetch(batches) if self.batch_transfer is None else batches
        steps = micro_batches(ahead, fit.accumulate, remaining, start=fit.epoch_offset)
        while self.state.global_step < cfg.step_limit and not self._stop_now(epoch) and self.train_step(fit, steps):
            pass
        if fit.epoch_batches == math.inf and self.state.global_step < cfg.step_limit:  # the iterator ended the epoch
            fit.epoch_batches = self.state.batches
        fit.bar.close()

    def train_step(self, fit: FitRun, steps: Iterator[MicroBatch]) -> bool:
        """One optimizer step over its micro-batches, every effect of it named here in order, with Lightning's
        hooks where Lightning calls them (each callback's, then the module's: :meth:`_hook`). False when the
        epoch had no micro-batch left.

        1. Each micro-batch: to the device (through the module's ``on_before_batch_transfer``,
           ``transfer_batch_to_device`` and ``on_after_batch_transfer`` where it overrides one, as Lightning;
           decided once per stage: :attr:`batch_transfer`), ``on_train_batch_start``; at the step's first
           micro-batch ``on_before_zero_grad`` and ``zero_grad(set_to_none=True)`` (the module's
           ``optimizer_zero_grad``), so the last step's gradients are freed before this forward
           and were there until then, as in Lightning (``on_train_batch_end`` reads them); forward under autocast,
           backward of the loss ÷ micro-batches per step (the module's ``backward`` hook when it has one) between
           ``on_before_backward`` and ``on_after_backward``; the gradient
           all-reduce (ddp) or reduce-scatter (fsdp) runs on the step's last micro-batch only
           (``no_backward_sync``). Under pp one schedule step does forward and backward; under manual
           optimization the module's ``training_step`` does it all, stepping its own optimizers (the backward
           and step hooks run in ``manual_backward`` and ``step()``). A ``training_step`` that returns None
           under automatic optimization has no backward (Lightning's skip, with its warning; on several ranks
           Lightning's error). ``on_train_batch_end`` after each micro-batch that does not end the step.
        2.-4. In :meth:`_optimizer_step`, through the module's ``optimizer_step`` hook (Lightning's, its
           closure running 2 and 3):
        2. ``on_before_optimizer_step`` (after the GradScaler's unscale under "16-mixed", as in Lightning),
           then clipping (DTensor-aware under fsdp/tp/pp; the module's ``configure_gradient_clipping``).
        3. Non-finite gradients: skipped with ``on_nonfinite="skip"`` (one host sync); with "raise" the
           losses are checked at the agreed check steps in step 6, without a host sync per step.
        4. The optimizer step at the learning rate scaled to the global batch (``lr_scaling``, this step
           only), through the GradScaler under "16-mixed".
        5. The learning-rate schedulers other than ``ReduceLROnPlateau``, each through the module's
           ``lr_scheduler_step`` (Lightning's default: ``scheduler.step()``; under manual optimization the module
           steps its own, as in Lightning): those with ``interval="step"`` (their ``frequency`` counts the epoch's
           batches, as Lightning's), and after the epoch's last batch those
           with ``interval="epoch"``, so before that batch's ``on_train_batch_end`` and checkpoints, as Lightning's;
           the step count (under manual optimization, the optimizer steps the ``training_step`` took); the step's
           ``self.log`` values into ``callback_metrics`` (device tensors, no host sync); ``on_train_batch_end``; the
           step record every ``log_every_n_steps``.
        6. Validation when ``val_check_interval`` and ``check_val_every_n_epoch`` say it is due within the epoch
           (its last batch validates in ``_end_epoch``; a time-based interval, by rank zero's clock, after any
           step); then the ``interval="step"`` ``ReduceLROnPlateau`` schedulers, on the values this step and its
           validation logged (Lightning's order); then faults and checkpoints (:meth:`_checkpoint_if_due`):
           signals and the non-finite check at the steps every rank agreed on, a checkpoint every
           ``checkpoint_every_n_steps``. (``max_time`` is a ``Timer`` callback: out of time at its
           ``on_train_batch_end``, it sets ``should_stop`` and the epoch ends after this step.)

        The profiler's regions (``Trainer(profiler=...)``; a no-op context without one) are the ``prof.profile``
        blocks below: ``training_step_and_backward`` (each micro-batch), ``optimizer_step``, ``log_step``,
        ``validation`` and ``checkpoint_if_due``.

        The collectives, by part (every rank issues the same ones at the same step; trainscale issues no others,
        the user's hooks may): 1. the gradient all-reduce (ddp: the backward of the step's last micro-batch; and the
        broadcast of a module's buffers in each forward, DDP's ``broadcast_buffers``), or the parameters'
        all-gathers and the gradients' reduce-scatter (fsdp: forward and backward); pp's sends and receives.
        2. clipping's all-reduce of the total norm of sharded (DTensor) gradients (fsdp, tp; pp across stages).
        3. "skip" without clipping: the same norm's all-reduce (fsdp, tp). 4. "16-mixed" under pp: the
        GradScaler's all-reduce of its inf/NaN flag (``ShardedGradScaler``); L-BFGS on several ranks: the all-reduce
        of the loss at each call of its closure, and 1. and 2. again at each later call. 5. at log steps: telemetry's
        ``all_gather_single`` of every rank's interval, then sync_dist's all-reduce of a flag per rank and, when
        some value has ``sync_dist=True``, an ``all_gather_object`` of their names and the all-reduce of the values.
        6. validation's reductions; at the agreed check steps the fault check's all-reduce (a second one when a
        loss is not finite); a checkpoint's barrier and writes; on several ranks a broadcast of rank zero's clock with
        a time-based ``val_check_interval`` (and the ``Timer``'s of ``max_time``, in ``on_train_batch_end``).
        """
        rt, cfg, tele, prof = self.runtime, self.config, fit.telemetry, self.profiler  # prof: Trainer(profiler=...)
        self.is_step_end = False
        first_batch = self.state.batches  # this step's first micro-batch in the epoch
        # 1. Forward and backward, micro-batch by micro-batch.
        for micro in steps:
            if self.batch_transfer is None:
                batch = rt.to_device(micro.batch)  # on CUDA already there: prefetch copied it while the last step ran
            else:  # the module's on_before_batch_transfer, transfer_batch_to_device, on_after_batch_transfer
                batch = self.batch_transfer(micro.batch, 0)
            fit.books.batch_ready(batch)  # the data phase ends; samples and tokens (self.log's batch size)
            if self._hook("on_train_batch_start", batch, micro.index) == -1:  # the module's -1: the epoch ends here
                return self._skip_rest_of_epoch(fit, micro)
            if micro.index == first_batch and not self.manual_optimizers:  # the step's first: zero the gradients
                # the last step's, there until now as in Lightning; freed before this forward (Lightning: after it)
                self._zero_grad(fit, self.optimizers[0], micro.index)
            with prof.profile("training_step_and_backward"):  # its end advances PyTorchProfiler's schedule
                if tele.counting_flops:  # the run's first micro-batch: its FLOPs counted once, for MFU
                    loss, t_forward = tele.count_flops_of(lambda: self._forward_backward(fit, batch, micro), fit.wrapped,
                                                          batch)
                else:
                    loss, t_forward = self._forward_backward(fit, batch, micro)
            # None: the training_step returned nothing (manual), or skipped its backward (automatic; one process)
            loss = None if loss is None else loss.detach()
            fit.books.backward_done(loss, t_forward)  # phases, epoch loss sum, non-finite watch, progress bar
            if micro.is_last:
                break
            if "on_train_batch_end" in self._active_hooks:  # outputs: Lightning's dict (built only for a hook)
                self._hook("on_train_batch_end", batch_end_outputs(fit.loop_module.step_output, loss), batch,
                           micro.index)
        else:
            return False
        # 2.-4. The hook before the step, clipping, the "skip" check, the step (automatic optimization).
        grad_norm = None if self.manual_optimizers else self._optimizer_step(fit, loss, batch, micro)
        tele.end_step()  # the "optimizer" phase ends
        # 5. Schedulers, the step count, callbacks, the step record.
        if not self.manual_optimizers:  # through the module's lr_scheduler_step; ReduceLROnPlateau ones later
            # "frequency" counts the epoch's batches (micro.index + 1), as Lightning's (not the optimizer steps)
            step_schedulers(self.schedulers, "step", micro.index + 1, self.callback_metrics,
                            fit.loop_module.lr_scheduler_step, plateau=False)
            if micro.ends_epoch:  # the epoch's batches all seen: its "epoch" schedulers too (Lightning's order)
                fit.epoch_rates = fit.metrics.learning_rates(self.optimizers, self.schedulers)  # its record's rates
                step_schedulers(self.schedulers, "epoch", self.current_epoch + 1, self.callback_metrics,
                                fit.loop_module.lr_scheduler_step, plateau=False)
        self._step_before = self.state.global_step
        self.state.global_step += sum(o.take_steps() for o in self.manual_optimizers) if self.manual_optimizers else 1
        self.is_step_end = True
        self.callback_metrics.update(self.metric_collector.step_metrics())  # every step, on the device (Lightning's)
        if "on_train_batch_end" in self._active_hooks:  # outputs: Lightning's dict; then what that hook logged
            self._hook("on_train_batch_end", batch_end_outputs(fit.loop_module.step_output, loss), batch, micro.index)
            self.callback_metrics.update(self.metric_collector.step_metrics())
        if self.is_log_step:  # the step record: reduced across the ranks, then written once to each destination
            with prof.profile("log_step"):
                # collectives: telemetry's all_gather_single of every rank's interval; sync_dist's all-reduces
                own, user = fit.metrics.reduce_across_ranks(self.global_step, self.current_epoch, loss, grad_norm,
                                                            self.optimizers, self.schedulers)
                record = {**own, **user, **self._pending.pop("step", {})}
                self._publish(fit.loop_module.plain_model, {k: v for k, v in record.items() if isinstance(v, float)}, user)
                shown = ("train_loss", *sorted(self.metric_collector.prog_bar))  # the progress bar's postfix
                fit.bar.set_postfix(**{k: f"{record[k]:.4g}" for k in shown if k in record})
                fit.metrics.write(record)  # metrics.jsonl and each logger
        # 6. Validation, signals, the non-finite check and checkpoints, when due; the time limit.
        fit.plateau_pending = micro.index + 1  # a checkpoint at validation's end holds the plateau update below
        if self._validation_due(fit, first_batch):  # a broadcast of rank zero's clock, with a time-based interval
            with prof.profile("validation"):
                self._validate(fit, mid_epoch=True)
        if not self.manual_optimizers:  # step-interval ReduceLROnPlateau: on this step's and validation's values
            step_schedulers(self.schedulers, "step", micro.index + 1, self.callback_metrics,
                            fit.loop_module.lr_scheduler_step, plateau=True)
        fit.plateau_pending = None
        with prof.profile("checkpoint_if_due"):  # at the check steps the ranks agreed on: one all-reduce (faults)
            self._checkpoint_if_due(fit, epoch_end=False, ends_epoch=micro.ends_epoch)
        return True

    def _optimizer_step(self, fit: FitRun, loss: torch.Tensor, batch: Any, micro: MicroBatch) -> torch.Tensor | None:
        """Parts 2 to 4 of :meth:`train_step` under automatic optimization, through Lightning's hook
        ``optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)`` (the module's own, or its default
        ``optimizer.step(closure=optimizer_closure)``): the closure runs 2 and 3 (Lightning's ``_after_closure``; the
        step's forward and backward ran before it, where Lightning runs them in it), ``optimizer.step()`` (a
        :class:`StepOptimizer`) runs 4. An optimizer that calls the closure again within its step (L-BFGS) has each
        later call zero the gradients and run the step's forward and backward again first
        (:meth:`_evaluate_again`), then 2; on several ranks L-BFGS gets the ranks' mean loss at each call (one
        all-reduce of a number), as the gradients are. Returns the gradient norm clipping measured (None: not clipped
        by norm, or clipped by the module's own ``configure_gradient_clipping``).

        Raises:
            ValueError: the module's ``optimizer_step`` returned without running the closure (neither it nor
                ``optimizer.step(closure=...)`` called it), so no hook or clipping ran: Lightning's error, its words.
        """
        rt, cfg, model, hooks = self.runtime, self.config, fit.model, fit.loop_module.step_hooks
        optimizer, found = self.optimizers[0], {"grad_norm": None, "skip": False, "calls": 0}
        batch_idx = micro.index

        def closure() -> torch.Tensor:
            found["calls"] += 1  # the first call's loss and gradients are the step's; later ones evaluate again
            value = loss if found["calls"] == 1 else self._evaluate_again(fit, optimizer, batch, micro)
            if rt.world_size > 1 and isinstance(optimizer, torch.optim.LBFGS):  # its tests read the loss: the ranks'
                value = rt.all_reduce(value.clone(), op="mean")  # mean, so every rank takes the same path (ddp)
            # 2. The hook before the step (on unscaled gradients), then clip.
            rt.precision.unscale_gradients(optimizer)  # "16-mixed" only; once per step (the step skips its own)
            self._hook("on_before_optimizer_step", optimizer)
            if "configure_gradient_clipping" in hooks:  # the module's own: it clips as it likes (its norm unknown)
                model.configure_gradient_clipping(optimizer, gradient_clip_val=cfg.gradient_clip_val,
                                                  gradient_clip_algorithm=cfg.gradient_clip_algorithm)
            elif cfg.gradient_clip_val is not None:
                found["grad_norm"] = self.clip_gradients(optimizer, cfg.gradient_clip_val, cfg.gradient_clip_algorithm)
            # 3. Skip a step whose gradients are not finite ("skip" mode; decided before the step, so on the first call)
            if found["calls"] == 1:
                found["skip"] = cfg.on_nonfinite == "skip" and self._faults.skip_step(
                    fit.wrapped, optimizer, found["grad_norm"], step=self.global_step, epoch=self.current_epoch)
            return value

        def take_step(evaluate: Callable[[], Any] | None, **kwargs: Any) -> None:
            # 4. Step at the scaled learning rate (the optimizer may call evaluate: the closure's result, then again).
            if not found["skip"]:
                with self.batch_scaling.scaled_lr(optimizer), self.profiler.profile("optimizer_step"):
                    rt.precision.optimizer_step(optimizer, evaluate, **kwargs)  # the GradScaler's under "16-mixed"

        stepper = StepOptimizer(optimizer, take_step)
        if "optimizer_step" in hooks:
            model.optimizer_step(self.current_epoch, batch_idx, stepper, closure)
            if not found["calls"]:  # no hook, no clipping ran: Lightning's Closure.consume_result refuses it
                raise ValueError("The closure hasn't been executed. HINT: did you call `optimizer_closure()` in your "
                                 "`optimizer_step` hook? It could also happen because the "
                                 "`optimizer.step(optimizer_closure)` call did not execute it internally.")
        else:
            stepper.step(closure=closure)
        return found["grad_norm"]

    def _evaluate_again(self, fit: FitRun, optimizer: torch.optim.Optimizer, batch: Any,
                        micro: MicroBatch) -> torch.Tensor:
        """A later call of the step's closure by an optimizer that evaluates the loss several times per step
        (``torch.optim.LBFGS``; it moved the weights in between): ``on_before_zero_grad`` and the module's
        ``optimizer_zero_grad`` (or ``zero_grad(set_to_none=True)``), then the step's batch forward and backward again
        (:meth:`_forward_backward`, with its hooks and, under ddp, the gradient all-reduce), as Lightning's closure
        runs ``training_step``, ``zero_grad`` and ``backward`` at each call. Returns the new loss, detached.

        Raises:
            ValueError: the step accumulated the gradients of several micro-batches (``accumulate_grad_batches``
                > 1): one batch evaluated again would mix its new gradients with the others' old ones.
            ValueError: ``training_step`` returned None at this evaluation: the optimizer needs a loss.
        """
        if micro.group_size > 1:
            raise ValueError(
                f"{type(optimizer).__name__} evaluated the loss again within its step (it calls the closure several "
                f"times, as torch.optim.LBFGS does), but this step accumulated the gradients of {micro.group_size} "
                f"batches (accumulate_grad_batches={self.accumulate_grad_batches}): evaluating one batch again "
                "would mix its new gradients with the others' old ones. Use accumulate_grad_batches=1 with this "
                "optimizer (a larger batch_size gives the same batch per step)")
        self._zero_grad(fit, optimizer, micro.index)  # Lightning's closure zeroes before each backward
        loss, _ = self._forward_backward(fit, batch, micro)
        if loss is None:
            raise ValueError(f"training_step returned None while {type(optimizer).__name__} evaluated the loss again "
                             "within its step: an optimizer that calls the closure needs a loss at each call; return "
                             "the loss (a tensor) from training_step")
        return loss.detach()

    def _zero_grad(self, fit: FitRun, optimizer: torch.optim.Optimizer, batch_idx: int) -> None:
        """Lightning's zeroing under automatic optimization: ``on_before_zero_grad(optimizer)``, then the module's
        ``optimizer_zero_grad(epoch, batch_idx, optimizer)`` where it overrides it, else
        ``optimizer.zero_grad(set_to_none=True)`` (the gradients freed, not filled with zeros). :meth:`train_step`
        calls it at each step's first micro-batch, :meth:`_evaluate_again` before each later evaluation."""
        self._hook("on_before_zero_grad", optimizer)
        if "optimizer_zero_grad" in fit.loop_module.step_hooks:
            fit.model.optimizer_zero_grad(self.current_epoch, batch_idx, optimizer)
        else:
            optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float,
                       gradient_clip_algorithm: str = "norm") -> torch.Tensor | None:
        """Clip the gradients of the fit's model (``optimizer``'s, unscaled first under "16-mixed") by their total
        norm ("norm", over all shards under fsdp/tp) or each value ("value"), as ``Trainer(gradient_clip_val=...)``
        does (``Runtime.clip_gradients``; ``TrainingModule.clip_gradients`` under automatic optimization). Returns
        the norm before clipping (a 0-d tensor, no host sync), None by value.

        Raises:
            ValueError: a value <= 0, or an algorithm other than "norm" and "value"."""
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"`gradient_clip_algorithm` {gradient_clip_algorithm} is invalid. Allowed algorithms: "
                             "'norm', 'value'")
        by_norm = gradient_clip_algorithm == "norm"
        return self.runtime.clip_gradients(self.last_setup[2], optimizer,  # the wrapped model of this fit
                                           max_norm=gradient_clip_val if by_norm else None,
                                           clip_val=None if by_norm else gradient_clip_val)

    def _skip_rest_of_epoch(self, fit: FitRun, micro: MicroBatch) -> bool:
        """The module's ``on_train_batch_start`` returned -1 for ``micro``'s batch: the epoch ends before it, as
        Lightning's (``training_epoch_loop.advance``): no ``training_step`` or ``on_train_batch_end`` for it, no
        optimizer step (for the gradients of the step's earlier micro-batches either); under automatic optimization
        the due "step" schedulers step (though no optimizer stepped: Lightning's order) and the "epoch" ones, as after
        an epoch's last batch. The epoch counts as whole (``trainer.is_last_batch``; its "epoch" ``ReduceLROnPlateau``
        schedulers step after ``on_train_epoch_end``) and ends without its validation, which Lightning runs only after
        a batch that trained. Returns False, :meth:`train_step`'s "no more batches"."""
        fit.epoch_batches = self.state.batches  # the batches trained: the epoch is complete there
        fit.validated_after = self.state.batches  # so _validates_at_epoch_end runs none, as Lightning's
        if not self.manual_optimizers:
            step_schedulers(self.schedulers, "step", micro.index + 1, self.callback_metrics,
                            fit.loop_module.lr_scheduler_step, plateau=False)
            fit.epoch_rates = fit.metrics.learning_rates(self.optimizers, self.schedulers)  # the epoch record's rates
            step_schedulers(self.schedulers, "epoch", self.current_epoch + 1, self.callback_metrics,
                            fit.loop_module.lr_scheduler_step, plateau=False)
        return False

    def _forward_backward(self, fit: FitRun, batch: Any, micro: MicroBatch) -> tuple[torch.Tensor, Any]:
        """One micro-batch's forward under autocast and backward (between the ``on_before_backward(loss)`` and
        ``on_after_backward`` hooks), without the gradient all-reduce before the step's last micro-batch; one
        pipeline schedule step (pp: ``on_after_backward`` only, the loss is known once the schedule has run); or
        the user's manual ``training_step``. Returns the loss and the clock reading between forward and backward."""
        rt, tele = self.runtime, fit.telemetry
        if self.manual_optimizers:  # the user's training_step steps the optimizers itself
            with rt.precision.autocast():
                return fit.loop_module.manual_step(batch, micro.index), tele.clock()
        if rt.strategy.pipelined:  # forward and backward in one pipeline schedule step ("pp")
            loss = rt.forward_backward(fit.wrapped, batch, fit.loop_module.loss_fn, micro.group_size, micro.is_last)
            self._hook("on_after_backward")
            return loss, tele.clock()
        with rt.strategy.no_backward_sync(fit.wrapped, enabled=not micro.is_last):
            with rt.precision.autocast():
                loss = fit.wrapped(batch, micro.index)
            t_forward = tele.clock()
            if loss is None:  # training_step returned None: no backward for this micro-batch (Lightning's skip)
                skip_backward(rt.world_size)  # on several ranks an error: the others' all-reduce would wait for it
                return None, t_forward
            scaled = loss / micro.group_size if micro.group_size > 1 else loss
            self._hook("on_before_backward", scaled)  # the loss backward receives, as Lightning's closure passes it
            # scaled by the GradScaler under "16-mixed"; the module's backward hook when it has its own
            rt.precision.backward(scaled, fit.model.backward if "backward" in fit.loop_module.step_hooks else None)
            self._hook("on_after_backward")
        return loss, t_forward

    def _publish(self, plain_model: bool, values: dict, user: dict, collector: MetricCollector | None = None) -> None:
        """``callback_metrics`` from a record, as tensors (a float becomes a CPU tensor; a tensor stays where it is),
        as Lightning's. A module with Lightning's steps (``training_step``, ...) finds there only what it logged
        through ``self.log`` (``user``; a value logged on_step and on_epoch also under its bare name, by
        ``collector``, the Trainer's by default): nothing of trainscale's records (``step``, ``samples_per_s``,
        its own ``train_loss``, a returned ``val_x``), as in Lightning. A plain model and loss (``plain_model``),
        which cannot log, finds trainscale's metrics among the record's ``values``: the training loss
        (``train_loss``) and the evaluation results (``val_loss``, ``val_acc``, ``test_*``), where
        ``EarlyStopping(monitor="val_loss")`` finds them; not the throughput, times, step or learning rates."""
        if plain_model:
            chosen = {k: v for k, v in values.items() if k == "train_loss" or k.startswith(("val_", "test_"))}
        else:
            chosen = (collector or self.metric_collector).with_bare_names(user)
        self.callback_metrics.update((k, v if isinstance(v, torch.Tensor) else torch.tensor(float(v)))
                                     for k, v in chosen.items())

    # -- epoch end and checkpoints -------------------------------------------------------------------
    def _end_epoch(self, fit: FitRun, epoch: int) -> None:
        """The epoch record, validation (with its hooks), ``on_train_epoch_end`` in Lightning's order (the
        callbacks that monitor a metric after the module's hook, so that they see what it logged: Lightning's
        ``fit_loop.on_advance_end``), the "epoch" ``ReduceLROnPlateau`` schedulers (automatic optimization only; the
        others stepped after the epoch's last step: :meth:`train_step`), the record written, then the epoch-end check
        and checkpoints."""
        rt = self.runtime
        self._faults.phase = "epoch end (loss all-reduce, validation)"
        rates = fit.epoch_rates or fit.metrics.learning_rates(self.optimizers, self.schedulers)  # before "epoch" ones
        fit.epoch_rates = None
        own = epoch_record(epoch, self.global_step, fit.epoch_loss.totals(rt), perf_counter() - fit.started,
                           complete=self.state.batches >= fit.epoch_batches, rates=rates)
        if rt.world_size > 1:  # the sync_dist step values of the epoch's last steps, reduced (a collective)
            self._publish(fit.loop_module.plain_model, {}, self.metric_collector.take_step_values())
        user = self.metric_collector.take_epoch_values()
        record = {**own, **user}
        if fit.validates and self._validates_at_epoch_end(fit, epoch):
            with self.profiler.profile("validation"):
                record.update(self._validate(fit, mid_epoch=False))
        record.update(self._pending.pop("epoch", {}))
        self._publish(fit.loop_module.plain_model, record, user)
        with self.metric_collector.epoch_hook():
            self._hook("on_train_epoch_end", monitoring=False)
        late = self.metric_collector.take_epoch_values()  # what the module's on_train_epoch_end logged
        self.metric_collector.reset_metrics()  # torchmetrics Metrics, after the epoch end hooks (Lightning's)
        record.update(late)
        user.update(late)
        self._publish(fit.loop_module.plain_model, record, user)
        self._hook("on_train_epoch_end", monitoring=True)
        # the "epoch" ReduceLROnPlateau schedulers, on what the epoch logged (the others stepped after its last
        # step); under manual optimization the module steps its schedulers; an epoch cut short (max_steps, max_time)
        # steps none, as Lightning's steps them only once the epoch's batches were all seen (_num_ready_batches_reached)
        if not self.manual_optimizers and self.state.batches >= fit.epoch_batches:
            step_schedulers(self.schedulers, "epoch", epoch + 1, self.callback_metrics,
                            fit.loop_module.lr_scheduler_step, plateau=True)
        self.state.history.append(record)
        fit.metrics.write({"kind": "epoch", "rank": "all", "time": time.time(), **record})
        rt.print(epoch_line(record, self.config.max_epochs))
        self._checkpoint_if_due(fit, epoch_end=True)
        self.state.epoch_ended = True  # current_epoch counts it from here, as Lightning's after on_advance_end
        self._faults.phase = STEP_PHASE

    def _validation_due(self, fit: FitRun, first_batch: int) -> bool:
        """Whether validation runs after the optimizer step that trained the epoch's micro-batches from
        ``first_batch`` on (``TrainerConfig.validation_due``: Lightning's ``_should_check_val_fx``), before the epoch's
        last batch (that one validates in ``_end_epoch``, before the epoch's hooks). Never mid-epoch without a
        ``val_check_interval`` below an epoch (None or the float 1.0; the int 1 is every batch), so then no per-step
        work. A duration (Lightning 2.6) is
        due after any step of an epoch that validates, the last one too, once rank zero's clock has passed
        ``fit.validate_at`` (set at training's start and at each validation's end, as Lightning's ``_last_val_time``;
        broadcast on several ranks, so that all validate after the same step)."""
        interval = self.config.val_check_interval
        if not fit.validates or interval is None or (isinstance(interval, float) and interval == 1.0):
            return False
        if fit.validate_at != math.inf:  # by the clock: after any step of an epoch that validates, its last one too
            return self.config.validates_in(self.current_epoch) and self._rank_zero_clock_says(
                time.monotonic() >= fit.validate_at)
        trained = range(first_batch, self.state.batches)
        return trained.stop < fit.epoch_batches and self.config.validation_due(
            self.current_epoch, trained, self.state.total_batches - len(trained), fit.epoch_batches)

    def _validates_at_epoch_end(self, fit: FitRun, epoch: int) -> bool:
        """Validation at the epoch's end, in the epochs ``check_val_every_n_epoch`` names, unless it ran after the
        same batch: when the last batch is one of ``val_check_interval``'s, when an iterable data set's epoch
        ended (Lightning's rules), or when the epoch was cut short (a stop asked by ``max_time`` or a callback, as
        Lightning; by ``max_steps``, where Lightning does not validate, trainscale validates the final model). With a
        time-based ``val_check_interval`` only then: the clock decided after the epoch's last step."""
        done = self.state.batches
        if fit.validated_after == done or not self.config.validates_in(epoch):
            return False
        if done < fit.epoch_batches:
            return True
        if fit.validate_at != math.inf:  # a time-based val_check_interval: decided at the epoch's last step
            return False
        if evaluation.loader_length(fit.train_loader) == math.inf:
            return True
        return self.config.validation_due(epoch, range(done - 1, done), self.state.total_batches - 1, fit.epoch_batches)

    def _validate(self, fit: FitRun, mid_epoch: bool) -> dict[str, float]:
        """Validation during ``fit`` (``evaluation.evaluate_stage``: its hooks, ``callback_metrics``); a mid-epoch
        one is also written as a "validation" record (an epoch-end one goes in the epoch record)."""
        self.validating = True  # Lightning's stage, back to training after it
        self._ask_val(fit)  # the loaders, asked for when first needed or due again (reload_dataloaders_every_n_epochs)
        if fit.val_loader is None:  # val_dataloader() gave none: nothing to validate
            self.training = True
            return {}
        # Lightning's hook frees the gradients before validation (the default: the module's zero_grad())
        getattr(fit.model, "on_validation_model_zero_grad", fit.model.zero_grad)()
        results = evaluation.merged(evaluation.evaluate_stage(self, fit.loop_module, fit.wrapped, fit.val_loader,
                                                              "validation"))
        self.training = True
        self.validated_at.append(self.global_step)
        fit.validated_after = self.state.batches
        if fit.validate_at != math.inf:  # a time-based val_check_interval counts from each validation's end
            fit.validate_at = time.monotonic() + self.config.val_check_seconds
        if mid_epoch:
            fit.metrics.write({"kind": "validation", "rank": "all", "time": time.time(), "epoch": self.current_epoch,
                            "step": self.global_step, **results})
        return results

    def _sanity_check(self, fit: FitRun, resume: ResumePoint | None) -> None:
        """Lightning's sanity check: ``num_sanity_val_steps`` validation batches before training, between
        ``on_sanity_check_start`` and ``on_sanity_check_end``, with ``sanity_checking`` True; its results are not
        kept (``callback_metrics`` as before) and the random states are restored after it, so training is the
        same with or without it (Lightning isolates the RNG likewise). None without a validation loader. A resumed
        fit runs it when it continues after a completed epoch, and skips it when it continues mid-epoch or with
        ``max_steps`` set, as Lightning 2.6 (its loops are "restarting" then: ``_FitLoop.restarting``)."""
        restarting = resume is not None and (not resume.complete or self.config.max_steps is not None)
        if restarting or fit.val_loader is None or self.config.sanity_val_batches == 0:
            return
        saved_rng, saved_metrics, stage = rng_state(), dict(self.callback_metrics), self.state.stage
        self.sanity_checking = True
        self._hook("on_sanity_check_start")
        limit = self.config.sanity_val_batches  # of each loader, as Lightning
        evaluation.evaluate_stage(self, fit.loop_module, fit.wrapped, fit.val_loader, "validation",
                                  num_batches=[min(limit, batches) for batches in self.num_val_batches])
        self._hook("on_sanity_check_end")
        self.state.stage = stage  # TRAINING again, as Lightning's
        self.callback_metrics = saved_metrics
        set_rng_state(saved_rng)

    def _rank_zero_clock_says(self, this_rank: bool) -> bool:
        """Rank zero's answer to a question of time (a time-based ``val_check_interval``), broadcast,
        so that every rank takes the same path after the same step: the ranks' clocks differ, and a rank that
        validated or stopped alone would leave the others waiting in a collective. ``this_rank``: this rank's answer
        (the only one at world size 1)."""
        return bool(self.runtime.broadcast_object(this_rank)) if self.runtime.world_size > 1 else this_rank

    def _checkpoint_if_due(self, fit: FitRun, epoch_end: bool, ends_epoch: bool = False) -> None:
        """The one place that decides when to checkpoint, after every optimizer step and at every epoch end:
        first the fault check (signals, non-finite losses; at the steps every rank agreed on, and at epoch
        ends), which on a signal saves and exits; then each ``ModelCheckpoint`` saves when the step or epoch
        is one of its own. ``ends_epoch``: the step trained the epoch's last micro-batch (``MicroBatch.ends_epoch``,
        known for an iterable data set too), so an epoch-end save follows it, as it does after ``max_steps``."""
        step = self.state.global_step
        if self.config.checkpoint_async:  # the only writes in the background: publish one that has ended (no wait)
            self.checkpoints.poll()
        if epoch_end or self._faults.due(step):
            stop = self._faults.poll(step, self.current_epoch, fit.epoch_loss.sum)
            if stop:
                path = self.save_checkpoint()  # on disk before the exit
                self._faults.exit(stop, str(path))
        ends_epoch = ends_epoch or step >= self.config.step_limit
        for cb in self.checkpoint_callbacks:
            cb.save_if_due(self, epoch_end, ends_epoch)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the first process of each machine (local rank 0), as Lightning's ``trainer.print``."""
        if self.local_rank == 0:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def init_module(self, empty_init: bool | None = None) -> Iterator[None]:
        """Lightning's ``with trainer.init_module(): model = Net()``: the model is built as the precision asks
        (``Runtime.init_module``: float64 parameters under "64-true"); the strategy moves, casts or shards it in
        ``fit``, so the trained model is the same as one built outside. ``empty_init`` (Lightning: skip the weights'
        initialization, for a checkpoint loaded next) is accepted and changes nothing: the weights are initialized.
        To build a large model without memory, use the module's ``configure_model`` hook (docs/lightning.md)."""
        with self.runtime.init_module():
            yield

    def save_checkpoint(self, filepath: str | Path | None = None, weights_only: bool = False,
                        storage_options: Any = None, *, background: bool = False, overwrite: bool = False) -> Path:
        """Checkpoint everything (model, optimizers, schedulers, loop position, RNG states, callbacks) to
        ``filepath`` atomically (a file, its SHA-256 inside; a directory under a sharding strategy), as
        Lightning's ``trainer.save_checkpoint(filepath, weights_only=False, storage_options=None)``, whose
        arguments come in the same order; ``fit(ckpt_path=filepath)`` resumes from it (not from one with
        ``weights_only``: no optimizer or scheduler state, as Lightning's). Without ``filepath`` to
        ``<run dir>/checkpoints/epoch=E-step=S.ckpt``, and "last" then names it. During ``fit`` every rank must call
        it at the same point; after ``fit`` it writes the fitted state. Returns the path written
        (``background`` with ``checkpoint_async``: returns once the state is staged, the write goes on;
        ``checkpointing/writes.py``).

        An existing ``filepath`` is replaced only with ``overwrite=True``, and one in another run's directory never
        is (unlike Lightning, which overwrites silently).

        Raises:
            NoTrainingStateError: called before any ``fit`` of this Trainer (nothing to save yet): a ``RuntimeError``,
                and an ``AttributeError`` as Lightning raises it.
            TypeError: ``storage_options`` other than None (Lightning's ``TorchCheckpointIO`` refuses them too:
                trainscale writes local files and has no ``CheckpointIO`` plugins).
            FileExistsError: ``filepath`` exists and ``overwrite`` is False, or it belongs to another run (on every
                rank, before anything is written).
            ValueError: ``filepath`` is a URL (``s3://...``, ``memory://...``): trainscale writes local files.
        """
        if self._fit is None:  # Lightning's words first
            raise NoTrainingStateError(
                "Saving a checkpoint is only possible if a model is attached to the Trainer: save_checkpoint() needs a "
                "fit first: there is no training state yet; call trainer.fit(model, ...) (or save the weights with "
                "torch.save(model.state_dict(), path))")
        if storage_options is not None:  # Lightning's TorchCheckpointIO's words first
            raise TypeError("`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg is not "
                            f"supported: trainscale writes local files and has no CheckpointIO plugin to pass "
                            f"{storage_options!r} to; drop the argument")
        if filepath is None:
            return self.write_checkpoint(self.run_dir / "checkpoints", background, weights_only=weights_only)
        refuse_url("save_checkpoint(filepath", filepath)
        rt = self.runtime
        refusal = rt.broadcast_object(overwrite_refusal(Path(filepath), self.run_dir, overwrite) if rt.is_rank_zero
                                      else None)  # rank zero's file system decides, so every rank raises together
        if refusal:
            raise FileExistsError(refusal)
        return self._save(Path(filepath), None, background, weights_only)

    def checkpoint_path(self, directory: Path, name: str | None = None) -> Path:
        """Where :meth:`write_checkpoint` writes ``name`` now: ``directory/name`` (None: Lightning's default name,
        ``epoch=E-step=S.ckpt``, ``run_dirs.checkpoint_name``)."""
        return Path(directory) / (ckpt.checkpoint_name(self.current_epoch, self.global_step) if name is None else name)

    def write_checkpoint(self, directory: Path, background: bool = False, name: str | None = None,
                         weights_only: bool = False) -> Path:
        """A checkpoint at :meth:`checkpoint_path`, then "last" moved to it (what a ``ModelCheckpoint`` calls). Every
        rank calls it at the same point. Returns its path."""
        return self._save(self.checkpoint_path(directory, name), self.run_dir / "checkpoints", background, weights_only)

    def _save(self, target: Path, last_dir: Path | None, background: bool, weights_only: bool = False) -> Path:
        previous, self._faults.phase = self._faults.phase, "checkpoint save"
        self._faults.barrier("the checkpoint save", f"at epoch {self.current_epoch}, step {self.global_step}")
        callbacks = {cb.state_key: cb.state_dict() for cb in self.callbacks}
        optimizers, schedulers = ([], []) if weights_only else (self.optimizers, self.schedulers)
        written = self.checkpoints.save(target, last_dir, self._fit, self.state, optimizers, schedulers,
                                        callbacks, lambda content: self._hook("on_save_checkpoint", content),
                                        background, self._plateau_pending(schedulers))
        self._faults.phase = previous
        return written

    def _plateau_pending(self, schedulers) -> dict | None:
        """The "step" ``ReduceLROnPlateau`` update a checkpoint written now precedes (one at a mid-epoch validation's
        end, as Lightning saves it: :meth:`train_step` makes the update after that validation), with the monitored
        values it reads: ``{"count": batch index + 1, "metrics": {monitor: value}}``; a resume makes it
        (:meth:`_make_pending_plateau_update`), so that the run goes on as the uninterrupted one. None when none
        is pending (other checkpoints hold the update made)."""
        fit = self._fit
        due = [c for c in schedulers if c.reduce_on_plateau and c.interval == "step"]
        if fit is None or fit.plateau_pending is None or not due:
            return None
        metrics = {c.monitor: float(self.callback_metrics[c.monitor]) for c in due if c.monitor in self.callback_metrics}
        return {"count": fit.plateau_pending, "metrics": metrics}

    def _make_pending_plateau_update(self, fit: FitRun, point: ResumePoint) -> None:
        """After a resume from a checkpoint written before its step's "step" ``ReduceLROnPlateau`` update
        (:meth:`_plateau_pending`): that update, on the values saved with it, before training goes on."""
        if point.plateau_pending is not None and not self.manual_optimizers:
            step_schedulers(self.schedulers, "step", point.plateau_pending["count"], point.plateau_pending["metrics"],
                            fit.loop_module.lr_scheduler_step, plateau=True)

    def _load(self, path: Path, verify: bool, weights_only: bool | None) -> ResumePoint:
        # the hooks see the checkpoint as read and may change it before the model, optimizers and callbacks are
        # restored from it (Lightning: the module's hook first here)
        def on_load(read: dict) -> None:  # the hooks, then a stateful data module's state (Lightning's order)
            self._hook("on_load_checkpoint", read, module_first=True)
            checkpointer.restore_datamodule(self.datamodule, read)

        point, _ = checkpointer.load(self.runtime, path, self._fit.model, self.optimizers, self.schedulers, self.state,
                                     self.callbacks, verify, on_load, weights_only)
        return point

    # -- evaluation ----------------------------------------------------------------------------------
    def validate(self, model: nn.Module | None = None, dataloaders: torch.utils.data.DataLoader | None = None, *,
                 loss_fn: Callable | None = None, ckpt_path: str | Path | None = None,
                 datamodule: Any = None, verbose: bool = True,
                 weights_only: bool | None = None) -> list[dict[str, float]]:
        """Evaluate ``model`` across all ranks, each sample counted once. Returns Lightning's list of one dict per
        loader: ``[{"val_loss": ..., "val_accuracy": ...}]`` (or ``validation_step``'s keys prefixed
        ``val_``, and what it logged), sample-weighted means; ``trainer.validate(...)[0]["val_loss"]``. ``ckpt_path``:
        "best", "last" or a path evaluates that checkpoint's weights (``evaluation.checkpoint_to_evaluate``).
        ``dataloaders`` None: ``datamodule``'s or the model's ``val_dataloader()`` (``lightning/data_sources.py``); a
        list, tuple or dict of loaders: each in turn, ``validation_step`` getting ``dataloader_idx``, the names
        ending in ``/dataloader_idx_N``, as Lightning (``evaluation.evaluate``).
        ``model`` None (also for ``test`` and ``predict``): the model of this trainer's last ``fit``, with the weights of
        its best checkpoint when ``ckpt_path`` is None, as Lightning (``evaluation.fitted_model``). ``verbose``: rank zero
        prints the results as a table, as Lightning (``evaluation.results_table``); False prints nothing.

        Raises:
            ValueError: ``model`` None before any fit; a module with ``training_step`` but no ``validation_step``."""
        return self._run_eval("validate", model, dataloaders, loss_fn=loss_fn, ckpt_path=ckpt_path,
                              datamodule=datamodule, verbose=verbose)

    def test(self, model: nn.Module | None = None, dataloaders: torch.utils.data.DataLoader | None = None, *,
             loss_fn: Callable | None = None, ckpt_path: str | Path | None = None,
             datamodule: Any = None, verbose: bool = True,
             weights_only: bool | None = None) -> list[dict[str, float]]:
        """As :meth:`validate`, with ``test_step``, ``test_dataloader()`` and the prefix ``test_``."""
        return self._run_eval("test", model, dataloaders, loss_fn=loss_fn, ckpt_path=ckpt_path, datamodule=datamodule,
                              verbose=verbose)

    def predict(self, model: nn.Module | None = None, dataloaders: torch.utils.data.DataLoader | None = None, *,
                ckpt_path: str | Path | None = None, datamodule: Any = None, return_predictions: bool | None = None,
                weights_only: bool | None = None) -> Any:
        """``predict_step(batch, batch_idx)`` (or the model's output) for every sample, from all ranks in dataset order,
        each sample once: for a module with ``predict_step``/``training_step``, Lightning's list of per-batch outputs;
        for a plain model one tensor of shape (N, ...) when the outputs are tensors (``evaluation.predict``);
        ``ckpt_path`` as :meth:`validate`'s. Several loaders (a list, tuple or dict): a list of those, one per loader.
        ``return_predictions=False`` (Lightning's argument): None, for a run whose callbacks write the outputs."""
        predictions = self._run_eval("predict", model, dataloaders, ckpt_path=ckpt_path, datamodule=datamodule)
        return None if return_predictions is False else predictions

    def _run_eval(self, method: str, model, dataloaders, ckpt_path=None, **kwargs) -> Any:
        if model is None:
            model, ckpt_path = evaluation.fitted_model(self, method, ckpt_path)
        kwargs["ckpt_path"] = evaluation.checkpoint_to_evaluate(self, ckpt_path, method)  # before any ddp_spawn start
        self.ckpt_path = as_ckpt_path(kwargs["ckpt_path"])
        previous, self.state.stage = self.state.stage, RunningStage(method)  # VALIDATING, TESTING, PREDICTING
        self.state.fn, self.state.status = TrainerFn(method), TrainerStatus.RUNNING  # the fn stays after the call
        try:
            with self._on_exception():
                if self.runtime.spawns:
                    results = run_spawned(self, method, model, dataloaders=dataloaders, **kwargs)
                else:
                    results = evaluation.run_stage(self, method, model, dataloaders, **kwargs)
            self.state.status = TrainerStatus.FINISHED
            return results
        finally:
            self.state.stage = previous

    # -- plumbing -------------------------------------------------------------------------------------
    def _arm_hooks(self, model: nn.Module) -> None:
        """Read once per fit or evaluation which hooks some callback overrides or ``model`` defines: :meth:`_hook`
        returns at once for the others (six hook points per step cost no lookup when nobody listens)."""
        self._active_hooks = defined_hooks(model).union(*(overridden_hooks(cb) for cb in self.callbacks))
        # Lightning's batch-transfer hooks, where the module or data module overrides one; else None: the loops move
        # each batch with Runtime.to_device, no call more per batch
        self.batch_transfer = batch_transfer(self.runtime, model, self.datamodule)

    def _hook(self, hook: str, *args: Any, monitoring: bool | None = None, module_first: bool = False) -> Any:
        """Lightning's hook ``hook``: each callback's (``hook(trainer, module, *args)``), then the module's
        (``hook(*args)``, when it defines it), as Lightning's ``_call_callback_hooks`` then
        ``_call_lightning_module_hook``. ``monitoring``: only the callbacks that do (True; no module hook) or
        only the others (False); ``module_first``: the module's hook before the callbacks' (``on_load_checkpoint``).
        Returns what the module's hook returned (None without one), as Lightning reads it (``on_train_batch_start``'s
        -1); the callbacks' results are ignored, as Lightning's."""
        if hook not in self._active_hooks:
            return None
        setup = self.last_setup  # (model, loop module, wrapped) of the fit or evaluation running
        module = setup[0] if setup is not None else None
        call_module = setup is not None and monitoring is not True and hook in setup[1].hooks
        response = None
        with self._running(hook):
            if call_module and module_first:
                response = getattr(module, hook)(*args)
            for cb in self.callbacks:
                if monitoring is None or (cb.monitors_metrics is True) == monitoring:  # a Mock's: not True
                    getattr(cb, hook)(self, module, *args)
            if call_module and not module_first:
                response = getattr(module, hook)(*args)
        return response

    @contextlib.contextmanager
    def _on_exception(self):
        """Lightning's ``_call_and_handle_interrupt`` around ``validate``/``test``/``predict`` (and a spawned ``fit``):
        an exception out of the block calls the callbacks' ``on_exception(trainer, module, exception)``, then the
        data module's ``on_exception(exception)`` when it has one, and goes on."""
        try:
            yield
        except BaseException as err:
            self._exception_hooks(err)
            raise

    @contextlib.contextmanager
    def _interrupted_on_error(self):
        """An error out of the block (``fit``'s setup and data hooks, before its body) leaves the status INTERRUPTED and
        no stage, as Lightning's."""
        try:
            yield
        except BaseException:
            self.state.status, self.state.stage = TrainerStatus.INTERRUPTED, None
            raise

    def _exception_hooks(self, err: BaseException) -> None:
        """Lightning's ``_interrupt``: the status INTERRUPTED, the callbacks' and module's ``on_exception``, then the
        data module's."""
        self.state.status = TrainerStatus.INTERRUPTED
        self._hook("on_exception", err)
        if callable(hook := getattr(self.datamodule, "on_exception", None)):
            hook(err)

    def start_stage(self, model: nn.Module) -> None:
        """What Lightning does with the module as each stage (``fit``/``validate``/``test``/``predict``) starts, before
        any ``setup``: its ``configure_callbacks()`` merged into :attr:`callbacks` (``merge_model_callbacks``:
        Lightning's ``_attach_model_callbacks``), and, where it overrides a Lightning hook trainscale never calls
        (``lightning.module.uncalled_hooks``), one warning naming them on rank zero; the last stage's loaders
        forgotten (:attr:`stage_dataloaders`).

        Raises:
            TypeError: ``configure_callbacks`` returned something other than callbacks."""
        self.stage_dataloaders = {}  # every stage's loaders forgotten, as Lightning's attach_dataloaders
        self._signals = None  # received_sigterm: False again as each stage starts, as Lightning's
        if "configure_callbacks" in module_overrides(model, ("configure_callbacks",)):
            with self._running("configure_callbacks"):
                self.callbacks = merge_model_callbacks(self.callbacks, model.configure_callbacks())
            self.checkpoint_callbacks = [cb for cb in self.callbacks
                                         if isinstance(cb, ModelCheckpoint) and self.config.writes_files]
            bars = [cb for cb in self.callbacks if isinstance(cb, TQDMProgressBar)]
            if bars and bars[0] is not self.progress_bar_callback:
                self.progress_bar_callback, bars[0].trainer = bars[0], self
        uncalled = uncalled_hooks(model)
        if uncalled and self.runtime.is_rank_zero:
            warnings.warn(f"{type(model).__name__} overrides {', '.join(f'`{name}`' for name in uncalled)}, which "
                          "Lightning calls and trainscale never does: the module runs as if it did not define "
                          f"{'them' if len(uncalled) > 1 else 'it'}. Move that work into a hook trainscale calls "
                          "(docs/lightning.md, Hooks)", UserWarning, stacklevel=3)

    def set_up_callbacks(self, model: nn.Module, stage: str) -> None:
        """Lightning's ``Callback.setup(trainer, module, stage)`` of each callback, in every stage: after the data
        module's ``setup(stage)``, before the module's (``data_sources.resolve_loaders`` calls it between them), so
        before the model is wrapped and its optimizers built. Each callback's ``log``/``log_dict`` become the
        module's, as Lightning's ``_attach_model_logging_functions`` does (a plain ``nn.Module`` has none). ``stage``:
        Lightning's ``TrainerFn``, a ``str`` enum."""
        stage = TrainerFn(stage)
        with self._running("setup"):
            for cb in self.callbacks:
                if hasattr(model, "log_dict"):
                    cb.log, cb.log_dict = model.log, model.log_dict
                cb.setup(self, model, stage=stage)  # by keyword, as Lightning calls it

    @contextlib.contextmanager
    def _running(self, hook: str):
        """:attr:`running_hook` is ``hook`` for the block (where ``self.log`` checks Lightning's rules for it)."""
        outer, self.running_hook = self.running_hook, hook
        try:
            yield
        finally:
            self.running_hook = outer


def _seed_workers(loaders: tuple, given: tuple, rank: int) -> None:
    """Give each of ``loaders`` that has workers and no ``worker_init_fn`` of its own :func:`worker_init` for
    ``rank``; a loader that is one of ``given`` (the user's object, used as it is) is left unchanged."""
    for loader in loaders:
        if (loader is not None and not any(loader is g for g in given) and getattr(loader, "num_workers", 0)
                and getattr(loader, "worker_init_fn", True) is None):
            loader.worker_init_fn = functools.partial(worker_init, rank=rank)


def _warn_eval_mode(model: nn.Module, rank_zero: bool) -> None:
    """Lightning's ``PossibleUserWarning`` on rank zero when ``model`` or any of its submodules is in eval mode at the
    start of ``fit`` (its ``_warn_if_modules_in_eval_mode``, in its words), naming the first few: each trains in the
    mode it comes in, as in Lightning 2.2+, which calls no ``model.train()`` (a frozen backbone's BatchNorm keeps its
    statistics)."""
    names = [name or type(model).__name__ for name, module in model.named_modules() if not module.training]
    if names and rank_zero:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        fix = ("call model.train() before fit to train in training mode" if not model.training else
               "they train so (dropout off, BatchNorm statistics not updated); call .train() on them before fit "
               "otherwise")
        warnings.warn(f"Found {len(names)} module(s) in eval mode at the start of training. This may lead to "
                      f"unexpected behavior during training. If this is intentional, you can ignore this warning. "
                      f"({shown}: {fix})", PossibleUserWarning, stacklevel=4)


def _say_debug_modes(cfg: TrainerConfig, rank_zero: bool) -> None:
    """Lightning's notes in ``Trainer(detect_anomaly=True)`` and ``Trainer(barebones=True)``, at INFO on rank zero
    (``log_info``)."""
    if cfg.detect_anomaly and rank_zero:
        log_info(_log, "You have turned on `Trainer(detect_anomaly=True)`. This will significantly slow down compute "
                       "speed and is recommended only for model debugging.")
    if cfg.barebones and rank_zero:
        log_info(_log, "You are running in `Trainer(barebones=True)` mode. All features that may impact raw speed have "
                       "been disabled to facilitate analyzing the Trainer overhead: checkpointing, the progress bar, "
                       "the model summary, logging (loggers, `self.log`, telemetry, the run directory), the sanity "
                       "check.")


def set_torch_flags(deterministic: bool | str | None, benchmark: bool | None = None) -> None:
    """``deterministic`` and ``benchmark`` as Lightning's accelerator connector sets them (``_set_torch_flags``):
    ``deterministic`` True: deterministic algorithms, ``cudnn.benchmark`` off unless ``benchmark=True`` (then
    Lightning's warning that PyTorch ignores cuDNN's determinism), ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS's
    reproducibility setting, https://docs.nvidia.com/cuda/cublas/index.html#results-reproducibility); "warn": the
    same, warning instead of raising on an op without a deterministic implementation; False: off; None: untouched.
    ``benchmark`` True or False: ``torch.backends.cudnn.benchmark`` set to it."""
    if deterministic and benchmark:
        warnings.warn("You passed `deterministic=True` and `benchmark=True`. Note that PyTorch ignores "
                      "torch.backends.cudnn.deterministic=True when torch.backends.cudnn.benchmark=True.", stacklevel=3)
    if benchmark is not None or deterministic:
        torch.backends.cudnn.benchmark = bool(benchmark)
    if deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if deterministic == "warn":
        torch.use_deterministic_algorithms(True, warn_only=True)
    elif isinstance(deterministic, bool):
        torch.use_deterministic_algorithms(deterministic)
