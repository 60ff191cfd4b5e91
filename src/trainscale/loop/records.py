"""The step and epoch records the Trainer writes (definitions of every number: docs/telemetry.md)."""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING, Any

import torch

from trainscale.loggers import record_metrics
from trainscale.lightning.optimizers import learning_rates
from trainscale.telemetry.sinks import default_sinks

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime


class RecordWriter:
    """Rank zero's destinations of records: the run's own files (``metrics.jsonl``, CSV; TensorBoard with
    ``tensorboard``) and every experiment logger (``trainscale.loggers``), set up with ``hparams``; a logger whose
    setup raises ``ConnectionError`` (its server out of reach) is dropped with a warning."""

    def __init__(self, run_dir: Any, tensorboard: bool, loggers: list, hparams: dict) -> None:
        self.sinks = default_sinks(run_dir, tensorboard=tensorboard)
        self.loggers = []
        for lg in loggers:
            try:
                lg.setup(run_dir)
            except ConnectionError as err:  # a tracker out of reach: training does not wait for it
                warnings.warn(f"{err}; this run trains without {type(lg).__name__} (its metrics are in "
                              f"{run_dir}/metrics.jsonl)", RuntimeWarning, stacklevel=2)
                continue
            lg.log_hyperparams(hparams)
            self.loggers.append(lg)

    def write(self, record: dict) -> None:
        self.sinks.write(record)
        metrics = record_metrics(record)
        for lg in self.loggers:
            lg.log_metrics(metrics, record["step"])

    def close(self, status: str = "success") -> None:
        """Flush the files and finalize the loggers (``status``: "success" or "failed")."""
        self.sinks.close()
        for lg in self.loggers:
            lg.finalize(status)


def step_record(telemetry: Any, step: int, epoch: int, loss: torch.Tensor, grad_norm: torch.Tensor | None,
                optimizers) -> dict:
    """The record of a log interval: telemetry's (a collective on every rank), or with telemetry off the
    loss alone, and every param group's learning rate (``lr-AdamW``, ...). Reads ``loss`` and ``grad_norm``
    (the total norm before clipping): one host sync each."""
    record = telemetry.log(step, epoch, loss)
    if record is None:
        record = {"kind": "step", "rank": 0, "time": time.time(), "epoch": epoch, "step": step,
                  "train_loss": loss.item()}
    if grad_norm is not None:
        record["grad_norm"] = grad_norm.item()
    record.update(learning_rates(optimizers))
    return record


def epoch_record(epoch: int, step: int, totals: tuple[float, float, float], seconds: float, complete: bool,
                 optimizers) -> dict:
    """The epoch's training numbers from its all-reduced ``totals`` (loss × samples, samples, tokens), its
    duration in seconds and the learning rates it trained with (taken before the epoch's schedulers step).
    An epoch that ``max_steps`` cut short is marked ``partial`` (a resume replaces its record)."""
    loss_sum, samples, tokens = totals
    record = {"epoch": epoch, "step": step, "train_loss": loss_sum / samples if samples else float("nan"),
              "epoch_time_s": seconds, "samples_per_s": samples / seconds if seconds > 0 else float("nan")}
    if tokens:
        record["tokens_per_s"] = tokens / seconds
    if not complete:
        record["partial"] = True
    record.update(learning_rates(optimizers))
    return record


def run_header(runtime: Runtime, global_batch: int, run_dir: Any) -> str:
    """The line printed on rank zero when training starts."""
    rt = runtime
    return (f"trainscale: {rt.config.strategy} × {rt.world_size} ({rt.device.type}), precision {rt.config.precision}, "
            f"global batch {global_batch}, run dir {run_dir}")


def epoch_label(epoch: int, max_epochs: int) -> str:
    """``epoch 3/10`` for the 0-based ``epoch`` 2 (``epoch 3`` when ``max_epochs`` is -1: no limit)."""
    return f"epoch {epoch + 1}" + (f"/{max_epochs}" if max_epochs != -1 else "")


def epoch_line(record: dict, max_epochs: int) -> str:
    """The line printed on rank zero at an epoch end."""
    parts = [epoch_label(record["epoch"], max_epochs), f"train_loss {record['train_loss']:.4f}"]
    parts += [f"{k} {record[k]:.4f}" for k in ("val_loss", "val_accuracy") if k in record]
    parts.append(f"{record['samples_per_s']:.0f} samples/s")
    if record.get("tokens_per_s"):
        parts.append(f"{record['tokens_per_s']:.0f} tokens/s")
    parts.append(f"{record['epoch_time_s']:.1f} s")
    return "  ".join(parts)
