"""DDP communication hooks through ``strategy_options``, and gradient accumulation's contract:
exactly one gradient all-reduce per optimizer step (counted by a hook on 2 real gloo ranks)."""

from __future__ import annotations

import pytest

from tests import workers
from tests.helpers import run_distributed

pytestmark = pytest.mark.multiprocess


def _fit_counting(rank: int, root: str) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from trainscale.loop.trainer import Trainer

    counter = workers.CallCounter()
    # 96 samples / 2 ranks / batch 8 = 6 micro-batches per epoch: groups of 4 and 2 (a short last group)
    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=2, accumulate_grad_batches=4, default_root_dir=root,
                      enable_progress_bar=False, enable_checkpointing=False, timeout=60,
                      strategy_options={"ddp_comm_hook": workers.counting_allreduce_hook, "ddp_comm_state": counter})
    model = workers.make_model(0)
    summary = trainer.fit(model, DataLoader(workers.tiny_dataset(96), batch_size=8, shuffle=True),
                          optimizer=workers.sgd)
    trainer.runtime.teardown()
    return {"allreduces": counter.calls, "steps": trainer.global_step, "comm_s": summary["telemetry"]["comm_s"],
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_accumulation_4_all_reduces_once_per_optimizer_step(tmp_path):
    results = run_distributed(_fit_counting, str(tmp_path), timeout=120)
    for r in results:
        assert r["steps"] == 2 * 2  # 2 epochs × 2 optimizer steps (4 + 2 micro-batches)
        assert r["allreduces"] == r["steps"]  # the model's gradients fit one bucket: one all-reduce per step
        assert r["comm_s"] is not None and r["comm_s"] >= 0  # telemetry timed the user's hook (DDP takes one)
    import torch

    for key, value in results[0]["state"].items():  # the hook's all-reduce kept the replicas equal
        torch.testing.assert_close(results[1]["state"][key], value, rtol=0, atol=0)
