"""The run summary (``summary.json``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainscale.lightning.hparams import merged_hparams
from trainscale.telemetry.report import summary_line

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime
    from trainscale.loop.trainer import Trainer


def run_summary(trainer: Trainer, global_batch: int, resumed_from: Path | None, nonfinite_skipped: int) -> dict:
    """World, flags, final metrics, epoch times and throughput of a finished ``fit``."""
    rt = trainer.runtime
    history = trainer.state.history
    last = history[-1] if history else {}
    times = [h["epoch_time_s"] for h in history]
    total_samples = sum(h["samples_per_s"] * h["epoch_time_s"] for h in history)
    return {
        "world_size": rt.world_size, "strategy": rt.config.strategy, "precision": rt.config.precision,
        "accelerator": rt.config.accelerator, "device": str(rt.device), "num_nodes": rt.config.num_nodes,
        "epochs": len(history), "steps": trainer.global_step, "global_batch_size": global_batch,
        "accumulate_grad_batches": trainer.accumulate_grad_batches, "seed": trainer.fit_seed,
        "train_loss": last.get("train_loss"), "val_loss": last.get("val_loss"),
        "val_accuracy": last.get("val_accuracy"), "epoch_time_s": times,
        "samples_per_s": total_samples / sum(times) if times else None,
        "torch_version": torch.__version__, "run_dir": str(trainer.run_dir),
        "resumed_from": str(resumed_from) if resumed_from is not None else None,
        "restart_count": rt.world.restart_count, "nonfinite_skipped": nonfinite_skipped,
        "checkpoints": trainer.checkpoints.summary(),  # this rank's save stalls and background write seconds
        "lr_scaling": trainer.batch_scaling.summary(), "flags": trainer_flags(trainer),
    }


def hyperparams(trainer: Trainer, model: Any) -> dict | None:
    """What the loggers record as the run's hyperparameters, as Lightning: those the model and
    ``trainer.datamodule`` saved (``save_hyperparameters()``), as first saved; None when neither saved any (the
    loggers then get no ``log_hyperparams`` call). The Trainer's own flags are in ``summary.json`` ("flags").

    Raises:
        RuntimeError: the model and the data module hold one name with different values (``merged_hparams``).
    """
    return merged_hparams(model, trainer.datamodule)


def trainer_flags(trainer: Trainer) -> dict:
    """The Trainer's flags as ``summary.json`` keeps them: JSON's own types as they are, other values
    (``default_root_dir``, ``max_time``, ...) as their ``str``."""
    return {k: v if isinstance(v, (type(None), bool, int, float, str)) else str(v)
            for k, v in dataclasses.asdict(trainer.config).items()}


def pipeline_summary(runtime: Runtime, module: Any) -> dict | None:
    """Under pipeline stages (strategy "pp"): stages, schedule, micro-batches per batch, the bubble fraction
    (P − 1)/(M + P − 1) (Huang et al. 2019, "GPipe", §2.2) and each rank's parameter bytes (exact tensor
    bytes of its stage, of its shard under FSDP; a collective). None under other strategies."""
    from trainscale.runtime.strategies.pipeline import bubble_fraction

    cfg = runtime.config
    if cfg.pp_schedule is None:
        return None
    return {"stages": cfg.parallel.pp, "schedule": cfg.pp_schedule, "microbatches": cfg.pp_microbatches,
            "bubble_fraction": bubble_fraction(cfg.parallel.pp, cfg.pp_microbatches),
            "param_bytes_per_rank": runtime.all_gather_object(sum((p.to_local() if hasattr(p, "to_local") else p).nbytes
                                                                  for p in module.parameters()))}


def finish_run(trainer: Trainer, fit: Any, global_batch: int, resumed_from: Path | None, nonfinite_skipped: int) -> dict:
    """The summary with the run's telemetry (a collective), printed and written to ``summary.json`` by
    rank zero after metrics.jsonl and the loggers are closed. Every rank returns it."""
    rt = trainer.runtime
    summary = run_summary(trainer, global_batch, resumed_from, nonfinite_skipped)
    pipeline = pipeline_summary(rt, fit.wrapped)
    if pipeline is not None:
        summary["pipeline"] = pipeline
    summary["telemetry"] = fit.telemetry.summary()
    if summary["telemetry"] is not None:
        rt.print(summary_line(summary["telemetry"]))
    if fit.metrics.jsonl is not None:  # the rank that writes
        fit.metrics.close("success")
        (trainer.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    rt.barrier()
    return summary
