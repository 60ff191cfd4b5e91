"""Telemetry of real 2-rank gloo fits, and ``trainscale report`` on the run directory they leave.

Known sleeps are injected into every phase (tests/telemetry_workers.py): the checks are lower
bounds and ratios, never absolute speeds, so a loaded machine cannot fail them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import telemetry_workers as tw
from tests.helpers import run_distributed

PHASES = ("data", "forward", "backward", "optimizer")
BATCH, WORLD, LOG_EVERY, STEPS = 4, 2, 4, 12  # 96 samples / 2 ranks / batch 4 = 12 steps
SLOW_FORWARD_S, BUCKET_CAP_MB = 0.05, 0.016  # 0.016 MiB: one 64×64 Linear layer's gradients per bucket
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def phases_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("phases")
    results = run_distributed(tw.phases_body, str(root), timeout=180)
    run_dir = root / "version_0"
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return results, run_dir, records


@pytest.mark.multiprocess
def test_phases_add_up_and_land_where_the_time_went(phases_run):
    results, _, records = phases_run
    steps = [r for r in records if r["kind"] == "step"]
    # one record set per log interval, written by rank zero only, reduced over ranks
    assert [r["step"] for r in steps] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert all(r["rank"] == "all" for r in records)
    assert [r["kind"] for r in records].count("epoch") == 1
    min_phase = {"data": BATCH * tw.SLEEP["data_per_sample"], "forward": tw.SLEEP["forward"],
                 "backward": tw.SLEEP["backward"], "optimizer": tw.SLEEP["optimizer"]}
    for r in steps:
        assert set(r["phase_s"]) == set(PHASES) and all(v >= 0 for v in r["phase_s"].values())
        assert sum(r["phase_s"].values()) == pytest.approx(r["step_time_s"], rel=0.10)
        for p in PHASES:  # each rank's phase holds at least the sleep injected into it
            assert all(v >= min_phase[p] for v in r["rank_phase_s"][p]), (p, r["rank_phase_s"][p])
        assert all(c >= 0 for c in r["rank_comm_s"])
        # throughput = samples / time: samples counted from the batches, time from the step timer
        assert r["samples"] == BATCH * WORLD * LOG_EVERY
        assert r["samples_per_s"] == pytest.approx(r["samples"] / (r["steps"] * r["step_time_s"]), rel=0.01)
    # rank 0's phases against rank 0's own epoch clock (the Trainer's perf_counter around the loop;
    # the difference is the logging, which is left out of steps)
    epoch_time = results[0]["history"][0]["epoch_time_s"]
    phase_total = sum(sum(r["rank_phase_s"][p][0] for p in PHASES) * r["steps"] for r in steps)
    assert phase_total == pytest.approx(epoch_time, rel=0.10)


@pytest.mark.multiprocess
def test_summary_telemetry_contract_on_two_ranks(phases_run):
    results, run_dir, _ = phases_run
    tele = results[0]["summary"]["telemetry"]
    assert tele == results[1]["summary"]["telemetry"]  # the same reduced numbers on every rank
    assert json.loads((run_dir / "summary.json").read_text())["telemetry"] == json.loads(json.dumps(tele))
    assert tele["samples_per_s"] * tele["step_time_s"] == pytest.approx(BATCH * WORLD, rel=0.01)
    assert tele["samples_per_s_per_device"] == pytest.approx(tele["samples_per_s"] / WORLD)
    assert sum(tele["phase_share"].values()) == pytest.approx(1.0)
    assert tele["comm_s"] is not None and 0 <= tele["comm_s"] < tele["phase_s"]["backward"] + 1e-9
    assert 0 <= tele["exposed_comm_s"] <= tele["comm_s"]
    assert tele["exposed_comm_share"] == pytest.approx(tele["exposed_comm_s"] / tele["step_time_s"])
    assert len(tele["peak_memory_bytes"]) == WORLD and tele["peak_memory_kind"] == "rss"
    assert tele["flops_per_sample"] > 1e6 and tele["mfu"] is None  # count_flops=True on CPU: FLOP/s, no MFU


@pytest.mark.multiprocess
def test_straggler_is_named_and_its_data_wait_shows(tmp_path):
    out = run_distributed(tw.straggler_body, str(tmp_path), 0.01, timeout=180)[0]
    base, slow = out["baseline"]["telemetry"], out["straggler"]["telemetry"]
    assert slow["straggler_ranks"] == [1] and slow["slowest_rank"] == 1
    assert slow["phase_share"]["data"] > base["phase_share"]["data"] + 0.1
    records = [json.loads(line) for line in open(tmp_path / "straggler" / "version_0" / "metrics.jsonl")]
    steps = [r for r in records if r["kind"] == "step"]
    # every interval after the first (which holds start-up skew) names rank 1, and only rank 1
    assert all(r["straggler_ranks"] == [1] for r in steps[1:])
    for r in steps:
        data0, data1 = r["rank_phase_s"]["data"]
        assert data1 > data0 + BATCH * 0.01 * 0.8
    for r in steps[1:]:
        comm0, comm1 = r["rank_comm_s"]
        assert comm0 > comm1  # rank 0 waits for rank 1 inside the all-reduce ...
        exposed0, exposed1 = r["rank_exposed_comm_s"]
        assert exposed0 > exposed1  # ... at the end of its backward
        compute0, compute1 = r["rank_compute_s"]
        assert compute1 > compute0


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_slow_rank_named_while_step_times_are_equal_and_comm_is_a_union_of_buckets(tmp_path):
    """Rank 1 sleeps in every forward (tests/telemetry_workers.py ``SlowRankMLP``); its gradients go in
    several buckets (``bucket_cap_mb``: about one Linear layer each). The all-reduce evens the step times
    out, so rank 0 waits for rank 1 at the end of its backward (exposed communication) and rank 1 is named
    by its longer compute. Each of rank 0's buckets holds that same wait: summed over buckets (before the
    union) its all-reduce time came to ~4× its step time."""
    out = run_distributed(tw.slow_rank_body, str(tmp_path), SLOW_FORWARD_S, BUCKET_CAP_MB, timeout=180)
    assert all(o["buckets_per_step"] > 3 for o in out)  # several buckets in flight per step
    tele = out[0]["summary"]["telemetry"]
    steps = [json.loads(line) for line in open(tmp_path / "version_0" / "metrics.jsonl")]
    steps = [r for r in steps if r["kind"] == "step"]
    for r in steps:
        for rank in range(WORLD):  # overlapping buckets counted once: within the step
            assert r["rank_comm_s"][rank] <= r["rank_step_time_s"][rank], (rank, r)
            assert 0 <= r["rank_exposed_comm_s"][rank] <= r["rank_comm_s"][rank]
    assert 0 <= tele["exposed_comm_s"] <= tele["comm_s"] <= tele["step_time_s"]
    assert tele["exposed_comm_share"] == pytest.approx(tele["exposed_comm_s"] / tele["step_time_s"])
    assert tele["straggler_ranks"] == [1] and tele["slowest_rank"] == 1
    for r in steps[1:]:  # the first interval holds start-up skew
        step0, step1 = r["rank_step_time_s"]
        compute0, compute1 = r["rank_compute_s"]
        exposed0, exposed1 = r["rank_exposed_comm_s"]
        assert abs(step0 - step1) < 0.5 * SLOW_FORWARD_S  # equal step times, within noise ...
        assert compute1 - compute0 > 0.5 * SLOW_FORWARD_S  # ... while rank 1 computes longer
        assert exposed0 - exposed1 > 0.5 * SLOW_FORWARD_S  # and rank 0 waits for it after its backward
        assert r["straggler_ranks"] == [1]


@pytest.mark.multiprocess
def test_report_cli_on_a_real_run_directory(phases_run):
    _, run_dir, _ = phases_run
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    out = subprocess.run([str(BIN / "trainscale"), "report", str(run_dir)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("loss_accuracy.png", "throughput.png", "step_phases.png", "memory.png"):
        data = (run_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    assert not (run_dir / "gpu_utilization.png").exists()  # no NVML on a CPU run
    text = (run_dir / "report.txt").read_text()
    assert text in out.stdout
    assert "where the time goes" in text and "slowest rank:" in text and "all-reduce" in text
    for p in PHASES:
        assert p in text
    shares = [float(line.split()[1]) for line in text.splitlines() if line.strip().split(" ")[0] in PHASES]
    assert len(shares) == 4 and sum(shares) == pytest.approx(100, abs=0.5)


def test_report_cli_without_metrics_is_a_one_line_error(tmp_path):
    out = subprocess.run([str(BIN / "trainscale"), "report", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "no metrics.jsonl" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_two_gpu_ddp_telemetry(tmp_path):
    import importlib.util

    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    tele = run_distributed(tw.cuda_fit_body, str(tmp_path), timeout=180)[0]["telemetry"]
    assert tele["peak_memory_kind"] == "cuda_allocated" and all(m > 0 for m in tele["peak_memory_bytes"])
    assert tele["comm_s"] is not None and 0 <= tele["comm_s"] <= tele["phase_s"]["backward"] * 1.05
    assert 0 <= tele["exposed_comm_s"] <= tele["comm_s"]
    assert sum(tele["phase_s"].values()) == pytest.approx(tele["step_time_s"], rel=0.1)
    if importlib.util.find_spec("pynvml") is not None:
        assert tele["gpu_utilization"] is not None and len(tele["gpu_utilization"]) == 2
