"""trainscale.plan's memory against real runs: exact parameter/gradient/optimizer bytes and the peak of
live tensor bytes within 15 %, for the ConvNet under ddp (1, 2, 4 processes) and fsdp (2, 4), and with
bf16-mixed precision and activation checkpointing (2 processes), and 64-true (ddp 1, fsdp 2). Measurement: tests/plan_workers.py."""

import contextlib

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests import plan_workers
from tests.helpers import run_distributed
from trainscale.models import ConvNet
from trainscale.plan import memory

PEAK_TOLERANCE = 0.15
SAMPLE = (torch.zeros(1, 28, 28), torch.tensor(0))


def predict(strategy, precision, checkpointing, batchnorm, devices, rank):
    meta = memory.build_meta_model(lambda: ConvNet(batchnorm=batchnorm))
    layout = memory.optimizer_layout(meta, plan_workers.adamw, precision)
    exact = memory.exact_bytes(meta, layout, strategy, devices, rank, precision)
    traced = memory.traced_memory(meta, SAMPLE, plan_workers.BATCH, F.cross_entropy, plan_workers.adamw, strategy,
                                  devices, precision, activation_checkpointing=(nn.Sequential,) if checkpointing
                                  else (), rank=rank)
    return exact, traced["peak"] + exact["comm_buffers"]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_predicted_bytes_equal_a_real_run(world_size):
    measured = run_distributed(plan_workers.measure_body, world_size=world_size, timeout=300)
    for rank, by_config in enumerate(measured):
        for config, real in by_config.items():
            exact, peak = predict(*config, world_size, rank)
            where = f"{config} rank {rank}/{world_size}"
            for key in ("parameters", "gradients", "optimizer"):
                assert exact[key] == real[key], f"{where}: {key} predicted {exact[key]} != measured {real[key]}"
            assert abs(peak - real["peak"]) <= PEAK_TOLERANCE * real["peak"], \
                f"{where}: peak predicted {peak} vs measured {real['peak']}"


def test_sharded_bytes_follow_fsdp_padding_and_the_optimizer_layout():
    """Pure arithmetic, no processes: fc.weight (10, 1568) on 4 ranks is padded to 3 rows on every rank;
    AdamW's two states follow the unpadded shard (3, 3, 3, 1 rows), its step is one fp32 scalar."""
    meta = memory.build_meta_model(ConvNet)
    assert all(p.is_meta for p in meta.parameters())  # nothing allocated
    layout = memory.optimizer_layout(meta, plan_workers.adamw, "32-true")
    assert [name for name, _, _ in layout[0]] == ["step", "exp_avg", "exp_avg_sq"]
    n_params = sum(p.numel() for p in meta.parameters())
    ddp = memory.exact_bytes(meta, layout, "ddp", 2, 0, "32-true")
    assert ddp["parameters"] == ddp["gradients"] == ddp["comm_buffers"] == 4 * n_params
    assert ddp["optimizer"] == 2 * 4 * n_params + 4 * len(layout)
    assert memory._shard_rows(10, 4, 0) == (3, 3) and memory._shard_rows(10, 4, 3) == (3, 1)
    last = memory.exact_bytes(meta, layout, "fsdp", 4, 3, "32-true")
    first = memory.exact_bytes(meta, layout, "fsdp", 4, 0, "32-true")
    assert last["parameters"] == first["parameters"] and last["optimizer"] < first["optimizer"]
    bf16 = memory.exact_bytes(meta, memory.optimizer_layout(meta, plan_workers.adamw, "bf16-true"), "ddp", 1, 0,
                              "bf16-true")
    assert bf16["parameters"] == 2 * n_params and bf16["optimizer"] == 2 * 2 * n_params + 4 * len(layout)
    double = memory.exact_bytes(meta, memory.optimizer_layout(meta, plan_workers.adamw, "64-true"), "ddp", 2, 0,
                                "64-true")  # 8 bytes a parameter, gradient and state element; AdamW's step stays fp32
    assert double["parameters"] == double["gradients"] == double["comm_buffers"] == 8 * n_params
    assert double["optimizer"] == 2 * 8 * n_params + 4 * len(layout)
    norms = memory.build_meta_model(lambda: ConvNet(batchnorm=True))  # running statistics cast too, the count not
    counts = {precision: memory.exact_bytes(norms, memory.optimizer_layout(norms, plan_workers.adamw, precision),
                                            "ddp", 1, 0, precision)["buffers"] for precision in ("32-true", "64-true")}
    assert counts["64-true"] > counts["32-true"] > 0


def test_checkpointing_and_larger_batches_change_the_traced_activations():
    meta = memory.build_meta_model(ConvNet)
    plain = memory.traced_memory(meta, SAMPLE, 64, F.cross_entropy, plan_workers.adamw, "ddp", 1)
    double = memory.traced_memory(meta, SAMPLE, 128, F.cross_entropy, plan_workers.adamw, "ddp", 1)
    ac = memory.traced_memory(meta, SAMPLE, 64, F.cross_entropy, plan_workers.adamw, "ddp", 1,
                              activation_checkpointing=(nn.Sequential,))
    assert 1.9 < double["activations"] / plain["activations"] < 2.1
    assert ac["activations"] < 0.5 * plain["activations"]


def test_the_peak_only_tracker_keeps_torchs_peak_snapshot():
    """``PeakMemTracker`` drops the per-module peaks that torch's ``MemTracker`` updates on every operator; the
    tracker-wide peak the plan reads (each reference type's bytes) stays torch's, over the same two steps."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainscale.plan.memory import _traced_steps
    from trainscale.plan.trackers import PeakMemTracker

    peaks = []
    for tracker_class in (MemTracker, PeakMemTracker):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        optimizer = torch.optim.AdamW(model.parameters())
        batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))
        tracker = tracker_class()
        tracker.track_external(model, optimizer, *batch)
        activations = _traced_steps(model, optimizer, batch, nn.functional.cross_entropy, contextlib.nullcontext,
                                    tracker)
        peaks.append((tracker.get_tracker_snapshot("peak"), activations))
    assert peaks[0] == peaks[1] and peaks[0][1] > 0
