"""Trainer: the training loop, built on Runtime.

    from trainscale import Trainer
    trainer = Trainer(devices=2, max_epochs=5)          # relaunches the script under torchrun
    trainer.fit(model, train_loader, val_loader,
                optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))

``model`` is any ``nn.Module`` fed ``(inputs, targets)`` batches and trained with ``loss_fn``
(cross-entropy by default), or a module defining ``training_step(batch) -> loss``,
``validation_step(batch) -> dict`` and ``configure_optimizers()``. The same loop runs at
world size 1; ``fit`` reads top to bottom like a plain PyTorch script.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from trainscale.runtime.apply import is_compiled
from trainscale.runtime.batch import batch_counts
from trainscale.runtime.batch import batch_size as _batch_size
from trainscale.runtime.runtime import Runtime
from trainscale.telemetry.flops import resolve_count_flops
from trainscale.telemetry.processor import Telemetry
from trainscale.telemetry.report import summary_line
from trainscale.telemetry.sinks import default_sinks
from trainscale.train import checkpoint as ckpt
from trainscale.train.fault import STEP_PHASE, FaultTolerance
from trainscale.train.progress import ProgressBar


class _LoopModule(nn.Module):
    """Puts the loss inside ``forward`` so that DDP (and FSDP) see the whole training step,
    whether the user gave a plain module + ``loss_fn`` or a module with ``training_step``."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn if loss_fn is not None else F.cross_entropy
        self.has_training_step = hasattr(model, "training_step")  # once: a miss on nn.Module costs ~µs per step

    def forward(self, batch: Any, evaluate: bool = False) -> torch.Tensor:
        if evaluate:  # through the wrapper's forward, for strategies that gather parameters there (fsdp)
            return self.evaluate(batch)
        if self.has_training_step:
            return self._modules["model"].training_step(batch)
        inputs, targets = batch
        # _modules["model"], not self.model: nn.Module.__getattr__ costs ~45 bytecodes per step
        return self.loss_fn(self._modules["model"](inputs), targets)

    @torch.no_grad()
    def evaluate(self, batch: Any) -> tuple[dict[str, torch.Tensor], int]:
        """Per-batch mean metrics and the batch's sample count."""
        if hasattr(self.model, "validation_step"):
            metrics = dict(self.model.validation_step(batch))
            return metrics, _batch_size(batch)
        inputs, targets = batch
        logits = self.model(inputs)
        metrics = {"loss": self.loss_fn(logits, targets)}
        if logits.ndim == 2 and targets.ndim == 1 and not targets.is_floating_point():
            metrics["accuracy"] = (logits.argmax(dim=1) == targets).float().mean()
        return metrics, int(targets.shape[0])


class Trainer:
    """Fit and validate a model on any strategy by changing flags.

    Args:
        accelerator: "auto", "cpu", "cuda" ("gpu") or "mps".
        devices: processes (CPU) or GPUs per node, or "auto". With ``devices > 1`` outside a launcher
            the running script is re-executed under torchrun, here in ``__init__``.
        strategy: "auto", "single", "ddp", "fsdp" (FSDP2 sharding), "ddp_spawn" (processes started by
            ``torch.multiprocessing`` inside ``fit``: for notebooks and functions) or "dp"
            (``nn.DataParallel``, GPUs only). See docs/strategies.md.
        num_nodes: machines in the job.
        precision: "32-true", "16-mixed", "bf16-mixed" or "bf16-true".
        max_epochs: epochs to train (>= 1).
        max_steps: stop after this many optimizer steps, whatever the epoch (None: no limit).
        accumulate_grad_batches: micro-batches per optimizer step (gradient all-reduce only on the last).
        gradient_clip_val: clip the total gradient norm (or each value, see ``gradient_clip_algorithm``).
        gradient_clip_algorithm: "norm" or "value".
        seed: seeds torch/numpy/random on every rank and the samplers' shuffling.
        default_root_dir: runs are written to ``default_root_dir/version_N``.
        log_every_n_steps: optimizer steps between step records (each costs one host sync and, with
            telemetry, one all_gather of a small tensor).
        enable_progress_bar: a tqdm bar on rank zero.
        enable_checkpointing: write a checkpoint at each epoch end.
        checkpoint_every_n_steps: also checkpoint every N optimizer steps, mid-epoch, with the exact
            position (samples consumed this epoch, RNG states of every rank); None: epoch ends only.
        keep_last: checkpoints kept on disk (None keeps all).
        timeout: seconds a collective may wait before failing. The error names the operation and (on
            rank 0) the ranks that did not arrive; each rank's Python stack is dumped to
            ``<run dir>/stacks/rank{R}.txt`` after ``timeout / 2`` s without a step.
        on_nonfinite: "raise" (a non-finite loss raises, naming step, epoch and rank; checked on the
            device and read every ``log_every_n_steps`` steps) or "skip" (skip optimizer steps whose
            all-reduced gradients are not finite: one host sync per step). See ``trainscale.train.fault``.
        max_nonfinite_skips: with "skip", raise after more than this many skipped steps in a row.
        handle_signals: on SIGTERM/SIGUSR1, checkpoint at the next check (every ``log_every_n_steps``
            steps), requeue a SLURM job (SIGUSR1) and exit with ``fault.Preempted`` (code 128 + signal).
        strategy_options: keyword options of the strategy (ddp/ddp_spawn: ``find_unused_parameters``,
            ``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``; e.g. ``{"static_graph": True}``).
        sync_batchnorm: convert BatchNorm layers to ``torch.nn.SyncBatchNorm`` (ddp/ddp_spawn on CUDA only:
            torch's SyncBatchNorm refuses CPU tensors).
        activation_checkpointing: ``nn.Module`` classes (e.g. ``{Block}``) whose forward is recomputed in
            backward (``torch.utils.checkpoint``, non-reentrant): less activation memory, one more forward.
        compile: ``torch.compile`` the model before the strategy wraps it; True or a dict of
            ``torch.compile`` arguments.
        enable_telemetry: measure the step-phase split, throughput, MFU, memory, GPU utilisation and
            stragglers (see docs/telemetry.md); False leaves only loss and epoch records.
        count_flops: count the FLOPs of the first micro-batch with ``FlopCounterMode`` (for FLOPs per sample,
            achieved FLOP/s and MFU). None: on CUDA devices only. On a CPU there is no peak FLOP/s for an MFU,
            and the count brings ~1.5 MiB of PyTorch's code pages into the process (docs/telemetry.md), so it
            is on request there. Not allowed with ``compile`` (it would turn compilation off).
        straggler_margin: a rank busy this fraction longer than the median rank is named a straggler.
        tensorboard: also write every record as TensorBoard scalars to ``<run dir>/tensorboard`` (needs
            ``pip install 'trainscale[tensorboard]'``). Off by default: metrics.jsonl and the CSV files are
            always written, and the TensorBoard writer costs ~10 MiB of memory for its imports and, measured
            with telemetry on, ~2.4 ms of waiting per record in the training thread alone (≈2 % of a 2 ms step
            at ``log_every_n_steps=50``; docs/performance.md).

    Raises:
        ValueError: any bad flag, raised on every rank before a process group is created.
    """

    def __init__(self, accelerator: str = "auto", devices: int | str = "auto", strategy: str = "auto",
                 num_nodes: int = 1, precision: str = "32-true", max_epochs: int = 1,
                 max_steps: int | None = None, accumulate_grad_batches: int = 1,
                 gradient_clip_val: float | None = None, gradient_clip_algorithm: str = "norm", seed: int = 0,
                 default_root_dir: str | Path = "runs", log_every_n_steps: int = 50,
                 enable_progress_bar: bool = True, enable_checkpointing: bool = True, keep_last: int | None = 3,
                 timeout: float = 1800.0, strategy_options: dict | None = None, sync_batchnorm: bool = False,
                 activation_checkpointing: Any = None, compile: bool | dict = False,
                 checkpoint_every_n_steps: int | None = None, on_nonfinite: str = "raise",
                 max_nonfinite_skips: int = 10, handle_signals: bool = True, enable_telemetry: bool = True,
                 straggler_margin: float = 0.2, tensorboard: bool = False, count_flops: bool | None = None) -> None:
        self._init_kwargs = {k: v for k, v in locals().items() if k != "self"}  # rebuilt in ddp_spawn children
        for name, value, low in (("max_epochs", max_epochs, 1), ("accumulate_grad_batches", accumulate_grad_batches, 1),
                                 ("log_every_n_steps", log_every_n_steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps={max_steps!r} must be an int >= 1 or None")
        if checkpoint_every_n_steps is not None and (isinstance(checkpoint_every_n_steps, bool) or not isinstance(
                checkpoint_every_n_steps, int) or checkpoint_every_n_steps < 1):
            raise ValueError(f"checkpoint_every_n_steps={checkpoint_every_n_steps!r} must be an int >= 1 or None")
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r}; choose 'raise' or 'skip'")
        if isinstance(max_nonfinite_skips, bool) or not isinstance(max_nonfinite_skips, int) or max_nonfinite_skips < 0:
            raise ValueError(f"max_nonfinite_skips={max_nonfinite_skips!r} must be an int >= 0")
        if gradient_clip_val is not None and not gradient_clip_val > 0:
            raise ValueError(f"gradient_clip_val={gradient_clip_val!r} must be > 0 or None")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}; choose 'norm' or 'value'")
        if tensorboard:
            from trainscale.telemetry.sinks import TensorBoardSink

            if not TensorBoardSink.available():
                raise ValueError("tensorboard=True needs the tensorboard package: pip install 'trainscale[tensorboard]' "
                                 "(or pass tensorboard=False; metrics.jsonl and CSV files are always written)")
        if not straggler_margin >= 0:
            raise ValueError(f"straggler_margin={straggler_margin!r} must be >= 0 (0.2 means 20 % over the median)")
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.seed = seed
        self.default_root_dir = Path(default_root_dir)
        self.log_every_n_steps = log_every_n_steps
        self.enable_progress_bar = enable_progress_bar
        self.enable_checkpointing = enable_checkpointing
        self.keep_last = keep_last
        self.checkpoint_every_n_steps = checkpoint_every_n_steps
        self._fault_args = (on_nonfinite, max_nonfinite_skips, log_every_n_steps, handle_signals)
        self.enable_telemetry = enable_telemetry
        self.straggler_margin = straggler_margin
        self.tensorboard = tensorboard
        self.runtime = Runtime(accelerator, devices, strategy, num_nodes, precision, timeout=timeout,
                               strategy_options=strategy_options, sync_batchnorm=sync_batchnorm,
                               activation_checkpointing=activation_checkpointing, compile=compile)
        self.count_flops = resolve_count_flops(count_flops, self.runtime.device.type,
                                               self.runtime.config.compile is not None)
        if not self.runtime.spawns:  # under ddp_spawn, fit/validate start the processes
            self.runtime.launch()
        self.run_dir: Path | None = None
        self._pending_rng: dict | None = None
        self._saved_world_size = self.runtime.world_size
        self._carried: tuple = (0.0, 0.0, 0.0)
        self.global_step = 0
        self.history: list[dict] = []

    # ---------------------------------------------------------------------------------------
    def fit(self, model: nn.Module, train_dataloaders: torch.utils.data.DataLoader,
            val_dataloaders: torch.utils.data.DataLoader | None = None, *, loss_fn: Callable | None = None,
            optimizer: Callable | torch.optim.Optimizer | None = None, ckpt_path: str | Path | None = None) -> dict:
        """Train ``model``; validate and checkpoint at each epoch end.

        Args:
            model: a plain ``nn.Module`` (batches ``(inputs, targets)``) or one with ``training_step``.
            train_dataloaders: a DataLoader with the per-device ``batch_size``; its sampler is
                replaced by a ``DistributedSampler`` (shuffled if the loader shuffled).
            val_dataloaders: evaluated on all ranks without padding; metrics reduced as sums and counts.
            loss_fn: ``(outputs, targets) -> mean loss``; default ``F.cross_entropy``.
            optimizer: a factory ``params -> Optimizer`` (built after the strategy wraps the model),
                or None when the model defines ``configure_optimizers()``. The factory, like
                ``configure_optimizers``, may also return ``(optimizer, lr_scheduler)`` or Lightning's
                ``{"optimizer": ..., "lr_scheduler": {"scheduler": ..., "interval": "epoch"|"step"}}``.
            ckpt_path: a checkpoint file to resume from, "last" (newest run under ``default_root_dir``),
                or None.

        Returns:
            The run summary (also written to ``<run dir>/summary.json``).

        Under ``strategy="ddp_spawn"`` the body runs in ``devices`` spawned processes: ``model``, the
        loaders, ``loss_fn`` and ``optimizer`` are pickled to them (module-level classes and functions,
        no lambdas: e.g. ``functools.partial(torch.optim.AdamW, lr=1e-3)``), and the trained weights
        of rank 0 are loaded back into ``model`` here.

        Under torchrun after a restart (``TORCHELASTIC_RESTART_COUNT`` > 0) or a requeued SLURM job
        (``SLURM_RESTART_COUNT`` > 0), ``ckpt_path=None`` resumes this job's "last" checkpoint by itself.

        Raises:
            FileNotFoundError / CheckpointError: a missing or corrupted ``ckpt_path``.
            ValueError: no optimizer given; under ddp_spawn, an argument that cannot be pickled.
            trainscale.runtime.hangs.CollectiveTimeout: a collective timed out or a peer crashed.
            trainscale.train.fault.NonFiniteLossError: see ``on_nonfinite``.
            trainscale.train.fault.Preempted: after the checkpoint that follows SIGTERM/SIGUSR1.
        """
        if self.runtime.spawns:
            return self._spawn("fit", model, train_dataloaders=train_dataloaders, val_dataloaders=val_dataloaders,
                               loss_fn=loss_fn, optimizer=optimizer, ckpt_path=ckpt_path)
        self._fault = FaultTolerance(self.runtime, *self._fault_args)
        self._sink = None
        self.current_epoch = 0
        try:
            return self._fit(model, train_dataloaders, val_dataloaders, loss_fn, optimizer, ckpt_path)
        except RuntimeError as err:
            explained = self._fault.diagnose(err, f"at epoch {self.current_epoch}, step {self.global_step}")
            if explained is None:
                raise
            raise explained from err
        finally:
            self._fault.stop()
            if self._sink is not None:  # fit raised: what the sinks buffered reaches their files
                self._sink.close()
                self._sink = None

    def _fit(self, model, train_dataloaders, val_dataloaders, loss_fn, optimizer, ckpt_path) -> dict:
        rt, ft = self.runtime, self._fault
        if ckpt_path is None and rt.world.restart_count > 0:
            ckpt_path = self._restart_checkpoint()
        resume_from = self._resolve_ckpt_path(ckpt_path)
        self._seed_everything()
        loop_module = _LoopModule(model, loss_fn)
        wrapped, _ = rt.setup(loop_module)
        step_fn = _step_fn(loop_module, wrapped)
        optimizer, scheduler, sched_interval = self._build_optimizer(model, wrapped, optimizer)
        train_loader = rt.setup_dataloader(train_dataloaders, seed=self.seed)
        val_loader = rt.setup_dataloader(val_dataloaders, seed=self.seed, even=False) if val_dataloaders else None

        position = self._load(resume_from, model, optimizer, scheduler) if resume_from is not None else None
        start_epoch = position["epoch"] + int(position["complete"]) if position is not None else 0
        self.run_dir = self._choose_run_dir(resume_from)
        ft.start(self.run_dir)
        sink = self._sink = default_sinks(self.run_dir, tensorboard=self.tensorboard) if rt.is_rank_zero else None
        tele = Telemetry(rt, enabled=self.enable_telemetry, count_flops=self.count_flops,
                         straggler_margin=self.straggler_margin)
        tele.attach(wrapped)
        clock = tele.clock
        k = self.accumulate_grad_batches
        # read per step below: locals, so the hot path calls no method to learn them
        max_steps = self.max_steps if self.max_steps is not None else math.inf
        skip_nonfinite = ft.on_nonfinite == "skip"
        global_batch = train_loader.batch_size * rt.world_size * k
        rt.print(f"trainscale: {rt.config.strategy} × {rt.world_size} ({rt.device.type}), precision "
                 f"{rt.config.precision}, global batch {global_batch}, run dir {self.run_dir}")

        for epoch in range(start_epoch, self.max_epochs):
            if self._done():
                break
            self.current_epoch = epoch
            skip = ckpt.start_epoch(train_loader, epoch, position, rt.world_size, self._saved_world_size)
            carried = self._carried if position is not None and epoch == position["epoch"] else (0.0, 0.0, 0.0)
            num_batches = len(train_loader) - skip  # fewer in an epoch resumed mid-way
            batches = iter(train_loader)
            if self._pending_rng is not None:  # a mid-epoch checkpoint's RNG, restored where it was saved
                ckpt.set_rng_state(self._pending_rng)
                self._pending_rng = None
            wrapped.train()
            bar = ProgressBar(self.enable_progress_bar and rt.is_rank_zero, num_batches,
                              f"epoch {epoch + 1}/{self.max_epochs}")
            loss_sum = torch.zeros((), device=rt.device)  # accumulated on device: no host sync per step
            samples = 0
            t0 = time.perf_counter()
            i = -1
            tele.start()
            for i, batch in enumerate(rt.prefetch(itertools.islice(batches, skip, None) if skip else batches)):
                batch = rt.to_device(batch)  # on CUDA already there: prefetch copied it while the last step ran
                t_data = clock()  # phase readings, passed to telemetry once per micro-batch
                group_end = min((i // k + 1) * k, num_batches)  # the last group of an epoch may be short
                is_boundary = i + 1 == group_end
                with rt.no_backward_sync(wrapped, enabled=not is_boundary), tele.count_flops(batch):
                    with rt.autocast():
                        loss = step_fn(batch)
                    t_forward = clock()
                    group_size = group_end - (i // k) * k
                    rt.backward(loss / group_size if group_size > 1 else loss)
                n, tokens = batch_counts(batch)
                tele.micro_batch(t_data, t_forward, clock(), n, tokens)
                detached = loss.detach()
                ft.observe_loss(detached, self.global_step)
                loss_sum.add_(detached, alpha=n)  # one op, on device (bf16 losses promote to fp32)
                samples += n
                bar.update()
                if not is_boundary:
                    continue
                grad_norm = None
                if self.gradient_clip_val is not None:
                    by_norm = self.gradient_clip_algorithm == "norm"
                    grad_norm = rt.clip_gradients(wrapped, optimizer, max_norm=self.gradient_clip_val if by_norm else None,
                                                  clip_val=None if by_norm else self.gradient_clip_val)
                if not (skip_nonfinite and ft.skip_step(wrapped, optimizer, grad_norm, step=self.global_step, epoch=epoch)):
                    rt.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                if scheduler is not None and sched_interval == "step":
                    scheduler.step()
                tele.end_step()  # marks "optimizer"
                self.global_step += 1
                if self.global_step % self.log_every_n_steps == 0:
                    self._log_step(sink, bar, epoch, loss, grad_norm, tele)
                every = self.checkpoint_every_n_steps
                step_ckpt = (every is not None and self.global_step % every == 0 and i + 1 < num_batches
                             and not self._done())  # else the epoch-end path saves this position
                if ft.due(self.global_step) or step_ckpt:  # the same answer on every rank
                    stop = ft.poll(self.global_step, epoch, loss_sum)
                    if stop or step_ckpt:
                        totals = rt.all_reduce(torch.stack([loss_sum, torch.tensor(float(samples), device=rt.device)]))
                        path = self._save(epoch, model, optimizer, scheduler,
                                          ckpt.loop_position(epoch, train_loader, i + 1, False, skip),
                                          [totals[0].item() + carried[0], totals[1].item() + carried[1],
                                           time.perf_counter() - t0 + carried[2]])
                        if stop:
                            ft.exit(stop, str(path))
                if self.global_step >= max_steps:
                    break
            train_time = time.perf_counter() - t0 + carried[2]
            bar.close()
            if scheduler is not None and sched_interval == "epoch":
                scheduler.step()

            ft.phase = "epoch end (loss all-reduce, validation)"
            totals = rt.all_reduce(torch.stack([loss_sum, torch.tensor(float(samples), device=rt.device)]))
            totals += torch.tensor(carried[:2], device=rt.device, dtype=totals.dtype)
            record = {"epoch": epoch, "step": self.global_step, "train_loss": (totals[0] / totals[1]).item(),
                      "epoch_time_s": train_time, "samples_per_s": totals[1].item() / train_time}
            if val_loader is not None:
                record.update(self._evaluate(loop_module, wrapped, val_loader))
            self.history.append(record)
            if sink is not None:
                sink.write({"kind": "epoch", "rank": "all", "time": time.time(), **record})
            rt.print(_epoch_line(record, self.max_epochs))
            stop = ft.poll(self.global_step, epoch, loss_sum)
            if self.enable_checkpointing or stop:
                path = self._save(epoch, model, optimizer, scheduler,
                                  ckpt.loop_position(epoch, train_loader, i + 1, i + 1 == num_batches, skip), None)
                if stop:
                    ft.exit(stop, str(path))
            ft.phase = STEP_PHASE

        summary = self._summary(global_batch)
        summary["telemetry"] = tele.summary()  # a collective
        if summary["telemetry"] is not None:
            rt.print(summary_line(summary["telemetry"]))
        if sink is not None:
            sink.close()
            self._sink = None
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        rt.barrier()
        return summary

    def validate(self, model: nn.Module, dataloaders: torch.utils.data.DataLoader, *,
                 loss_fn: Callable | None = None) -> dict[str, float]:
        """Evaluate ``model`` on ``dataloaders`` across all ranks, each sample counted once.

        Returns:
            ``{"val_loss": float, "val_accuracy": float}`` (accuracy for classification, or every key of
            ``validation_step``'s dict prefixed with ``val_``), sample-weighted means over the whole set.
        """
        if self.runtime.spawns:
            return self._spawn("validate", model, dataloaders=dataloaders, loss_fn=loss_fn)
        loop_module = _LoopModule(model, loss_fn)
        wrapped, _ = self.runtime.setup(loop_module)
        loader = self.runtime.setup_dataloader(dataloaders, seed=self.seed, even=False)
        return self._evaluate(loop_module, wrapped, loader)

    # ---------------------------------------------------------------------------------------
    def _evaluate(self, loop_module: _LoopModule, wrapped: nn.Module, loader) -> dict[str, float]:
        """Sums and counts on device, one all-reduce at the end (no collective inside the loop,
        so ranks holding different numbers of batches cannot hang)."""
        rt = self.runtime
        wrapped.eval()
        sums: dict[str, torch.Tensor] = {}
        count = 0
        # fsdp all-gathers parameters in forward: every rank must run as many forwards (see _even_out)
        gathers = getattr(rt.strategy, "forward_communicates", False)
        extra_forwards = self._even_out(len(loader)) if gathers else 0
        batch = None
        for batch in loader:
            batch = rt.to_device(batch)
            with rt.autocast():
                metrics, n = wrapped(batch, evaluate=True) if gathers else loop_module.evaluate(batch)
            for key, value in metrics.items():
                value = torch.as_tensor(value, device=rt.device).detach().float() * n
                sums[key] = sums[key] + value if key in sums else value
            count += n
        for _ in range(extra_forwards):  # results discarded: each sample is still counted once
            with rt.autocast():
                wrapped(batch, evaluate=True)
        keys = rt.broadcast_object(sorted(sums))  # a rank with no batch still takes part
        vec = torch.stack([sums.get(k, torch.zeros((), device=rt.device)) for k in keys]
                          + [torch.tensor(float(count), device=rt.device)])
        vec = rt.all_reduce(vec).tolist()
        wrapped.train()
        total = vec[-1]
        return {f"val_{k}": (v / total if total else math.nan) for k, v in zip(keys, vec[:-1])}

    def _even_out(self, num_batches: int) -> int:
        """Forwards this rank must add so that all ranks run the most batches of any rank.

        Raises:
            ValueError: some rank has no evaluation batch at all (fewer samples than ranks).
        """
        most, neg_least = self.runtime.all_reduce(torch.tensor([num_batches, -num_batches], device=self.runtime.device),
                                                  op="max").tolist()
        if -neg_least == 0 and most > 0:
            raise ValueError(f"strategy={self.runtime.config.strategy!r} evaluates through collectives, but some rank "
                             "has no evaluation batch; give the evaluation set at least as many samples as ranks")
        return most - num_batches

    def _build_optimizer(self, model: nn.Module, wrapped: nn.Module, optimizer):
        if optimizer is None and hasattr(model, "configure_optimizers"):
            configured = model.configure_optimizers()
        elif optimizer is None:
            raise ValueError("no optimizer: pass optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), "
                             "or define configure_optimizers() on the model")
        elif isinstance(optimizer, torch.optim.Optimizer):
            configured = optimizer
        elif callable(optimizer):
            configured = optimizer(wrapped.parameters())  # may return (optimizer, scheduler) too
        else:
            raise TypeError(f"optimizer must be a factory params -> Optimizer, got {type(optimizer).__name__}")
        scheduler, interval = None, "epoch"
        if isinstance(configured, dict):
            sched = configured.get("lr_scheduler")
            if isinstance(sched, dict):
                interval = sched.get("interval", "epoch")
                sched = sched["scheduler"]
            configured, scheduler = configured["optimizer"], sched
        elif isinstance(configured, (tuple, list)):
            configured, scheduler = configured[0], (configured[1] if len(configured) > 1 else None)
        if interval not in ("epoch", "step"):
            raise ValueError(f"lr_scheduler interval={interval!r}; choose 'epoch' or 'step'")
        return self.runtime.strategy.setup_optimizer(configured), scheduler, interval

    def _seed_everything(self) -> None:
        import random

        import numpy as np

        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)

    def _done(self) -> bool:
        return self.max_steps is not None and self.global_step >= self.max_steps

    def _log_step(self, sink, bar, epoch: int, loss: torch.Tensor, grad_norm: torch.Tensor | None,
                  tele: Telemetry) -> None:
        record = tele.log(self.global_step, epoch, loss)  # a collective; None with telemetry off
        if record is None:  # one host sync per log interval, not per step
            record = {"kind": "step", "rank": 0, "time": time.time(), "epoch": epoch, "step": self.global_step,
                      "train_loss": loss.item()}
        if grad_norm is not None:  # total norm before clipping (gradient_clip_algorithm="norm")
            record["grad_norm"] = grad_norm.item()
        bar.set_postfix(loss=f"{record.get('train_loss', math.nan):.4f}")
        if sink is not None:
            sink.write(record)

    def _spawn(self, method: str, model: nn.Module, **kwargs: Any) -> Any:
        """Run ``method`` ("fit"/"validate") in spawned ranks; load rank 0's weights into ``model``."""
        from trainscale.runtime import spawn

        out = spawn.run(_spawned_call, {"trainer_flags": self._init_kwargs, "method": method, "model": model,
                                        **kwargs}, self.runtime.config.world_size, self.runtime.config.start_method)
        model.load_state_dict(out["state_dict"])
        self.history, self.global_step = out["history"], out["global_step"]
        self.run_dir = Path(out["run_dir"]) if out["run_dir"] else None
        return out["result"]

    # -- checkpoints -------------------------------------------------------------------------
    def _resolve_ckpt_path(self, ckpt_path) -> Path | None:
        if ckpt_path is None:
            return None
        if ckpt_path == "last":
            found = ckpt.find_last(self.default_root_dir)
            if found is None:
                raise FileNotFoundError(f"ckpt_path='last' but no run under {str(self.default_root_dir)!r} has a "
                                        "checkpoint; pass ckpt_path=None to start fresh, or the right default_root_dir")
            ckpt_path = found
        path = Path(ckpt_path)
        if not path.exists():  # checked on every rank before any collective (a file, or a directory for fsdp)
            raise FileNotFoundError(f"ckpt_path={str(path)!r} does not exist; pass an existing checkpoint file, "
                                    "'last', or None to start fresh")
        return path

    def _choose_run_dir(self, resume_from: Path | None) -> Path:
        rt = self.runtime
        if resume_from is not None and resume_from.parent.name == "checkpoints":
            run_dir = resume_from.parent.parent  # a resumed run continues in its own directory
        else:
            run_dir = None
            if rt.is_rank_zero:  # a restarted job without a checkpoint yet keeps its directory
                run_dir = (ckpt.find_job_run(self.default_root_dir, rt.world.job_id)
                           if rt.world.restart_count > 0 and rt.world.job_id else None)
                run_dir = run_dir or ckpt.next_run_dir(self.default_root_dir)
            run_dir = Path(rt.broadcast_object(str(run_dir) if run_dir else None))
        if rt.is_rank_zero:
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            ckpt.write_job_id(run_dir, rt.world.job_id)
        rt.barrier()
        return run_dir

    def _restart_checkpoint(self) -> Path | None:
        """This job's "last" checkpoint after torchrun restarted the workers (or SLURM requeued the job)."""
        world = self.runtime.world
        found = ckpt.find_last(self.default_root_dir, job_id=world.job_id)
        self.runtime.print(f"trainscale: restart {world.restart_count} of job {world.job_id}: "
                           + (f"resuming from {found}" if found else "no checkpoint yet, starting over"))
        return found

    def _save(self, epoch: int, model, optimizer, scheduler, position: dict, totals: list | None) -> Path:
        """Checkpoint at an epoch end (``position["complete"]``) or mid-epoch (with the epoch's running
        loss totals and time, so its record covers the whole epoch after a resume). All ranks call it."""
        rt, ft = self.runtime, self._fault
        previous, ft.phase = ft.phase, "checkpoint save"
        ft.barrier("the checkpoint save", f"at epoch {epoch}, step {self.global_step}")
        rngs = rt.all_gather_object(ckpt.rng_state())
        suffix = getattr(rt.strategy, "checkpoint_suffix", ".pt")  # "": a sharded checkpoint directory
        completed = epoch + 1 if position["complete"] else epoch
        path = self.run_dir / "checkpoints" / ckpt.checkpoint_name(completed, self.global_step, suffix)
        state = {"model": model, "optimizer": optimizer, "epoch": epoch, "global_step": self.global_step,
                 "history": self.history, "rng": rngs, "world_size": rt.world_size,
                 "loop": {**position, "totals": totals}}
        if scheduler is not None:
            state["scheduler"] = scheduler
        rt.save(path, state)  # ends with a barrier
        if rt.is_rank_zero:
            ckpt.mark_last(path, self.keep_last)
        ft.phase = previous
        return path

    def _load(self, path: Path, model, optimizer, scheduler) -> dict:
        """Restore state from ``path``; return the loop position (``ckpt.loop_position``'s dict)."""
        state = {"model": model, "optimizer": optimizer}
        if scheduler is not None:
            state["scheduler"] = scheduler
        rest = self.runtime.load(path, state)
        self.global_step = int(rest["global_step"])
        self.history = list(rest.get("history", []))
        self._saved_world_size = int(rest.get("world_size", self.runtime.world_size))
        position = rest.get("loop") or {"epoch": int(rest["epoch"]), "complete": True, "consumed": None,
                                        "batches": 0, "totals": None}
        self._carried = tuple(position.get("totals") or (0.0, 0.0, 0.0))
        rngs = rest.get("rng") or []
        rng = (rngs[self.runtime.rank] if len(rngs) == self.runtime.world_size else rngs[0]) if rngs else None
        if rng is not None and position["complete"]:
            ckpt.set_rng_state(rng)
        else:  # mid-epoch: restored after the epoch's DataLoader iterator is made, as when it was saved
            self._pending_rng = rng
        where = (f"end of epoch {position['epoch'] + 1}" if position["complete"] else
                 f"epoch {position['epoch'] + 1}, sample {position['consumed']}")
        self.runtime.print(f"trainscale: resumed from {path} ({where}, step {self.global_step})")
        return position

    def _summary(self, global_batch: int) -> dict:
        rt = self.runtime
        last = self.history[-1] if self.history else {}
        times = [h["epoch_time_s"] for h in self.history]
        total_samples = sum(h["samples_per_s"] * h["epoch_time_s"] for h in self.history)
        return {
            "world_size": rt.world_size, "strategy": rt.config.strategy, "precision": rt.config.precision,
            "accelerator": rt.config.accelerator, "device": str(rt.device), "num_nodes": rt.config.num_nodes,
            "epochs": len(self.history), "steps": self.global_step, "global_batch_size": global_batch,
            "accumulate_grad_batches": self.accumulate_grad_batches, "seed": self.seed,
            "train_loss": last.get("train_loss"), "val_loss": last.get("val_loss"),
            "val_accuracy": last.get("val_accuracy"), "epoch_time_s": times,
            "samples_per_s": total_samples / sum(times) if times else None,
            "torch_version": torch.__version__, "run_dir": str(self.run_dir),
            "restart_count": rt.world.restart_count, "nonfinite_skipped": self._fault.skipped,
        }


def _step_fn(loop_module: _LoopModule, wrapped: nn.Module) -> Callable[[Any], torch.Tensor]:
    """What the loop calls per micro-batch: ``wrapped`` itself, or the loop module's bound ``forward``
    when ``nn.Module.__call__`` would do nothing but call it (two more Python frames, ~50 bytecodes
    per micro-batch): the strategy returned the loop module as it was (single device), no hook is
    registered on it and it is not compiled in place (``Module.compile()`` runs through ``__call__``).
    The user's model is still called through ``__call__``, so its hooks, and global module hooks,
    run on it. FSDP2 hooks the module in place and changes its class; DDP and DP wrap it: those are
    called as modules."""
    plain_call = not (wrapped._forward_hooks or wrapped._forward_pre_hooks or wrapped._backward_hooks
                      or wrapped._backward_pre_hooks or is_compiled(wrapped))
    return loop_module.forward if wrapped is loop_module and type(wrapped) is _LoopModule and plain_call else wrapped


def _spawned_call(trainer_flags: dict, method: str, model: nn.Module, **kwargs: Any) -> dict:
    """One "ddp_spawn" rank: a Trainer from the parent's flags runs ``method``; rank 0's result,
    trained weights (on CPU) and loop state go back to the parent."""
    trainer = Trainer(**trainer_flags)
    try:
        result = getattr(trainer, method)(model, **kwargs)
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        return {"result": result, "state_dict": state, "history": trainer.history,
                "global_step": trainer.global_step, "run_dir": str(trainer.run_dir) if trainer.run_dir else None}
    finally:
        trainer.runtime.teardown()


def _epoch_line(record: dict, max_epochs: int) -> str:
    parts = [f"epoch {record['epoch'] + 1}/{max_epochs}", f"train_loss {record['train_loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    if "val_accuracy" in record:
        parts.append(f"val_acc {record['val_accuracy']:.4f}")
    parts += [f"{record['samples_per_s']:.0f} samples/s", f"{record['epoch_time_s']:.1f} s"]
    return "  ".join(parts)
