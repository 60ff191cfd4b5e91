"""Bodies of the telemetry multi-process tests (module level so ``spawn`` can import them).

Known sleeps are injected into each phase of the step so that the tests can check where the
time is attributed without depending on how fast the machine is.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests import workers

SLEEP = {"data_per_sample": 0.003, "forward": 0.02, "backward": 0.02, "optimizer": 0.008}


class SleepyDataset(Dataset):
    """``tiny_dataset`` whose ``__getitem__`` sleeps ``seconds`` on the ranks in ``ranks``."""

    def __init__(self, n: int, seconds: float, ranks: tuple[int, ...]) -> None:
        self.data = workers.tiny_dataset(n)
        self.seconds = seconds if int(os.environ.get("RANK", "0")) in ranks else 0.0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        if self.seconds:
            time.sleep(self.seconds)
        return self.data[i]


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SleepyModel(nn.Module):
    """The ConvNet, sleeping a known time in forward and in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = workers.make_model(0)

    def forward(self, x):
        time.sleep(SLEEP["forward"])
        return self.net(_SleepInBackward.apply(x.requires_grad_(), SLEEP["backward"]))


class SleepySGD(torch.optim.SGD):
    def step(self, closure=None):
        time.sleep(SLEEP["optimizer"])
        return super().step(closure)


def phases_body(rank: int, root: str) -> dict:
    """A short 2-rank fit with a known sleep in every phase."""
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=1, log_every_n_steps=4, default_root_dir=root,
                      enable_progress_bar=False, enable_checkpointing=False, timeout=60, count_flops=True)
    loader = DataLoader(SleepyDataset(96, SLEEP["data_per_sample"], ranks=(0, 1)), batch_size=4)
    summary = trainer.fit(SleepyModel(), loader, optimizer=lambda p: SleepySGD(p, lr=0.01))
    trainer.runtime.teardown()
    return {"summary": summary, "history": trainer.history}


def straggler_body(rank: int, root: str, seconds: float) -> dict:
    """A baseline fit, then the same fit with rank 1's data loading sleeping ``seconds`` per sample."""
    from trainscale.loop.trainer import Trainer

    out = {}
    for name, sleep in (("baseline", 0.0), ("straggler", seconds)):
        trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=1, log_every_n_steps=4,
                          default_root_dir=f"{root}/{name}",
                          enable_progress_bar=False, enable_checkpointing=False, timeout=60)
        loader = DataLoader(SleepyDataset(96, sleep, ranks=(1,)), batch_size=4)
        out[name] = trainer.fit(workers.make_model(0), loader, optimizer=workers.sgd)
    trainer.runtime.teardown()
    return out


def cuda_fit_body(rank: int, root: str) -> dict:
    """A short 2-GPU DDP fit (NCCL): CUDA-event timers, all-reduce timing, CUDA memory, NVML."""
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cuda", devices="auto", max_epochs=1, log_every_n_steps=4, default_root_dir=root,
                      enable_progress_bar=False, enable_checkpointing=False, timeout=60)
    summary = trainer.fit(workers.make_model(0), DataLoader(workers.tiny_dataset(256), batch_size=8),
                          optimizer=workers.sgd)
    trainer.runtime.teardown()
    return summary


class SlowRankMLP(nn.Module):
    """An MLP of ``layers`` 64-wide Linear layers whose forward sleeps ``seconds`` on the ranks in ``ranks``
    (a deterministic straggler: its compute is longer, nothing else differs)."""

    def __init__(self, seconds: float, ranks: tuple[int, ...] = (1,), width: int = 64, layers: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)),
                                 nn.Linear(width, 10))
        self.seconds = seconds if int(os.environ.get("RANK", "0")) in ranks else 0.0

    def forward(self, x):
        if self.seconds:
            time.sleep(self.seconds)
        return self.net(x)


class BucketCounter:
    """DDP comm-hook state: the buckets all-reduced."""

    def __init__(self) -> None:
        self.buckets = 0


def counting_allreduce_hook(state: BucketCounter, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.buckets += 1
    return allreduce_hook(None, bucket)  # DDP's default all-reduce


def slow_rank_body(rank: int, root: str, seconds: float, bucket_cap_mb: float) -> dict:
    """A 2-rank fit of :class:`SlowRankMLP` whose rank 1 sleeps ``seconds`` per forward, its gradients in
    buckets of ``bucket_cap_mb`` MiB (counted by the comm hook, which telemetry times as it would DDP's own)."""
    from trainscale.loop.trainer import Trainer

    counter = BucketCounter()
    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=1, log_every_n_steps=4, default_root_dir=root,
                      enable_progress_bar=False, enable_checkpointing=False, timeout=60,
                      strategy_options={"bucket_cap_mb": bucket_cap_mb, "ddp_comm_hook": counting_allreduce_hook,
                                        "ddp_comm_state": counter})
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(128, 64, generator=g), torch.randint(0, 10, (128,), generator=g))
    summary = trainer.fit(SlowRankMLP(seconds), DataLoader(data, batch_size=4), optimizer=workers.sgd)
    trainer.runtime.teardown()
    return {"summary": summary, "buckets_per_step": counter.buckets / trainer.global_step}
