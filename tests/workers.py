"""Bodies of the multi-process tests (module level so ``spawn`` can import them)."""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainscale.callbacks import Callback
from trainscale.lightning.module import TrainingModule
from trainscale.models import ConvNet


def tiny_dataset(n: int = 96, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return TensorDataset(x, y)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ConvNet(batchnorm=False)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def plain_pytorch_reference(batch_size: int, epochs: int, seed: int = 0, n: int = 96,
                            dtype: torch.dtype = torch.float32) -> dict:
    """A hand-written single-process loop over the samples DistributedSampler(num_replicas=1) gives; with
    ``dtype`` float64 the model and the samples cast to it, as ``model.double()`` in plain PyTorch."""
    x_all, y_all = tiny_dataset(n).tensors
    ds = TensorDataset(x_all.to(dtype), y_all)
    model = make_model(seed).to(dtype)
    opt = sgd(model.parameters())
    for epoch in range(epochs):
        g = torch.Generator()
        g.manual_seed(seed + epoch)  # DistributedSampler's shuffling
        perm = torch.randperm(len(ds), generator=g)
        for start in range(0, len(ds), batch_size):
            x, y = ds[perm[start:start + batch_size]]
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trainer_fit(rank: int, root: str, batch_size: int, epochs: int, extra: dict | None = None,
                ckpt_path=None, n: int = 96, teardown: bool = True) -> dict:
    from trainscale.loop.trainer import Trainer

    flags = {"devices": "auto", "max_epochs": epochs, "seed": 0, "default_root_dir": root,
             "enable_progress_bar": False, "timeout": 60, **(extra or {})}
    trainer = Trainer(accelerator="cpu", **flags)
    model = make_model(0)
    summary = trainer.fit(model, DataLoader(tiny_dataset(n), batch_size=batch_size, shuffle=True),
                          DataLoader(tiny_dataset(50, seed=1), batch_size=8), optimizer=sgd, ckpt_path=ckpt_path)
    if teardown:  # several Trainers in one process share the process group; the last tears it down
        trainer.runtime.teardown()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "summary": summary}


def resume_body(rank: int, root: str) -> dict:
    """Uninterrupted 3 epochs against 1 epoch, then resume from "last" for the rest."""
    from trainscale.loop.trainer import Trainer

    full = trainer_fit(rank, f"{root}/full", 8, 3, teardown=False)
    first = trainer_fit(rank, f"{root}/stopped", 8, 1, teardown=False)
    resumed = trainer_fit(rank, f"{root}/stopped", 8, 3, ckpt_path="last")
    return {"full": full, "first": first, "resumed": resumed}


def validate_body(rank: int, n: int) -> dict:
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", enable_progress_bar=False, timeout=60)
    model = make_model(0)
    (out,) = trainer.validate(model, DataLoader(tiny_dataset(n, seed=3), batch_size=8))
    trainer.runtime.teardown()
    return out


def bad_ckpt_body(rank: int, path: str) -> str:
    """Both ranks must raise at once (no hang) on a missing or corrupted checkpoint."""
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", enable_progress_bar=False, timeout=60,
                      default_root_dir=path + ".root")
    try:
        trainer.fit(make_model(0), DataLoader(tiny_dataset(16), batch_size=4), optimizer=sgd, ckpt_path=path)
    except Exception as err:  # noqa: BLE001 - returned to the test to check type and message
        return f"{type(err).__name__}: {err}"
    finally:
        trainer.runtime.teardown()
    return "no error"


class LrUsed(Callback):
    """A callback recording, at every optimizer step, the lr of each param group as ``step()`` reads it
    (an optimizer step pre-hook registered in ``on_fit_start``), and the groups' values after each whole
    training step (``on_train_batch_end`` of a step's last micro-batch: the schedule's, after it stepped)."""

    def __init__(self) -> None:
        self.used: list[list[float]] = []
        self.between: list[list[float]] = []

    def on_fit_start(self, trainer, module) -> None:
        for opt in trainer.optimizers:
            opt.register_step_pre_hook(lambda o, a, k: self.used.append([float(g["lr"]) for g in o.param_groups]))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.is_step_end:
            self.between.append([float(g["lr"]) for opt in trainer.optimizers for g in opt.param_groups])


def lr_scaling_body(rank: int, root: str) -> dict:
    """2 ranks × 8 samples × 2 accumulation = global batch 32, base 8, linear: SGD's 0.05 becomes 0.2."""
    import json

    from trainscale.loop.trainer import Trainer

    used = LrUsed()
    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=1, max_steps=3, accumulate_grad_batches=2,
                      lr_scaling="linear",
                      base_batch_size=8, log_every_n_steps=1, default_root_dir=root, enable_progress_bar=False,
                      enable_checkpointing=False, timeout=60, callbacks=[used], logger=False)
    summary = trainer.fit(make_model(0), DataLoader(tiny_dataset(96), batch_size=8), optimizer=sgd)
    trainer.runtime.teardown()
    logged = []
    if rank == 0:
        records = [json.loads(line) for line in open(f"{summary['run_dir']}/metrics.jsonl")]
        logged = [r["lr-SGD"] for r in records if r.get("kind") == "step"]
    return {"used": used.used, "logged": logged, "summary": summary, "global_batch_size": trainer.global_batch_size}


def step_trace_body(rank: int, root: str) -> dict | None:
    """``benchmarks/step_trace.py``'s traced fit on this rank (the benchmarks folder is not a package: put on the
    path here, in the rank's own process); rank zero returns the figures of its plain and logging steps."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import step_trace

    return step_trace.trace_steps(rank, root, devices=2)


def csv_logger_body(rank: int, root: str) -> dict:
    """A 2-rank fit with Lightning's ``CSVLogger(root/logs, name="exp")``, then one with the default logger, then one
    whose ``version=0`` is the first's: what each rank sees of their directories, and the refusal."""
    from trainscale.loggers import CSVLogger
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=1, default_root_dir=f"{root}/runs", timeout=60,
                      enable_progress_bar=False, log_every_n_steps=1, logger=CSVLogger(f"{root}/logs", name="exp"))
    trainer.fit(make_model(0), DataLoader(tiny_dataset(32), batch_size=8), optimizer=sgd)
    seen = {"log_dir": trainer.log_dir, "logger_log_dir": trainer.logger.log_dir, "version": trainer.logger.version}
    default = Trainer(accelerator="cpu", devices="auto", max_epochs=1, default_root_dir=f"{root}/runs", timeout=60,
                      enable_progress_bar=False)  # the default CSVLogger: the run directory
    default.fit(make_model(0), DataLoader(tiny_dataset(32), batch_size=8), optimizer=sgd)
    seen["default_log_dir"] = default.log_dir
    again = Trainer(accelerator="cpu", devices="auto", max_epochs=1, default_root_dir=f"{root}/runs", timeout=60,
                    enable_progress_bar=False, logger=CSVLogger(f"{root}/logs", name="exp", version=0))
    try:  # version_0 holds the first fit's files: refused on every rank, before training
        again.fit(make_model(0), DataLoader(tiny_dataset(32), batch_size=8), optimizer=sgd)
    except FileExistsError as err:
        seen["refusal"] = str(err)
    default.runtime.teardown()  # the process group the Trainers share
    return seen


class ClockedModule(TrainingModule):
    """Moves a fake clock on: ``step_s`` seconds per training step and ``val_s`` per validation (the clock's
    ``offset``, which ``fake_monotonic`` adds to the real ``time.monotonic``)."""

    def __init__(self, clock: dict, step_s: float, val_s: float):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.clock, self.step_s, self.val_s = clock, step_s, val_s

    def training_step(self, batch, batch_idx):
        self.clock["offset"] += self.step_s
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.layer(batch[0]).pow(2).mean(), sync_dist=True)

    def on_validation_end(self):
        self.clock["offset"] += self.val_s

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def pairs_loader(n: int) -> DataLoader:
    x = torch.arange(n, dtype=torch.float32).repeat(2, 1).T
    return DataLoader(TensorDataset(x, torch.zeros(n, dtype=torch.long)), batch_size=1)


def fit_on_a_fake_clock(root: str, step_s: float, flags: dict, devices: int | str = 1, n: int = 10):
    """A fit on ``n`` one-sample batches whose ``time.monotonic`` runs ``step_s`` fake seconds per training step and
    1200 per validation (the real clock's few seconds besides); restored after. Returns the Trainer."""
    import time

    from trainscale.loop.trainer import Trainer

    real, clock = time.monotonic, {"offset": 0.0}
    time.monotonic = lambda: real() + clock["offset"]
    try:
        trainer = Trainer(accelerator="cpu", devices=devices, default_root_dir=root, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0, timeout=60, **flags)
        trainer.fit(ClockedModule(clock, step_s, 1200.0), pairs_loader(n), pairs_loader(4))
    finally:
        time.monotonic = real
    return trainer


def clocks_apart_body(rank: int, root: str) -> list[int]:
    """2 ranks (10 batches each) whose clocks run at different speeds (rank 1's at 0.3× rank 0's) with a time-based
    ``val_check_interval``: the steps after which each validated."""
    trainer = fit_on_a_fake_clock(f"{root}/r{rank}", 1000.0 if rank == 0 else 300.0,
                                  {"max_epochs": 1, "val_check_interval": "00:00:41:40"}, devices="auto", n=20)
    trainer.runtime.teardown()
    return trainer.validated_at


class CallCounter:
    """The state of :func:`counting_allreduce_hook`: its calls on this rank."""

    def __init__(self) -> None:
        self.calls = 0


def counting_allreduce_hook(state: CallCounter, bucket):
    """A DDP communication hook (``strategy_options={"ddp_comm_hook": ...}``) that counts its calls, one per gradient
    bucket all-reduced, then all-reduces as DDP's default does."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.calls += 1
    return allreduce_hook(None, bucket)
