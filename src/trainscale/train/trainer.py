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

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from trainscale.runtime.runtime import Runtime
from trainscale.telemetry.sinks import JsonlSink
from trainscale.train import checkpoint as ckpt
from trainscale.train.progress import ProgressBar


class _LoopModule(nn.Module):
    """Puts the loss inside ``forward`` so that DDP (and FSDP) see the whole training step,
    whether the user gave a plain module + ``loss_fn`` or a module with ``training_step``."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.has_training_step = hasattr(model, "training_step")  # once: a miss on nn.Module costs ~µs per step

    def forward(self, batch: Any) -> torch.Tensor:
        if self.has_training_step:
            return self.model.training_step(batch)
        inputs, targets = batch
        return (self.loss_fn or F.cross_entropy)(self.model(inputs), targets)

    @torch.no_grad()
    def evaluate(self, batch: Any) -> tuple[dict[str, torch.Tensor], int]:
        """Per-batch mean metrics and the batch's sample count."""
        if hasattr(self.model, "validation_step"):
            metrics = dict(self.model.validation_step(batch))
            return metrics, _batch_size(batch)
        inputs, targets = batch
        logits = self.model(inputs)
        metrics = {"loss": (self.loss_fn or F.cross_entropy)(logits, targets)}
        if logits.ndim == 2 and targets.ndim == 1 and not targets.is_floating_point():
            metrics["accuracy"] = (logits.argmax(dim=1) == targets).float().mean()
        return metrics, int(targets.shape[0])


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        return _batch_size(next(iter(batch.values())))
    return _batch_size(batch[0])


class Trainer:
    """Fit and validate a model on any strategy by changing flags.

    Args:
        accelerator: "auto", "cpu", "cuda" ("gpu") or "mps".
        devices: processes (CPU) or GPUs per node, or "auto". With ``devices > 1`` outside a launcher
            the running script is re-executed under torchrun, here in ``__init__``.
        strategy: "auto", "single" or "ddp".
        num_nodes: machines in the job.
        precision: "32-true", "16-mixed", "bf16-mixed" or "bf16-true".
        max_epochs: epochs to train (>= 1).
        max_steps: stop after this many optimizer steps, whatever the epoch (None: no limit).
        accumulate_grad_batches: micro-batches per optimizer step (gradient all-reduce only on the last).
        gradient_clip_val: clip the total gradient norm (or each value, see ``gradient_clip_algorithm``).
        gradient_clip_algorithm: "norm" or "value".
        seed: seeds torch/numpy/random on every rank and the samplers' shuffling.
        default_root_dir: runs are written to ``default_root_dir/version_N``.
        log_every_n_steps: optimizer steps between step records (each costs one host sync).
        enable_progress_bar: a tqdm bar on rank zero.
        enable_checkpointing: write a checkpoint at each epoch end.
        keep_last: checkpoints kept on disk (None keeps all).
        timeout: seconds a collective may wait before failing.
        strategy_options: keyword options of the strategy (e.g. ``{"find_unused_parameters": True}``).

    Raises:
        ValueError: any bad flag, raised on every rank before a process group is created.
    """

    def __init__(self, accelerator: str = "auto", devices: int | str = "auto", strategy: str = "auto",
                 num_nodes: int = 1, precision: str = "32-true", max_epochs: int = 1,
                 max_steps: int | None = None, accumulate_grad_batches: int = 1,
                 gradient_clip_val: float | None = None, gradient_clip_algorithm: str = "norm", seed: int = 0,
                 default_root_dir: str | Path = "runs", log_every_n_steps: int = 50,
                 enable_progress_bar: bool = True, enable_checkpointing: bool = True, keep_last: int | None = 3,
                 timeout: float = 1800.0, strategy_options: dict | None = None) -> None:
        for name, value, low in (("max_epochs", max_epochs, 1), ("accumulate_grad_batches", accumulate_grad_batches, 1),
                                 ("log_every_n_steps", log_every_n_steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps={max_steps!r} must be an int >= 1 or None")
        if gradient_clip_val is not None and not gradient_clip_val > 0:
            raise ValueError(f"gradient_clip_val={gradient_clip_val!r} must be > 0 or None")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}; choose 'norm' or 'value'")
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
        self.runtime = Runtime(accelerator, devices, strategy, num_nodes, precision, timeout=timeout,
                               strategy_options=strategy_options)
        self.runtime.launch()
        self.run_dir: Path | None = None
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

        Raises:
            FileNotFoundError / CheckpointError: a missing or corrupted ``ckpt_path``.
            ValueError: no optimizer given.
        """
        rt = self.runtime
        resume_from = self._resolve_ckpt_path(ckpt_path)
        self._seed_everything()
        loop_module = _LoopModule(model, loss_fn)
        wrapped, _ = rt.setup(loop_module)
        optimizer, scheduler, sched_interval = self._build_optimizer(model, wrapped, optimizer)
        train_loader = rt.setup_dataloader(train_dataloaders, seed=self.seed)
        val_loader = rt.setup_dataloader(val_dataloaders, seed=self.seed, even=False) if val_dataloaders else None

        start_epoch = 0
        if resume_from is not None:
            start_epoch = self._load(resume_from, model, optimizer, scheduler)
        self.run_dir = self._choose_run_dir(resume_from)
        sink = JsonlSink(self.run_dir / "metrics.jsonl") if rt.is_rank_zero else None
        k = self.accumulate_grad_batches
        num_batches = len(train_loader)
        global_batch = train_loader.batch_size * rt.world_size * k
        rt.print(f"trainscale: {rt.config.strategy} × {rt.world_size} ({rt.device.type}), precision "
                 f"{rt.config.precision}, global batch {global_batch}, run dir {self.run_dir}")

        for epoch in range(start_epoch, self.max_epochs):
            if self._done():
                break
            rt.set_epoch(train_loader, epoch)
            wrapped.train()
            bar = ProgressBar(self.enable_progress_bar and rt.is_rank_zero, num_batches,
                              f"epoch {epoch + 1}/{self.max_epochs}")
            loss_sum = torch.zeros((), device=rt.device)  # accumulated on device: no host sync per step
            samples = 0
            t0 = time.perf_counter()
            for i, batch in enumerate(train_loader):
                batch = rt.to_device(batch)
                group_end = min((i // k + 1) * k, num_batches)  # the last group of an epoch may be short
                is_boundary = i + 1 == group_end
                with rt.no_backward_sync(wrapped, enabled=not is_boundary):
                    with rt.autocast():
                        loss = wrapped(batch)
                    group_size = group_end - (i // k) * k
                    rt.backward(loss / group_size if group_size > 1 else loss)
                n = _batch_size(batch)
                loss_sum.add_(loss.detach(), alpha=n)  # one op, on device (bf16 losses promote to fp32)
                samples += n
                bar.update()
                if not is_boundary:
                    continue
                if self.gradient_clip_val is not None:
                    by_norm = self.gradient_clip_algorithm == "norm"
                    rt.clip_gradients(wrapped, optimizer, max_norm=self.gradient_clip_val if by_norm else None,
                                      clip_val=None if by_norm else self.gradient_clip_val)
                rt.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                if scheduler is not None and sched_interval == "step":
                    scheduler.step()
                self.global_step += 1
                if self.global_step % self.log_every_n_steps == 0:
                    self._log_step(sink, bar, epoch, loss)
                if self._done():
                    break
            train_time = time.perf_counter() - t0
            bar.close()
            if scheduler is not None and sched_interval == "epoch":
                scheduler.step()

            totals = rt.all_reduce(torch.stack([loss_sum, torch.tensor(float(samples), device=rt.device)]))
            record = {"epoch": epoch, "step": self.global_step, "train_loss": (totals[0] / totals[1]).item(),
                      "epoch_time_s": train_time, "samples_per_s": totals[1].item() / train_time}
            if val_loader is not None:
                record.update(self._evaluate(loop_module, wrapped, val_loader))
            self.history.append(record)
            if sink is not None:
                sink.write({"kind": "epoch", "rank": "all", "time": time.time(), **record})
            rt.print(_epoch_line(record, self.max_epochs))
            if self.enable_checkpointing:
                self._save(epoch, model, optimizer, scheduler)

        summary = self._summary(global_batch)
        if sink is not None:
            sink.close()
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
        for batch in loader:
            batch = rt.to_device(batch)
            with rt.autocast():
                metrics, n = loop_module.evaluate(batch)
            for key, value in metrics.items():
                value = torch.as_tensor(value, device=rt.device).detach().float() * n
                sums[key] = sums[key] + value if key in sums else value
            count += n
        keys = rt.broadcast_object(sorted(sums))  # a rank with no batch still takes part
        vec = torch.stack([sums.get(k, torch.zeros((), device=rt.device)) for k in keys]
                          + [torch.tensor(float(count), device=rt.device)])
        vec = rt.all_reduce(vec).tolist()
        wrapped.train()
        total = vec[-1]
        return {f"val_{k}": (v / total if total else math.nan) for k, v in zip(keys, vec[:-1])}

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

    def _log_step(self, sink, bar, epoch: int, loss: torch.Tensor) -> None:
        value = loss.item()  # one host sync per log interval, not per step
        bar.set_postfix(loss=f"{value:.4f}")
        if sink is not None:
            sink.write({"kind": "step", "rank": 0, "time": time.time(), "epoch": epoch,
                        "step": self.global_step, "train_loss": value})

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
        if not path.is_file():  # checked on every rank before any collective
            raise FileNotFoundError(f"ckpt_path={str(path)!r} does not exist; pass an existing checkpoint file, "
                                    "'last', or None to start fresh")
        return path

    def _choose_run_dir(self, resume_from: Path | None) -> Path:
        if resume_from is not None and resume_from.parent.name == "checkpoints":
            run_dir = resume_from.parent.parent  # a resumed run continues in its own directory
        else:
            run_dir = ckpt.next_run_dir(self.default_root_dir) if self.runtime.is_rank_zero else None
            run_dir = Path(self.runtime.broadcast_object(str(run_dir) if run_dir else None))
        if self.runtime.is_rank_zero:
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        self.runtime.barrier()
        return run_dir

    def _save(self, epoch: int, model, optimizer, scheduler) -> None:
        rt = self.runtime
        rngs = rt.all_gather_object(ckpt.rng_state())
        path = self.run_dir / "checkpoints" / ckpt.checkpoint_name(epoch + 1, self.global_step)
        state = {"model": model, "optimizer": optimizer, "epoch": epoch, "global_step": self.global_step,
                 "history": self.history, "rng": rngs, "world_size": rt.world_size}
        if scheduler is not None:
            state["scheduler"] = scheduler
        rt.save(path, state)  # ends with a barrier
        if rt.is_rank_zero:
            ckpt.mark_last(path, self.keep_last)

    def _load(self, path: Path, model, optimizer, scheduler) -> int:
        state = {"model": model, "optimizer": optimizer}
        if scheduler is not None:
            state["scheduler"] = scheduler
        rest = self.runtime.load(path, state)
        self.global_step = int(rest["global_step"])
        self.history = list(rest.get("history", []))
        rngs = rest.get("rng") or []
        if rngs:
            ckpt.set_rng_state(rngs[self.runtime.rank] if len(rngs) == self.runtime.world_size else rngs[0])
        self.runtime.print(f"trainscale: resumed from {path} (epoch {rest['epoch'] + 1}, step {self.global_step})")
        return int(rest["epoch"]) + 1

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
        }


def _epoch_line(record: dict, max_epochs: int) -> str:
    parts = [f"epoch {record['epoch'] + 1}/{max_epochs}", f"train_loss {record['train_loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    if "val_accuracy" in record:
        parts.append(f"val_acc {record['val_accuracy']:.4f}")
    parts += [f"{record['samples_per_s']:.0f} samples/s", f"{record['epoch_time_s']:.1f} s"]
    return "  ".join(parts)
