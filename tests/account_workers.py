"""Faults of known size for the speed-up account (tests/test_account_faults.py), module level so the ranks can
import them: a loader that sleeps per batch, one rank that sleeps per step, an all-reduce slowed by a DDP comm hook.

A small MLP keeps the step's own work around a millisecond, so the injected sleeps (tens of ms) stand far above a
loaded machine's noise.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from trainscale.callbacks.base import Callback

BATCH, STEPS = 8, 16  # per device; the telemetry leaves the first 2 steps out
DATA_S, STRAGGLER_S, COMM_S = 0.060, 0.080, 0.050  # what each fault injects, seconds per step
CASES = {"data": {"data": DATA_S}, "straggler": {"straggler": STRAGGLER_S}, "comm": {"comm": COMM_S},
         "all three": {"data": DATA_S, "straggler": STRAGGLER_S, "comm": COMM_S}}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def loader(devices: int, data_sleep_s: float) -> DataLoader:
    """``STEPS`` batches of ``BATCH`` per device; the collate function sleeps ``data_sleep_s`` per batch (in this
    process: no loader workers)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(BATCH * STEPS * devices, 32, generator=g),
                         torch.randint(0, 10, (BATCH * STEPS * devices,), generator=g))

    def collate(samples):
        time.sleep(data_sleep_s)
        return default_collate(samples)

    return DataLoader(data, batch_size=BATCH, collate_fn=collate, num_workers=0)


class SleepOnRank(Callback):
    """Rank ``rank`` sleeps ``seconds`` at the start of every batch (in its forward phase): a straggler."""

    def __init__(self, seconds: float, rank: int = 1) -> None:
        self.seconds = seconds if int(os.environ.get("RANK", "0")) == rank else 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.seconds:
            time.sleep(self.seconds)


def slow_allreduce_hook(seconds: float, bucket):
    """DDP's default all-reduce, started ``seconds`` late: a collective slowed by a wrapper."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    time.sleep(seconds)
    return allreduce_hook(None, bucket)


def fit(devices, root: str, faults: dict):
    """One fit with the given faults (``{"data": s, "straggler": s, "comm": s}``, any of them): its summary and
    the Trainer."""
    from trainscale.loop.trainer import Trainer

    options = {"ddp_comm_hook": slow_allreduce_hook, "ddp_comm_state": faults["comm"]} if "comm" in faults else {}
    trainer = Trainer(accelerator="cpu", devices=devices, max_epochs=1, default_root_dir=root, enable_progress_bar=False,
                      enable_checkpointing=False, logger=False, timeout=60, strategy_options=options,
                      callbacks=[SleepOnRank(faults.get("straggler", 0.0))])
    summary = trainer.fit(model(), loader(2 if devices == "auto" else devices, faults.get("data", 0.0)),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    return summary, trainer


def faults_body(rank: int, root: str) -> dict:
    """Each case of :data:`CASES` in turn on the same 2 ranks, on one process group; every case's summary."""
    out = {}
    for name, faults in CASES.items():
        out[name], trainer = fit("auto", f"{root}/{name.replace(' ', '_')}", faults)
    trainer.runtime.teardown()
    return out
