"""The GPU time model of the plan: the hardware catalogue, per-operator costs, the composition per strategy and mesh
axis, the accuracy table against published results, and ``trainscale plan --gpu`` as a user runs it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from trainscale.plan import cluster as cl
from trainscale.plan import comm, efficiency, gpu_time, hardware
from trainscale.plan.op_trace import Op, OpLog, fused

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h100-hbm2e-500w", "h200", "b200", "l4", "mi300x",
            "v100")


def test_catalogue_has_every_required_part_with_its_source_and_refuses_unknown_names():
    for name in REQUIRED:
        g = hardware.gpu(name)
        assert g.source and g.hbm_bytes > 0 and g.hbm_bandwidth > 0 and g.sms > 0
        low, high = g.peak("fp16")
        assert 0 < low <= high
    assert hardware.gpu("h100-sxm").peak("bf16") == (989e12, 989e12)
    assert hardware.gpu("h100-hbm2e-500w").peak("bf16") == (835e12, 989e12)  # between NVL and SXM, as published
    assert hardware.gpu("h100-sxm").link_per_direction() == 450e9
    assert hardware.interconnect("ib-400").bandwidth == 50e9
    with pytest.raises(ValueError, match="no bf16 rate"):
        hardware.gpu("v100").peak("bf16")
    with pytest.raises(ValueError, match="h100-sxm"):
        hardware.gpu("h1000")
    with pytest.raises(ValueError, match="--interconnect ib-400"):
        hardware.cluster("h100-sxm", nodes=2)


def test_tile_and_wave_quantization_falls_for_small_and_odd_shapes():
    h100 = hardware.gpu("h100-sxm")  # 132 SMs
    assert gpu_time.quantization((128 * 132, 128, 1), h100) == pytest.approx(1.0)
    assert gpu_time.quantization((128 * 133, 128, 1), h100) == pytest.approx(133 / 264)  # a second wave of one tile
    assert gpu_time.quantization((64, 128 * 132, 1), h100) == pytest.approx(0.5)  # half of each tile is padding


def _op(kind, flops=0.0, nbytes=0.0, gemm=None, dtype="bf16", phase="forward", reads=(), writes=()):
    return Op("x", kind, flops, nbytes, dtype, gemm, phase, reads, writes)


def test_matmul_is_the_roofline_of_its_peak_and_bandwidth_plus_the_kernel_gap():
    h100 = hardware.gpu("h100-sxm")
    big = _op("matmul", flops=2 * 8448**3, nbytes=3 * 2 * 8448**2, gemm=(8448, 8448, 1))
    q = gpu_time.quantization(big.gemm, h100)
    for s in gpu_time.SCENARIOS:
        want = big.flops / (989e12 * efficiency.gemm("hopper", "bf16").at(s) * q) + efficiency.LAUNCH.at(s)
        assert gpu_time.op_seconds(big, h100, s) == pytest.approx(want)
    thin = _op("matmul", flops=2 * 8192 * 8192 * 8, nbytes=2 * (8192 * 8 * 2 + 8192 * 8192), gemm=(8192, 8192, 1))
    memory_s = thin.nbytes / (3.35e12 * efficiency.HBM.at("mid"))  # K = 8: bandwidth-bound
    assert gpu_time.op_seconds(thin, h100, "mid") == pytest.approx(memory_s + efficiency.LAUNCH.at("mid"))
    assert gpu_time.op_seconds(big, h100, "fast") < gpu_time.op_seconds(big, h100, "slow")
    fp32 = _op("matmul", flops=1e12, gemm=(8448, 8448, 1), dtype="fp32")
    assert gpu_time.op_seconds(fp32, h100, "mid", tf32=False) > 7 * gpu_time.op_seconds(fp32, h100, "mid")


def test_gemm_constants_are_measured_per_architecture_and_dtype_and_attention_is_flashattention_2_on_hopper():
    assert efficiency.gemm("hopper", "bf16").high == 0.803  # H100 SXM's MAMF, 794.5 of 989 TFLOP/s
    assert efficiency.gemm("hopper", "tf32") is efficiency.gemm("hopper", "fp16")
    assert efficiency.gemm("hopper", "fp8").high == 0.709 < efficiency.gemm("hopper", "bf16").low + 0.1
    assert efficiency.gemm("ampere", "bf16").high == 0.869
    assert efficiency.gemm("volta", "fp16") is efficiency.GEMM  # no published measurement: NVIDIA's guide
    assert efficiency.attention("hopper").low <= 0.35 <= efficiency.attention("hopper").high
    for c in efficiency.ALL:
        assert 0 < c.low < c.high and c.source, c.name
        assert c.name in str(c) and c.source in str(c)


def test_float8_scaling_kernels_add_to_the_matmul_once_per_operand_and_fuse_under_compile():
    h100 = hardware.gpu("h100-sxm")
    x, w, g = (1, 100e6), (2, 50e6), (3, 100e6)  # (storage key, bf16 bytes): activation, weight, gradient
    fwd = _op("matmul", flops=2e12, nbytes=300e6, gemm=(8448, 8448, 1), reads=(x, w), writes=((4, 100e6),))
    bwd = _op("matmul", flops=2e12, nbytes=300e6, gemm=(8448, 8448, 1), phase="backward", reads=(g, w))
    cast, produced = set(), {1, 3}  # x and the gradient come out of earlier kernels, the weight does not
    assert gpu_time.cast_bytes(fwd, cast, produced, compile=False) == 2.5 * 150e6
    assert gpu_time.cast_bytes(bwd, cast, produced, compile=False) == 2.5 * 100e6  # the weight's cast is reused
    assert gpu_time.cast_bytes(fwd, set(), produced, compile=True) == 1.5 * 100e6 + 2.5 * 50e6
    assert gpu_time.cast_bytes(fwd, set(), produced, compile=True, weights_fp8=True) == 1.5 * 100e6
    # the casts are kernels of their own: added to a compute-bound GEMM, not hidden under it
    gemm = gpu_time.op_seconds(fwd, h100, "mid", float8=True, cast_bytes=0.0)
    with_casts = gpu_time.op_seconds(fwd, h100, "mid", float8=True, cast_bytes=375e6)
    cast_s = 375e6 / (3.35e12 * efficiency.HBM.at("mid")) + efficiency.LAUNCH.at("mid")
    assert with_casts == pytest.approx(gemm + cast_s)
    assert gemm == pytest.approx(2e12 / (1979e12 * efficiency.gemm("hopper", "fp8").at("mid")
                                         * gpu_time.quantization(fwd.gemm, h100)) + efficiency.LAUNCH.at("mid"))


def test_live_peak_and_saved_bytes_follow_each_storage_from_its_write_to_its_last_read():
    from trainscale.plan.op_trace import live_peak, saved_bytes

    m = 2**20
    ops = [_op("matmul", reads=((0, m),), writes=((1, 4 * m),)),  # 0: a parameter read, never counted
           _op("memory", reads=((1, 4 * m),), writes=((2, 2 * m),)),  # 1 dies here
           _op("matmul", reads=((2, 2 * m),), writes=((3, 8 * m),)),  # 2 is read again in backward
           _op("attention", reads=((3, 8 * m),), writes=((4, m),)),
           _op("memory", phase="backward", reads=((4, m), (2, 2 * m)), writes=((5, m),))]
    assert live_peak(ops) == (2 + 8 + 1) * m  # op 3 holds 2, its input 3 and its output 4 (1 freed at its last read)
    assert live_peak(ops[:3]) == (2 + 8) * m
    assert saved_bytes(ops, None) == (2 + 1) * m  # what backward reads of what forward wrote
    assert saved_bytes(ops, "full") == 0
    assert saved_bytes([_op("matmul", writes=((9, m),)) if i % 2 else _op("memory") for i in range(4)], None) == 0
    mm = [Op("mm", "matmul", 1.0, 0.0, "bf16", (1, 1, 1), "forward", (), ((i, (i + 1) * m),)) for i in range(4)]
    assert saved_bytes(mm + [ops[3]], "selective") == (1 + 3) * m + m  # the 1st and 3rd mm, and attention
    with pytest.raises(ValueError, match="'selective'"):
        saved_bytes(ops, "some")


def test_caching_allocator_rounds_splits_merges_and_reserves_what_no_free_block_can_serve():
    from trainscale.plan.allocator import CachingAllocator, replay

    mib = 2**20
    a = CachingAllocator()
    a.malloc("tiny", 1)  # 512 bytes from a 2 MiB small-pool segment
    a.malloc("mid", 5 * mib)  # under 10 MiB: a 20 MiB segment, split: 15 MiB stay free
    a.malloc("big", 11 * mib + 1)  # rounded to 11 MiB + 512, from those 15 MiB (split again)
    assert (a.allocated, a.reserved) == (512 + 5 * mib + 11 * mib + 512, 2 * mib + 20 * mib)
    a.malloc("huge", 12 * mib)  # 4 MiB - 512 are free: a new segment, 12 MiB (a multiple of 2 MiB)
    assert a.reserved == 34 * mib
    a.free("big")  # merges with the free 4 MiB - 512 after it
    a.malloc("fits", 4 * mib)  # the smallest free block large enough: those 15 MiB
    a.free("mid")
    a.free("fits")  # merges with both neighbours: the 20 MiB segment is one free block again
    a.malloc("whole", 20 * mib)
    assert (a.reserved, a.peak_reserved) == (34 * mib, 34 * mib)
    # a freed block smaller than the next request stays reserved beside the new segment (never merged across segments)
    loss = replay([("malloc", "pred", 4 * 2**30), ("malloc", "x", 8 * 2**30), ("free", "pred"),
                   ("malloc", "y", 8 * 2**30), ("free", "x"), ("free", "y")])
    assert (loss.peak_allocated, loss.peak_reserved) == (16 * 2**30, 20 * 2**30)
    with pytest.raises(KeyError):
        a.free("mid")


def test_a_real_allocation_history_replays_to_the_bytes_the_gpu_reserved():
    """An H200's allocation history (tests/data; how it was recorded is in the file): replayed stream by stream, the
    model reserves the segments the device reserved, in the same order and sizes, and the peak reserved bytes
    ``torch.cuda.max_memory_reserved`` read at the end of the run."""
    import gzip
    import json
    from pathlib import Path

    from trainscale.plan.allocator import CachingAllocator

    path = Path(__file__).parent / "data" / "h200_gpt2_124m_ddp_alloc_history.json.gz"
    history = json.loads(gzip.decompress(path.read_bytes()))
    peak_reserved = 0
    for stream in (0, 1):
        events = [e for e in history["events"] if e[3] == stream]
        allocator, grown = CachingAllocator(), []
        for kind, address, size, _ in events:
            if kind == "alloc":
                before = allocator.reserved
                allocator.malloc(address, size)
                if allocator.reserved > before:
                    grown.append(allocator.reserved - before)
            elif kind == "free":
                allocator.free(address)
        assert grown == [size for kind, _, size, _ in events if kind == "segment"]
        peak_reserved += allocator.peak_reserved
    assert peak_reserved == history["max_memory_reserved"]


def test_allocation_events_hold_and_skip_storages_and_the_step_replays_1f1b_with_pp_gradients(monkeypatch):
    from trainscale.plan.allocator import replay
    from trainscale.plan.op_trace import allocation_events

    published = _published(monkeypatch)
    m = 16 * 2**20
    layer = [_op("matmul", reads=((0, m),), writes=((1, 2 * m),)),  # 0: a parameter, never allocated here
             _op("memory", reads=((1, 2 * m),), writes=((2, m),)),
             _op("memory", phase="backward", reads=((2, m), (1, 2 * m)), writes=((3, m),))]
    assert allocation_events(layer[:2], "f") == [("malloc", ("f", 1), 2 * m), ("malloc", ("f", 2), m),
                                                 ("free", ("f", 1)), ("free", ("f", 2))]
    assert allocation_events(layer[:2], "f", held={1}) == [("malloc", ("f", 1), 2 * m), ("malloc", ("f", 2), m),
                                                           ("free", ("f", 2))]
    assert [e[1][1] for e in allocation_events(layer, "b", skip={1}) if e[0] == "malloc"] == [2, 3]
    assert published.stage_layers(126, 8) == [15, 16, 16, 16, 16, 16, 16, 15]  # torchtitan's split of the 405B
    assert published.stage_layers(10, 4) == [2, 3, 3, 2] and published.stage_layers(80, 1) == [80]
    assert published._1f1b_order(0, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert published._1f1b_order(3, 4, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert published._1f1b_order(0, 4, 6) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                              ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    # stage 0 of 2, one layer, 2 micro-batches, full AC: F0 F1 B0 B1, each layer input m bytes; after the layer's first
    # backward its fp32 gradient (4 bytes x m parameters) stays. Peak live: input 1, the gradient, the recomputed 2m, m
    # and the gradient m = 9m. Reserved: 6m of segments by B0 (two inputs, 2m, and three m blocks), then the gradient's
    # 4m that no free block holds = 10m.
    spec = {"compile": False, "recompute": "full", "batch": 2, "seq": 1}
    ops = {"layer": layer, "hidden": m // 2, "layer_params": m}
    pool = replay(published._compute_events(spec, ops, cl.Layout(pp=2, microbatches=2), stage=0, layers=1))
    assert (pool.peak_allocated, pool.peak_reserved) == (9 * m, 10 * m)


def test_the_loss_region_holds_the_logits_as_torchtitan_computes_them(monkeypatch):
    """aten's cross-entropy holds at most 3 fp32 copies of the logits at once (backward: the saved log-softmax, the
    gradient of the loss and of the log-softmax); the loss-parallel one 4 (backward: the saved result, the zeroed
    gradient, the exponential of the result and their sum); compiled (AOTAutograd's min-cut partition, Inductor's
    fused kernels) none: the bf16 logits are saved and the bf16 gradient written from them."""
    from trainscale.plan.op_trace import lifetimes

    published = _published(monkeypatch)

    def most_alive(ops, nbytes):
        spans = [(first, last) for first, last, b in lifetimes(ops).values() if b == nbytes]
        return max(sum(first <= i <= last for first, last in spans) for i in range(len(ops)))

    tokens, tp = 64, 8
    fp32 = tokens * (published.VOCAB // tp) * 4
    assert most_alive(published.loss_ops("8B", tp, 1, tokens), fp32) == 4
    assert most_alive(published.loss_ops("8B", 1, 1, tokens), fp32 * tp) == 3
    compiled = published.loss_ops("8B", 1, 1, tokens, compiled=True)  # saves the bf16 logits, recomputes the softmax
    assert (most_alive(compiled, fp32 * tp), most_alive(compiled, fp32 * tp // 2)) == (0, 2)  # logits and gradient


def test_oplog_records_the_primitives_a_decomposed_graph_runs():
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x = torch.empty(256, 1024, dtype=torch.bfloat16)
        with OpLog() as log:
            torch.ops.prims.convert_element_type(x, torch.float32)
    assert [(op.name, [b for _, b in op.reads], [b for _, b in op.writes]) for op in log.ops] == [
        ("convert_element_type", [256 * 1024 * 2], [256 * 1024 * 4])]


def test_compile_fuses_a_pointwise_chain_into_one_kernel_reading_its_input_and_writing_its_result():
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x = torch.empty(1024, 1024)
        with OpLog() as log:
            y = torch.relu(x * 2 + 1)
            z = y @ y
    assert [op.kind for op in log.ops] == ["memory"] * 3 + ["matmul"]
    eager = sum(op.nbytes for op in log.ops[:3])
    kernels = fused(log.ops)
    assert [k.kind for k in kernels] == ["memory", "matmul"]
    assert kernels[0].nbytes == 2 * 4 * 1024**2 < eager == 6 * 4 * 1024**2  # x in, y out (read by the matmul)
    assert z.shape == (1024, 1024)


def test_links_per_mesh_axis_and_the_strategies_overlap():
    c = hardware.cluster("h100-sxm", 16, 8, "ib-400")
    nvlink = 450e9 * efficiency.NVLINK.at("mid")
    assert cl.axis_link(c, 8, 1, "mid").bus_bandwidth == pytest.approx(nvlink)  # tp inside a node
    ring = 8 * 50e9 * efficiency.NETWORK.at("mid")  # 8 NICs of the node carry a 128-rank ring
    assert cl.axis_link(c, 128, 1, "mid").bus_bandwidth == pytest.approx(ring)
    one_nic = 50e9 * efficiency.NETWORK.at("mid")  # dp_shard across nodes beside tp 8: one GPU per node
    assert cl.axis_link(c, 16, 8, "mid").bus_bandwidth == pytest.approx(one_nic)
    layer, outer = gpu_time.Phases(1.0, 2.0, 0.0, 10), gpu_time.Phases(0.0, 0.0, 0.0, 0)
    work = cl.Transformer(layer, outer, 0.0, 8, 1e6, 1e6)
    piped = cl.transformer_step(work, cl.Layout(pp=2, microbatches=6), hardware.cluster("h100-sxm", 1, 8), "mid")
    slot = 4 * 3.0  # 4 layers per stage
    assert piped["bubble_s"] / (piped["step_s"] - piped["p2p_s"]) == pytest.approx((2 - 1) / (6 + 2 - 1))
    assert piped["bubble_s"] == pytest.approx(slot)
    tp = cl.transformer_step(work, cl.Layout(tp=8), c, "mid")
    one = comm.all_reduce_s(1e6, 8, cl.axis_link(c, 8, 1, "mid"))
    assert tp["step_s"] == pytest.approx(8 * (3.0 + 4 * one)) and tp["tp_s"] == pytest.approx(8 * 4 * one)
    # float8 tensor parallelism gathers the fp8 cast in forward: half the bytes of those two all-gathers
    fp8 = cl.transformer_step(cl.Transformer(layer, outer, 0.0, 8, 1e6, 1e6, tp_gather_fraction=0.5),
                              cl.Layout(tp=8), c, "mid")
    link = cl.axis_link(c, 8, 1, "mid")
    saved = 8 * 2 * (comm.all_gather_s(1e6, 8, link) - comm.all_gather_s(0.5e6, 8, link))
    assert fp8["tp_s"] == pytest.approx(tp["tp_s"] - saved)
    # selective checkpointing saves the reduce-scatters' outputs, not the all-gathers': those run again in backward
    sac = cl.transformer_step(cl.Transformer(layer, outer, 0.0, 8, 1e6, 1e6, recompute="selective"), cl.Layout(tp=8),
                              c, "mid")
    assert sac["tp_s"] == pytest.approx(tp["tp_s"] + 8 * 2 * comm.all_gather_s(1e6, 8, link))
    # the root unit (embedding, output projection) is gathered before the first layer and reduced after the last
    rooted = cl.transformer_step(cl.Transformer(layer, outer, 0.0, 8, 1e6, 1e6, outer_params=4e6),
                                 cl.Layout(dp_shard=8), c, "mid")
    bare = cl.transformer_step(work, cl.Layout(dp_shard=8), c, "mid")
    root = comm.all_gather_s(4e6 * 2, 8, link) + comm.all_gather_s(4e6 * 4, 8, link)
    assert rooted["step_s"] - bare["step_s"] == pytest.approx(root)
    ddp = cl.ddp_step(gpu_time.Phases(1.0, 2.0, 0.1, 1), 100e6, 8, c, "mid")
    last = comm.all_reduce_s(100e6 - 3 * comm.DDP_BUCKET_BYTES, 8, cl.axis_link(c, 8, 1, "mid"))
    assert ddp["exposed_s"] == pytest.approx(last) and ddp["step_s"] == pytest.approx(3.1 + last)


def _published(monkeypatch):
    spec = importlib.util.spec_from_file_location("published", ROOT / "benchmarks" / "published.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "published", module)  # dataclasses look their module up there
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts src/ on the path
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_published_rows_lie_in_their_interval_or_within_the_documented_error(monkeypatch):
    published = _published(monkeypatch)
    results = published.evaluate()
    assert len(results) >= 8
    for r in results:
        assert r["low"] <= r["mid"] <= r["high"]
        assert r["inside"] or abs(r["error"]) <= published.ERROR_BOUND, (r["model"], r["config"], r["error"])
    assert published.median_abs_error(results) <= published.MEDIAN_BOUND
    memory = published.memory_errors(results)
    assert len(memory) >= 8 and all(abs(e) <= published.MEMORY_BOUND for e in memory), memory
    assert f"Median absolute error over {len(results)} rows" in published.format_table(results)


def test_cli_plan_gpu_prints_the_interval_hardware_and_constants(capsys):
    from trainscale.cli import main  # in-process: the subprocess cost 10 s of interpreter and import start-up

    args = ["plan", "--gpu", "h100-sxm", "--nodes", "2", "--gpus-per-node", "8", "--interconnect", "ib-400",
            "--batch-sizes", "32", "--strategy", "ddp"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Hardware: 2 × 8 h100-sxm" in out and "gemm_fraction[hopper] = 0.66–0.80" in out
    line = next(x for x in out.splitlines() if x.split()[:2] == ["16", "32"])
    assert "ms (" in line  # the step with its interval
    assert main(["plan", "--gpu", "h1000"]) == 2
    assert "unknown GPU 'h1000'" in capsys.readouterr().err


def test_plan_on_a_catalogue_gpu_gives_each_row_an_interval_and_names_its_constants():
    from trainscale.models import ConvNet
    from trainscale.plan import planner

    sample = (torch.zeros(1, 28, 28), torch.tensor(0))
    result = planner.plan(ConvNet, sample=sample, devices=[8, 16], batch_sizes=[256], strategies=["ddp"],
                          gpu="a100-80gb", nodes=2, interconnect="ib-200")
    assert result.device_memory == 80e9 and result.hardware.startswith("2 × 8 a100-80gb")
    assert result.overlap == {256: 1.0} and result.overlap_source.startswith("modelled")
    assert any(c.startswith("network_busbw_fraction") for c in result.constants)
    eight, sixteen = result.rows
    for row in result.rows:
        fast, slow = row.step_interval
        assert fast < row.step_s < slow
    # 16 GPUs span 2 nodes: the all-reduce crosses 8 × 200 Gb/s instead of NVLink
    assert sixteen.comm_s > eight.comm_s
    assert result.compute[256].device == "a100-80gb (modelled, mid)"
