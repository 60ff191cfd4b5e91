"""One run of ``trainscale check``: K optimizer steps of the workload under the Trainer, recorded.

Started by :func:`trainscale.check.runner.check` through bench's launcher, one process per device::

    python -m torch.distributed.run --standalone --nproc-per-node=N -m trainscale.check.worker --config JOB.json

``JOB.json`` holds: entry, accelerator, strategy, precision, devices, micro_batch, steps, seed, trainer (the
Trainer flags of this run), probe_samples, run_dir. Every rank records, per micro-batch, the loss it
back-propagated, its samples, its targets that are not ``ignore_index`` (-100) and a checksum of its inputs;
per optimizer step (a step pre-hook, after the Trainer's own), the total gradient norm and the learning rate
``step()`` reads. After the run: the norm of the weights, each rank's buffers (sum and sum of squares) and
each rank's eval-mode outputs on a few fixed samples. Rank zero writes ``run_dir/trace.json``; a failing rank
``run_dir/error.rank<R>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainscale.callbacks.base import Callback

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer

IGNORE_INDEX = -100  # PyTorch's default ignore_index (F.cross_entropy, nn.CrossEntropyLoss, NLLLoss)
PROBE_VALUES = 256  # eval outputs kept per rank (the first values of the flattened output)


def _targets(batch: Any):
    """The integer targets of an ``(inputs, targets)`` batch or a dict's "labels"/"targets"; else None."""
    import torch

    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        target = batch[1]
    elif isinstance(batch, dict):
        target = batch.get("labels", batch.get("targets"))
    else:
        return None
    is_int = isinstance(target, torch.Tensor) and not torch.is_floating_point(target) and target.dtype != torch.bool
    return target if is_int else None


def _checksum(batch: Any) -> float:
    """The sum of every value of every tensor of ``batch`` (float64): the same for the same samples in any order."""
    import torch

    from trainscale.runtime.batch import tensors

    return float(sum(t.detach().to(torch.float64).sum().item() for t in tensors(batch)))


class Recorder(Callback):
    """Records what the module docstring lists; all ranks must run it (the FSDP gradient norm is a collective)."""

    def __init__(self) -> None:
        self.micro: list[list] = []  # [loss, samples, targets or None, checksum]
        self.steps: list[dict] = []  # {"grad_norm", "lr"}

    def on_fit_start(self, trainer: Trainer, module: Any) -> None:
        for opt in trainer.optimizers:  # registered after the Trainer's LR-scaling hook: sees the lr step() reads
            opt.register_step_pre_hook(self._on_step)

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        from trainscale.runtime.strategies.dtensor_clip import total_norm

        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.steps.append({"grad_norm": float(total_norm(grads)),
                           "lr": [float(group["lr"]) for group in optimizer.param_groups]})

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        from trainscale.runtime.batch import batch_size

        target = _targets(batch)
        valid = int((target != IGNORE_INDEX).sum()) if target is not None else None
        self.micro.append([float(outputs["loss"]), batch_size(batch), valid, _checksum(batch)])


def model_facts(model: Any) -> dict:
    """BatchNorm, SyncBatchNorm and dropout modules of ``model`` (counted before the strategy wraps it)."""
    from torch import nn

    modules = list(model.modules())
    return {"batchnorm": sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules),
            "sync_batchnorm": sum(isinstance(m, nn.SyncBatchNorm) for m in modules),
            "dropout": sum(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in modules)}


def _buffers(model: Any) -> dict[str, list[float]]:
    import torch

    return {name: [float(b.to(torch.float64).sum()), float(b.to(torch.float64).pow(2).sum())]
            for name, b in model.named_buffers() if b is not None and b.numel()}


def _probe(model: Any, dataset: Any, samples: int, device: Any) -> list[float] | None:
    """Eval-mode outputs of the user's module on the first ``samples`` samples of ``dataset`` (an
    ``(inputs, targets)`` data set); None for other data or a module that is not called on inputs."""
    import torch
    from torch.utils.data import default_collate

    if dataset is None or samples < 1 or hasattr(model, "training_step"):
        return None
    batch = default_collate([dataset[i] for i in range(min(samples, len(dataset)))])
    if not isinstance(batch, (list, tuple)) or len(batch) != 2 or not isinstance(batch[0], torch.Tensor):
        return None
    model.eval()
    with torch.no_grad():
        out = model(batch[0].to(device))
    return [float(v) for v in out.detach().flatten()[:PROBE_VALUES].to(torch.float64)]


def finals(trainer: Trainer, model: Any, work: dict, probe_samples: int) -> dict:
    """After the run, on every rank (collectives under fsdp): the norm of all weights, this rank's buffers and
    eval outputs, gathered to every rank."""
    from trainscale.runtime.strategies.dtensor_clip import total_norm

    rt = trainer.runtime
    weights = float(total_norm([p.detach() for p in model.parameters()]))
    probe = _probe(model, work["val"] if work["val"] is not None else work["train"], probe_samples, rt.device)
    mine = {"buffers": _buffers(model), "probe": probe}
    return {"weights_norm": weights, "ranks": rt.all_gather_object(mine)}


def run(cfg: dict) -> dict | None:
    """Train ``cfg["steps"]`` optimizer steps and record them; rank zero returns the trace."""
    import torch
    from torch.utils.data import DataLoader

    from trainscale.jobs.workload import load_workload
    from trainscale.loop.trainer import Trainer

    torch.manual_seed(cfg["seed"])
    work = load_workload(cfg["entry"])
    model, recorder = work["model"], Recorder()
    facts = model_facts(model)
    train = DataLoader(work["train"], batch_size=cfg["micro_batch"], shuffle=True, **(work["dataloader"] or {}))
    val = DataLoader(work["val"], batch_size=256) if work["val"] is not None else None
    optimizer = work["optimizer"] or (None if hasattr(model, "configure_optimizers") else
                                      (lambda params: torch.optim.AdamW(params, lr=1e-3)))
    trainer = Trainer(accelerator=cfg["accelerator"], devices=cfg["devices"], strategy=cfg["strategy"],
                      precision=cfg["precision"], seed=cfg["seed"], max_epochs=cfg["steps"], max_steps=cfg["steps"],
                      default_root_dir=Path(cfg["run_dir"]) / "trainer", enable_progress_bar=False,
                      enable_checkpointing=False, log_every_n_steps=10**9, timeout=cfg.get("collective_timeout", 300),
                      callbacks=[recorder], logger=False, **cfg["trainer"])
    summary = trainer.fit(model, train, val, loss_fn=work["loss_fn"], optimizer=optimizer)
    end = finals(trainer, model, work, cfg["probe_samples"])
    rt = trainer.runtime
    micro = rt.all_gather_object(recorder.micro)
    rt.teardown()
    if not rt.is_rank_zero:
        return None
    return {"world_size": rt.world_size, "strategy": summary["strategy"], "global_batch_size": trainer.global_batch_size,
            "micro_batch": cfg["micro_batch"], "accumulate": trainer.config.accumulate_grad_batches,
            "lr_scale_factor": trainer.batch_scaling.factor, "trainer": cfg["trainer"], "model": facts,
            "dataset_len": len(work["train"]), "val_len": len(work["val"]) if work["val"] is not None else None,
            "micro": micro, "steps": recorder.steps, "history": trainer.history, "final": end,
            "telemetry": summary.get("telemetry")}


def main(argv: list[str] | None = None) -> int:
    from trainscale.jobs.launcher import job_main

    return job_main(run, argv, "python -m trainscale.check.worker", "run_dir", "trace.json")


if __name__ == "__main__":
    sys.exit(main())
