"""The GPU time model of the plan: the hardware catalogue, per-operator costs, the composition per strategy and mesh
axis, the accuracy table against published results, and ``trainscale plan --gpu`` as a user runs it."""

from __future__ import annotations

import importlib.util
import subprocess
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
        want = big.flops / (989e12 * efficiency.GEMM.at(s) * q) + efficiency.LAUNCH.at(s)
        assert gpu_time.op_seconds(big, h100, s) == pytest.approx(want)
    thin = _op("matmul", flops=2 * 8192 * 8192 * 8, nbytes=2 * (8192 * 8 * 2 + 8192 * 8192), gemm=(8192, 8192, 1))
    memory_s = thin.nbytes / (3.35e12 * efficiency.HBM.at("mid"))  # K = 8: bandwidth-bound
    assert gpu_time.op_seconds(thin, h100, "mid") == pytest.approx(memory_s + efficiency.LAUNCH.at("mid"))
    assert gpu_time.op_seconds(big, h100, "fast") < gpu_time.op_seconds(big, h100, "slow")
    fp32 = _op("matmul", flops=1e12, gemm=(8448, 8448, 1), dtype="fp32")
    assert gpu_time.op_seconds(fp32, h100, "mid", tf32=False) > 7 * gpu_time.op_seconds(fp32, h100, "mid")


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
    assert "Median absolute error over 12 rows" in published.format_table(results)


def test_cli_plan_gpu_prints_the_interval_hardware_and_constants():
    cmd = [sys.executable, "-m", "trainscale.cli", "plan", "--gpu", "h100-sxm", "--nodes", "2", "--gpus-per-node", "8",
           "--interconnect", "ib-400", "--batch-sizes", "32", "--strategy", "ddp"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "Hardware: 2 × 8 h100-sxm" in out.stdout and "gemm_fraction = 0.70–0.85" in out.stdout
    line = next(x for x in out.stdout.splitlines() if x.split()[:2] == ["16", "32"])
    assert "ms (" in line  # the step with its interval
    bad = subprocess.run([sys.executable, "-m", "trainscale.cli", "plan", "--gpu", "h1000"], capture_output=True,
                         text=True, timeout=240)
    assert bad.returncode == 2 and "unknown GPU 'h1000'" in bad.stderr


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
