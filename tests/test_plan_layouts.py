"""trainscale.plan's exact bytes for the model-parallel layouts (tp, hsdp): predicted parameter, gradient
and optimizer-state bytes equal those of a real gloo run of the small GPT (tp 2 on 2 processes, hsdp
2×2 on 4), and the shard arithmetic behind them (torch.chunk sizes of DTensor shards, the plan's styles
read per module, errors for plans that cannot be read), and hsdp's predicted peak within 15 % of the run's
live tensor bytes. Measurement: tests/plan_workers.py."""

import pytest
import torch
from torch import nn

from tests import plan_workers
from tests.helpers import run_distributed
from tests.parallel_workers import CONFIG
from trainscale.models import GPT, GPTConfig
from trainscale.models.gpt import lm_loss
from trainscale.plan import memory, planner

PEAK_TOLERANCE = 0.15


def _gpt_layout(config=CONFIG, precision="32-true"):
    meta = memory.build_meta_model(lambda: GPT(config))
    return meta, memory.optimizer_layout(meta, plan_workers.adamw, precision)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy, parallel, uneven", [
    ("tp", {"tp": 2}, False), ("tp", {"tp": 2}, True), ("hsdp", {"dp_replicate": 2, "dp_shard": 2}, False),
    ("tp", {"dp_shard": 2, "tp": 2}, True)])
def test_predicted_bytes_equal_a_real_run(strategy, parallel, uneven):
    world_size = 1
    for size in parallel.values():
        world_size *= size
    measured = run_distributed(plan_workers.measure_gpt_body, strategy, parallel, uneven, world_size=world_size,
                               timeout=300)
    meta, layout = _gpt_layout(plan_workers.gpt_config(uneven))
    predicted = [memory.exact_bytes(meta, layout, strategy, world_size, rank, "32-true", parallel=parallel)
                 for rank in range(world_size)]
    for rank, (exact, real) in enumerate(zip(predicted, measured)):
        for key in ("parameters", "gradients", "optimizer"):
            assert exact[key] == real[key], f"{strategy} rank {rank}: {key} predicted {exact[key]} != measured {real[key]}"
    if uneven:  # the shards really differ by rank, so the per-rank arithmetic is what is checked
        assert len({r["optimizer"] for r in measured}) > 1
    if strategy == "hsdp" or parallel == {"tp": 2}:  # the plan traces these peaks (hsdp: FSDP over the dp_shard
        # ranks; tp on one node: the Runtime's apply_tp on a fake process group); against MemTracker in the run
        tokens = torch.zeros(32, dtype=torch.long)  # the runs' 32-token windows (plan_workers._gpt_batches)
        work = planner.Workload(meta, (tokens, tokens), lm_loss, plan_workers.adamw)
        peak = planner._memory(meta, layout, work, strategy, world_size, 4, "32-true", (), {}, parallel).peak
        for rank, real in enumerate(measured):  # rank 0's prediction is the per-device maximum
            assert abs(peak - real["peak"]) <= PEAK_TOLERANCE * real["peak"], \
                f"{strategy} rank {rank}: peak predicted {peak} vs measured {real['peak']}"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_pp_stages_bytes_and_peaks_equal_a_real_run():
    """2 pipeline stages of the small GPT, 1F1B (the default) and GPipe, batch 4 in 4 micro-batches, in one pair of
    processes: each stage's exact bytes equal the run's, and its composed peak (trainscale.plan.pipeline: one traced
    micro-batch and torch's schedule) is within 15 % of the run's live tensor bytes, on both stages."""
    schedules = ("1f1b", "gpipe")
    measured = run_distributed(plan_workers.measure_pp_body, schedules, world_size=2, timeout=240)
    meta, layout = _gpt_layout()
    tokens = torch.zeros(32, dtype=torch.long)
    work = planner.Workload(meta, (tokens, tokens), lm_loss, plan_workers.adamw)
    for schedule in schedules:
        row = planner._pp_row(meta, layout, work, 2, 4, "32-true", (), {"pp_schedule": schedule}, 2**30)
        assert row.pipeline["schedule"] == schedule and row.pipeline["microbatches"] == 4
        for rank, real in enumerate(r[schedule] for r in measured):
            exact = memory.exact_bytes(meta, layout, "pp", 2, rank, "32-true")
            for key in ("parameters", "gradients", "optimizer"):
                assert exact[key] == real[key], f"{schedule} stage {rank}: {key} {exact[key]} != measured {real[key]}"
            peak = row.pipeline["peaks"][rank]
            assert abs(peak - real["peak"]) <= PEAK_TOLERANCE * real["peak"], \
                f"{schedule} stage {rank}: peak predicted {peak} vs measured {real['peak']}"
        assert row.memory.peak == max(row.pipeline["peaks"])  # the row shows the largest stage
    # GPipe holds all 4 micro-batches' activations, 1F1B at most P − s: the run and the plan see the difference
    assert all(r["gpipe"]["peak"] > r["1f1b"]["peak"] for r in measured)


def test_pp_rows_carry_the_bubble_in_their_time_and_name_what_cannot_be_split():
    from trainscale.plan import pipeline

    tokens = torch.zeros(CONFIG.context_length, dtype=torch.long)
    result = planner.plan(lambda: GPT(CONFIG), sample=(tokens, tokens), loss_fn=lm_loss, optimizer=plan_workers.adamw,
                          dataset_size=64, devices=[1, 2, 4], batch_sizes=[8], strategies=["pp"], device_memory="1GB",
                          link="10GB/s,latency=20us", device_flops=1e12)
    rows = {r.devices: r for r in result.rows}
    pp, t = rows[2], result.compute[8]
    # 4·P = 8 micro-batches of 1 sequence: the bubble is (P − 1)/(M + P − 1) = 1/9 of the step
    assert pp.pipeline["microbatches"] == 8 and pp.pipeline["bubble"] == pytest.approx(1 / 9)
    assert "1f1b, 8 micro-batches, bubble 11%" in pp.note
    share = pp.pipeline["compute_share"]  # stage 1 computes the tied output projection over the vocabulary too
    assert 0.5 < share < 1
    transfer = 20e-6 + 4 * CONFIG.context_length * CONFIG.n_embd / 10e9  # one fp32 (1, T, C) activation
    slots = 8 + 2 - 1
    assert pp.comm_s == pytest.approx(2 * slots * transfer)
    assert pp.step_s == pytest.approx(t.data_s + t.other_s + slots * ((t.forward_s + t.backward_s) * share / 8
                                      + 2 * transfer) + t.optimizer_s * pp.pipeline["optimizer_share"])
    assert pp.epoch_s == pytest.approx(pp.step_s * 8)  # one pipeline reads every batch: 64 samples / 8
    assert pp.efficiency == pytest.approx(pp.gain / 2)
    assert rows[1].note == "pp needs 2+ devices" and rows[1].memory is None
    assert rows[4].note.startswith("pp: pp=4 stages need at least as many GPT blocks") and rows[4].step_s is None
    assert "pp · 32-true" in result.table()
    # torch's Schedule1F1B: stage s runs min(M, P − s) forwards before its first backward; GPipe all M
    assert [pipeline.warmup("1f1b", 8, 4, s) for s in range(4)] == [4, 3, 2, 1]
    assert pipeline.warmup("gpipe", 8, 4, 3) == 8 and pipeline.warmup("1f1b", 2, 4, 3) == 2  # M < P: GPipe
    convnet = planner.plan(lambda: nn.Sequential(nn.Linear(4, 2)), sample=(torch.zeros(4), torch.tensor(0)),
                           strategies=["pp"], devices=[2], measure=False)
    assert "built-in split for trainscale.models.GPT only" in convnet.rows[0].note


def test_tp_shards_follow_the_plan_styles_and_torch_chunk():
    """The built-in GPT plan read per module: colwise linears on dim 0, rowwise on dim 1, the token
    embedding (tied output) by rows, the position embedding by columns; norms replicated. An uneven
    vocabulary splits 255 rows as torch.chunk does: 128 and 127."""
    config = GPTConfig(vocab_size=255, context_length=32, n_layer=1, n_head=4, n_embd=64)
    meta, layout = _gpt_layout(config)
    dims = memory.tp_shard_dims(meta, 2)
    block = meta.blocks[0]
    assert dims[id(meta.wte.weight)] == 0 and dims[id(meta.wpe.weight)] == 1
    assert dims[id(block.attn.q.weight)] == 0 and dims[id(block.mlp.fc.weight)] == 0
    assert dims[id(block.attn.proj.weight)] == 1 and dims[id(block.mlp.proj.weight)] == 1
    assert not any(id(p) in dims for p in meta.ln_f.parameters())
    assert [memory._chunk(255, 2, r) for r in range(2)] == [128, 127]
    assert [memory._chunk(5, 4, r) for r in range(4)] == [2, 2, 1, 0]  # torch.chunk(5 rows, 4): 2, 2, 1 and none

    full = memory.exact_bytes(meta, layout, "single", 1, 0, "32-true")
    ranks = [memory.exact_bytes(meta, layout, "tp", 2, r, "32-true") for r in range(2)]
    sharded = sum(p.numel() for p in meta.parameters() if id(p) in dims)
    replicated = sum(p.numel() for p in meta.parameters() if id(p) not in dims)
    # gradients (built unpadded) add up to the whole, norms counted on both ranks; rank 0 holds one more
    # vocabulary row of 64 fp32
    assert sum(r["gradients"] for r in ranks) == full["gradients"] + 4 * replicated
    assert ranks[0]["gradients"] - ranks[1]["gradients"] == 4 * 64
    assert ranks[0]["gradients"] == 4 * (replicated + (sharded - 255 * 64) // 2 + 128 * 64)
    # distribute_tensor scatters padded chunks: rank 1's 127 rows are a view of a 128-row storage
    assert ranks[1]["parameters"] == ranks[0]["parameters"] == ranks[0]["gradients"]
    per_state = len(layout) * 4  # AdamW's 0-d fp32 step per parameter tensor
    assert ranks[1]["optimizer"] == 2 * ranks[1]["gradients"] + per_state


def test_hsdp_shards_over_dp_shard_only_and_tp_composes_with_fsdp():
    meta, layout = _gpt_layout()
    fsdp2 = memory.exact_bytes(meta, layout, "fsdp", 2, 1, "32-true")
    hsdp = [memory.exact_bytes(meta, layout, "hsdp", 4, r, "32-true", parallel={"dp_replicate": 2, "dp_shard": 2})
            for r in range(4)]
    assert hsdp[3] == fsdp2 and hsdp[1] == fsdp2  # mesh (2, 2): ranks 1 and 3 hold shard 1
    tp2 = memory.exact_bytes(meta, layout, "tp", 2, 0, "32-true")
    tp2_fsdp2 = memory.exact_bytes(meta, layout, "tp", 4, 0, "32-true", parallel={"dp_shard": 2, "tp": 2})
    assert tp2_fsdp2["parameters"] == tp2["parameters"] // 2  # every dim 0 here is even


@pytest.mark.parametrize("call, message", [
    (lambda m, l: memory.exact_bytes(m, l, "hsdp", 4, 0, "32-true"), r"strategy='hsdp' .*dp_replicate"),
    (lambda m, l: memory.exact_bytes(m, l, "tp", 4, 0, "32-true", parallel={"tp": 2}), "multiplies to 2 ranks"),
    (lambda m, l: memory.exact_bytes(m, l, "tp", 8, 0, "32-true"), "must divide the GPT's n_head=4"),
])
def test_layouts_the_runtime_refuses_are_refused_early(call, message):
    meta, layout = _gpt_layout()
    with pytest.raises(ValueError, match=message):
        call(meta, layout)


def test_a_user_plan_is_read_and_an_unreadable_one_named():
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    meta = memory.build_meta_model(model)
    layout = memory.optimizer_layout(meta, plan_workers.adamw, "32-true")
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    rank1 = memory.exact_bytes(meta, layout, "tp", 2, 1, "32-true", tp_plan=plan)
    # rows 3 of 6 of layer 0 (weight and bias), column 3 of 6 of layer 2's weight, its bias whole
    assert rank1["parameters"] == 4 * (3 * 8 + 3 + 3 * 3 + 3)

    class Custom(ParallelStyle):
        def _apply(self, module, mesh):
            return module

    with pytest.raises(ValueError, match=r"tp_plan\['0'\]: the plan cannot read how Custom shards"):
        memory.exact_bytes(meta, layout, "tp", 2, 0, "32-true", tp_plan={"0": Custom()})
    with pytest.raises(ValueError, match="ColwiseParallel on a ReLU"):
        memory.exact_bytes(meta, layout, "tp", 2, 0, "32-true", tp_plan={"1": ColwiseParallel()})
    with pytest.raises(ValueError, match="name no submodule"):
        memory.exact_bytes(meta, layout, "tp", 2, 0, "32-true", tp_plan={"fc": ColwiseParallel()})


def test_plan_rows_for_tp_and_hsdp_carry_the_exact_bytes_and_a_time():
    from trainscale.models import lm_loss
    from trainscale.plan import comm, planner

    tokens = torch.zeros(CONFIG.context_length, dtype=torch.long)
    result = planner.plan(lambda: GPT(CONFIG), sample=(tokens, tokens), loss_fn=lm_loss, optimizer=plan_workers.adamw,
                          devices=[1, 2, 4], batch_sizes=[2], strategies=["ddp", "tp", "hsdp"], devices_per_node=2,
                          device_memory="1GB", link="10GB/s", device_flops=1e12)
    rows = {(r.strategy, r.devices): r for r in result.rows}
    meta, layout = _gpt_layout()
    for (strategy, n), parallel in {("tp", 2): {"tp": 2}, ("tp", 4): {"dp_shard": 2, "tp": 2},
                                    ("hsdp", 4): {"dp_replicate": 2, "dp_shard": 2}}.items():
        exact = memory.exact_bytes(meta, layout, strategy, n, 0, "32-true", parallel=parallel)
        got = rows[strategy, n].memory
        assert (got.parameters, got.gradients, got.optimizer) == (exact["parameters"], exact["gradients"],
                                                                  exact["optimizer"])
    assert rows["tp", 2].memory.peak > 0 and rows["tp", 2].fits is True  # traced on one node's 2 tp ranks
    assert rows["tp", 4].memory.peak is None and rows["tp", 4].fits is None  # tp x fsdp across nodes: not traced
    assert rows["tp", 4].step_s is None  # nor timed
    link, t = comm.parse_link("10GB/s"), result.compute[2]
    tp = rows["tp", 2]  # a rank's share of the compute (its share of the parameters) plus the traced collectives
    assert len(tp.memory.collectives) == 10 * CONFIG.n_layer + 8  # with sequence parallelism (test_plan_tp_trace)
    assert tp.comm_s == pytest.approx(comm.collectives_s(tp.memory.collectives, 2, link))
    share = tp.memory.parameters / sum(p.numel() * 4 for p in meta.parameters())
    assert 0.5 < share < 0.51  # the matrices split in two; the norms' few parameters whole
    assert tp.step_s == pytest.approx(t.data_s + t.other_s + (t.forward_s + t.backward_s + t.optimizer_s) * share
                                      + tp.comm_s)
    grads = sum(p.numel() * 4 for p in meta.parameters())  # hsdp: FSDP within the 2 shard ranks, then 1/2 of it
    hsdp = rows["hsdp", 4]  # all-reduced across the 2 replicas; with overlap 0 nothing is hidden
    assert hsdp.comm_s == pytest.approx(comm.hsdp_comm_s(grads, 0.0, grads, 2, 2, link))
    assert hsdp.step_s == pytest.approx(t.data_s + t.other_s + t.forward_s + t.backward_s + t.optimizer_s / 2
                                        + hsdp.comm_s)
    assert rows["hsdp", 4].memory.peak > 0 and rows["hsdp", 4].fits is True  # traced as FSDP over dp_shard 2
    assert rows["ddp", 2].step_s is not None
    assert rows["tp", 1].memory is None and rows["tp", 1].note == "tp needs 2+ devices"
    assert rows["hsdp", 2].note == "hsdp needs 2+ whole nodes of devices_per_node=2"
    assert "peak not traced across nodes" in result.table() and "dp_replicate 2 × dp_shard 2" in result.table()
    with pytest.raises(ValueError, match="plan models ddp, fsdp, hsdp, tp"):
        planner.plan(lambda: GPT(CONFIG), sample=(tokens, tokens), strategies=["cp"], measure=False)
    with pytest.raises(ValueError, match="built-in plan for trainscale.models.GPT only"):  # no plan for a ConvNet
        planner.plan(lambda: nn.Sequential(nn.Linear(4, 2)), sample=(torch.zeros(4), torch.tensor(0)),
                     strategies=["tp"], devices=[2], measure=False)
