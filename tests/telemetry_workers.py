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
    from trainscale.train.trainer import Trainer

    trainer = Trainer(devices="auto", max_epochs=1, log_every_n_steps=4, default_root_dir=root,
                      enable_progress_bar=False, enable_checkpointing=False, timeout=60, count_flops=True)
    loader = DataLoader(SleepyDataset(96, SLEEP["data_per_sample"], ranks=(0, 1)), batch_size=4)
    summary = trainer.fit(SleepyModel(), loader, optimizer=lambda p: SleepySGD(p, lr=0.01))
    trainer.runtime.teardown()
    return {"summary": summary, "history": trainer.history}


def straggler_body(rank: int, root: str, seconds: float) -> dict:
    """A baseline fit, then the same fit with rank 1's data loading sleeping ``seconds`` per sample."""
    from trainscale.train.trainer import Trainer

    out = {}
    for name, sleep in (("baseline", 0.0), ("straggler", seconds)):
        trainer = Trainer(devices="auto", max_epochs=1, log_every_n_steps=4, default_root_dir=f"{root}/{name}",
                          enable_progress_bar=False, enable_checkpointing=False, timeout=60)
        loader = DataLoader(SleepyDataset(96, sleep, ranks=(1,)), batch_size=4)
        out[name] = trainer.fit(workers.make_model(0), loader, optimizer=workers.sgd)
    trainer.runtime.teardown()
    return out


def cuda_fit_body(rank: int, root: str) -> dict:
    """A short 2-GPU DDP fit (NCCL): CUDA-event timers, all-reduce timing, CUDA memory, NVML."""
    from trainscale.train.trainer import Trainer

    trainer = Trainer(accelerator="cuda", devices="auto", max_epochs=1, log_every_n_steps=4, default_root_dir=root,
                      enable_progress_bar=False, enable_checkpointing=False, timeout=60)
    summary = trainer.fit(workers.make_model(0), DataLoader(workers.tiny_dataset(256), batch_size=8),
                          optimizer=workers.sgd)
    trainer.runtime.teardown()
    return summary
