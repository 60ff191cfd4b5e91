"""The step's one output path, and the step and epoch records (definitions of every number: docs/telemetry.md)."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainscale.loggers import record_metrics
from trainscale.scaling.lr_scaling import LearningRates
from trainscale.telemetry.sinks import JsonlSink

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime


class MetricsProcessor:
    """Where a fit's records go, once each (torchtitan's ``components/metrics.py`` ``MetricsProcessor`` and its
    loggers): :meth:`reduce_across_ranks` reduces a log interval's numbers over the ranks, :meth:`write` hands a
    record to each destination once: the run's own ``metrics.jsonl`` (what ``trainscale report``, ``check`` and
    ``bench`` read) and the experiment loggers the user chose (``trainscale.loggers``: CSV, TensorBoard, W&B,
    MLflow), which get its numbers as flat metrics (:func:`trainscale.loggers.record_metrics`).

    Args:
        telemetry: the fit's ``Telemetry`` (or ``NullTelemetry``): its ``log`` gathers every rank's interval.
        collector: the module's ``self.log`` values (``lightning.metrics.MetricCollector``): its
            ``take_step_values`` all-reduces those logged with ``sync_dist=True``.
        run_dir: the run directory on the rank that writes (rank zero); None on the others and under
            ``fast_dev_run``, which take part in the reductions and write nothing.
        loggers: set up here, then given ``hparams`` (none when it is None), then, for each that has Lightning's
            optional ``log_graph(model)``, ``model`` (Lightning's ``_log_hyperparams`` order); one whose setup raises
            ``ConnectionError`` (its server out of reach) is dropped with a warning.
    """

    def __init__(self, telemetry: Any, collector: Any, run_dir: Path | None, loggers: list, hparams: dict | None,
                 model: Any = None) -> None:
        self.telemetry, self.collector = telemetry, collector
        self.learning_rates = LearningRates()  # the param groups' names kept between log steps
        self.jsonl = JsonlSink(run_dir / "metrics.jsonl") if run_dir is not None else None
        self.loggers = []
        for lg in loggers if run_dir is not None else ():
            try:
                lg.setup(run_dir)
            except ConnectionError as err:  # a tracker out of reach: training does not wait for it
                warnings.warn(f"{err}; this run trains without {type(lg).__name__} (its metrics are in "
                              f"{run_dir}/metrics.jsonl)", RuntimeWarning, stacklevel=2)
                continue
            if hparams is not None:
                lg.log_hyperparams(hparams)
            log_graph = getattr(lg, "log_graph", None)
            if model is not None and callable(log_graph):
                log_graph(model)
            self.loggers.append(lg)

    def reduce_across_ranks(self, step: int, epoch: int, loss: torch.Tensor, grad_norm: torch.Tensor | None,
                            optimizers: list, schedulers=()) -> tuple[dict, dict]:
        """A log interval's numbers, on every rank (every rank must call it at the same step): trainscale's own
        (telemetry's, through one ``all_gather_single`` of each rank's interval sums; with telemetry off the
        loss alone), the gradient norm before clipping and every param group's learning rate
        (``lr-AdamW``, ...), and the module's ``self.log`` values (one all-reduce of those with
        ``sync_dist=True``). Reads ``loss`` and ``grad_norm``: one host sync each. Returns ``(own, user)``."""
        own = self.telemetry.log(step, epoch, loss)  # collective: all_gather_single
        if own is None:
            own = {"kind": "step", "rank": 0, "time": time.time(), "epoch": epoch, "step": step}
            if loss is not None:  # None: a manual training_step returned no loss
                own["train_loss"] = loss.item()
        if grad_norm is not None:
            own["grad_norm"] = grad_norm.item()
        own.update(self.learning_rates(optimizers, schedulers))
        return own, self.collector.take_step_values()  # collective: sync_dist's all-reduce

    def write(self, record: dict) -> None:
        """``record`` (with ``kind``, ``step``, ``epoch``) into metrics.jsonl and to each logger, once; nothing on
        a rank that does not write."""
        if self.jsonl is None:
            return
        self.jsonl.write(record)
        metrics = record_metrics(record)
        for lg in self.loggers:
            lg.log_metrics(metrics, record["step"])

    def close(self, status: str = "success") -> None:
        """Flush metrics.jsonl and finalize the loggers (``status``: "success" or "failed"); once."""
        if self.jsonl is not None:
            self.jsonl.close()
            for lg in self.loggers:
                lg.finalize(status)
        self.jsonl, self.loggers = None, []


def epoch_record(epoch: int, step: int, totals: tuple[float, float, float, float], seconds: float, complete: bool,
                 rates: dict[str, float]) -> dict:
    """The epoch's training numbers from its all-reduced ``totals`` (loss × samples, samples, tokens, samples
    with a loss), its duration in seconds and ``rates``, the learning rates it trained with (``LearningRates``,
    read before the epoch's schedulers step). ``train_loss`` is the mean over the samples with a loss, left out
    when there were samples but none reported a loss (a manual ``training_step`` that returns nothing), NaN for an
    epoch without samples.
    An epoch that ``max_steps`` cut short is marked ``partial`` (a resume replaces its record)."""
    loss_sum, samples, tokens, loss_samples = totals
    record = {"epoch": epoch, "step": step}
    if loss_samples or not samples:
        record["train_loss"] = loss_sum / loss_samples if loss_samples else float("nan")
    record.update(epoch_time_s=seconds, samples_per_s=samples / seconds if seconds > 0 else float("nan"))
    if tokens:
        record["tokens_per_s"] = tokens / seconds
    if not complete:
        record["partial"] = True
    record.update(rates)
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
    parts = [epoch_label(record["epoch"], max_epochs)]
    parts += [f"{k} {record[k]:.4f}" for k in ("train_loss", "val_loss", "val_accuracy") if k in record]
    parts.append(f"{record['samples_per_s']:.0f} samples/s")
    if record.get("tokens_per_s"):
        parts.append(f"{record['tokens_per_s']:.0f} tokens/s")
    parts.append(f"{record['epoch_time_s']:.1f} s")
    return "  ".join(parts)
