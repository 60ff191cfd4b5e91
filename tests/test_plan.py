"""trainscale.plan: the communication formulas, the link parser and fit, plan() and its picks, the CLI.
Memory against real runs: tests/test_plan_memory.py."""

import json
import subprocess
import sys

import pytest
import torch

from trainscale import cli
from trainscale.models import ConvNet
from trainscale.plan import comm, planner, probe
from trainscale.plan.memory import build_meta_model, exact_bytes, optimizer_layout

SAMPLE = (torch.zeros(1, 28, 28), torch.tensor(0))


def test_collective_formulas_follow_nccl_tests_bus_bandwidth():
    link = comm.Link(bus_bandwidth=100e9, latency=0.0)
    assert comm.all_reduce_s(1e9, 8, link) == pytest.approx(2 * 7 / 8 * 1e9 / 100e9)
    assert comm.all_gather_s(1e9, 8, link) == pytest.approx(7 / 8 * 1e9 / 100e9)
    assert comm.all_reduce_s(1e9, 1, link) == 0.0
    slow = comm.Link(bus_bandwidth=100e9, latency=10e-6)
    assert comm.all_reduce_s(0.0, 2, slow) == 0.0 and comm.all_reduce_s(8.0, 2, slow) == pytest.approx(2e-5 + 8e-11)
    # DDP: 60 MiB of gradients = 2 full 25 MiB buckets + one of 10 MiB, each paying the latency
    assert comm.ddp_comm_s(60 * 2**20, 4, slow) == pytest.approx(3 * 6 * 10e-6 + 60 * 2**20 * 1.5 / 100e9)
    # DDP broadcasts the buffers before each forward: a pipelined broadcast, busbw = algbw (nccl-tests)
    assert comm.broadcast_s(1e9, 8, link) == pytest.approx(1e9 / 100e9) and comm.broadcast_s(1e9, 1, link) == 0.0
    assert comm.ddp_comm_s(60 * 2**20, 4, slow, buffer_bytes=800.0) == pytest.approx(
        comm.ddp_comm_s(60 * 2**20, 4, slow) + 3 * 10e-6 + 800 / 100e9)
    assert comm.ddp_buckets(60 * 2**20) == [25 * 2**20, 25 * 2**20, 10 * 2**20] and comm.ddp_buckets(0) == []
    assert comm.step_s(1.0, 2.0, 0.5, 3.0, overlap=0.0) == 6.5
    assert comm.step_s(1.0, 2.0, 0.5, 3.0, overlap=1.0) == 4.5 and comm.step_s(1.0, 2.0, 0.5, 1.0, overlap=1.0) == 3.5
    assert comm.steps_per_epoch(4000, 64, 2) == 32 and comm.steps_per_epoch(4001, 64, 1) == 63


def test_link_and_memory_sizes_parse_or_name_the_fix():
    link = comm.parse_link("400GB/s,latency=10us")
    assert link.bus_bandwidth == 400e9 and link.latency == pytest.approx(10e-6)
    assert comm.parse_link("25GiB/s").latency == 10e-6
    assert comm.parse_bytes("80GB") == 80 * 10**9 and comm.parse_bytes("1.5GiB") == 3 * 2**29
    for bad in ("400GB", "fast/s", "400GB/s,lat=3us", "400GB/s,latency=3 parsecs"):
        with pytest.raises(ValueError, match="--bandwidth 400GB/s,latency=10us"):
            comm.parse_link(bad)
    with pytest.raises(ValueError, match="80GB"):
        comm.parse_bytes("eighty")


def test_fit_link_recovers_the_link_that_made_the_times():
    truth = comm.Link(bus_bandwidth=3e9, latency=40e-6)
    sizes = [2**12, 2**16, 2**20, 2**24]
    fitted = probe.fit_link(sizes, [comm.all_reduce_s(s, 2, truth) for s in sizes], 2)
    assert fitted.bus_bandwidth == pytest.approx(3e9) and fitted.latency == pytest.approx(40e-6)
    with pytest.raises(ValueError, match="do not grow"):
        probe.fit_link(sizes, [1.0, 0.9, 0.8, 0.7], 2)


def test_plan_rows_fits_and_picks_follow_the_device_memory():
    meta = build_meta_model(ConvNet)
    exact = exact_bytes(meta, optimizer_layout(meta, lambda p: torch.optim.AdamW(p), "32-true"), "ddp", 1, 0,
                        "32-true")
    first = planner.plan(ConvNet, sample=SAMPLE, devices=[1, 2, 4], batch_sizes=[16], device_memory="1GB")
    by = {(r.strategy, r.devices): r for r in first.rows}
    assert by[("ddp", 2)].memory.parameters == exact["parameters"]
    assert by[("fsdp", 1)].memory is None and "2+ devices" in by[("fsdp", 1)].note
    assert by[("fsdp", 4)].memory.peak < by[("fsdp", 2)].memory.peak < by[("ddp", 2)].memory.peak
    assert first.link is None and all(r.step_s is None for r in first.rows)
    # a device memory between the fsdp-4 and the ddp peaks: only the sharded rows fit
    limit = (by[("fsdp", 2)].memory.peak + by[("ddp", 2)].memory.peak) // 2
    tight = planner.plan(ConvNet, sample=SAMPLE, devices=[1, 2, 4], batch_sizes=[16], device_memory=limit)
    assert {(r.strategy, r.devices) for r in tight.rows if r.fits} == {("fsdp", 2), ("fsdp", 4)}
    assert (tight.smallest().strategy, tight.smallest().devices) == ("fsdp", 4)
    assert "Smallest memory that fits: fsdp on 4 devices at bs 16/device" in tight.table()
    with pytest.raises(ValueError, match="sample="):
        planner.plan(ConvNet, devices=[1])
    with pytest.raises(ValueError, match="plan models ddp, fsdp"):
        planner.plan(ConvNet, sample=SAMPLE, strategies=["cp"])


def test_plan_time_adds_the_modelled_communication_to_the_measured_step():
    link = comm.Link(bus_bandwidth=1e9, latency=1e-4)
    result = planner.plan(ConvNet, sample=SAMPLE, dataset_size=1000, devices=[1, 2, 8], batch_sizes=[8],
                          strategies=["ddp"], device_memory="1GB", link=link)
    t = result.compute[8]
    grad_bytes = 4 * sum(p.numel() for p in ConvNet().parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in ConvNet().buffers())  # BatchNorm statistics
    assert result.overlap == {8: 0.0} and result.overlap_source.startswith("assumed none")
    for row in result.rows:  # the Trainer's loop over copies of the sample: its step, plus the collectives
        assert row.comm_s == pytest.approx(comm.ddp_comm_s(grad_bytes, row.devices, link, buffer_bytes=buffer_bytes))
        assert row.step_s == pytest.approx(t.step_s + row.comm_s)
        assert row.epoch_s == pytest.approx(row.step_s * comm.steps_per_epoch(1000, 8, row.devices))
        assert row.efficiency == pytest.approx(row.gain / row.devices)
    one, eight = result.rows[0], result.rows[2]
    assert one.gain == pytest.approx(1.0) and eight.comm_s > result.rows[1].comm_s
    assert result.fastest() is not None and "Fastest that fits" in result.table()


def test_cli_plan_prints_the_table_and_refuses_bad_flags(tmp_path, monkeypatch, capsys):
    out = subprocess.run([sys.executable, "-m", "trainscale.cli", "plan", "--devices", "1,2", "--batch-sizes", "8",
                          "--device-memory", "1GB", "--bandwidth", "10GB/s,latency=20us", "--json",
                          str(tmp_path / "plan.json")], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "ddp · 32-true" in out.stdout and "fsdp · 32-true" in out.stdout and "Fastest that fits" in out.stdout
    rows = json.loads((tmp_path / "plan.json").read_text())
    assert {r["strategy"] for r in rows} == {"ddp", "fsdp"} and rows[0]["peak_bytes"] > rows[0]["parameters_bytes"]
    monkeypatch.setattr(sys, "path", list(sys.path))  # the command puts the current directory on it
    assert cli.main(["plan", "--bandwidth", "fast"]) == 2  # in this process: the error comes before any work
    assert "--bandwidth 400GB/s,latency=10us" in capsys.readouterr().err
    # a zero memory printed a table in which nothing fits; zero FLOP/s was ignored
    assert cli.main(["plan", "--device-memory", "0"]) == 2
    assert "device_memory='0' is no memory" in capsys.readouterr().err
    assert cli.main(["plan", "--device-flops", "0"]) == 2
    assert "device_flops=0.0 must be a positive FLOP/s" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_probe_fits_a_link_and_times_a_real_ddp_run_in_two_gloo_processes(tmp_path):
    work = planner.Workload(ConvNet(), SAMPLE, torch.nn.functional.cross_entropy, lambda p: torch.optim.AdamW(p))
    steps = {"workload": work, "batch_sizes": [4, 16], "precision": "32-true", "threads": 1, "root": str(tmp_path)}
    link, raw = probe.probe(2, sizes=(2**12, 2**24), reps=5, steps=steps)  # 4 KiB vs 16 MiB: bandwidth, not noise
    assert link.source == "probe" and link.bus_bandwidth > 0 and link.latency >= 0
    assert raw["world_size"] == 2 and len(raw["all_reduce"]) == len(raw["all_gather"]) == 2
    # the ConvNet trained by the Trainer under ddp in both processes: its telemetry saw the all-reduce
    assert set(raw["steps"]) == {4, 16}
    for t in raw["steps"].values():
        assert t["forward_s"] > 0 and t["backward_s"] > 0 and t["comm_s"] + t["hidden_comm_s"] > 0
    assert sorted(p.name for p in tmp_path.iterdir())  # the runs were written under the root given


def test_a_trainer_summary_becomes_compute_times_with_the_exposed_all_reduce_out_of_backward():
    from trainscale.plan.measure import from_summary

    summary = {"steps": 10, "epoch_time_s": [0.5], "device": "cpu",
               "telemetry": {"phase_s": {"data": 0.001, "forward": 0.010, "backward": 0.030, "optimizer": 0.004},
                             "comm_s": 0.012, "exposed_comm_s": 0.002}}
    t = from_summary(8, summary)
    assert (t.forward_s, t.backward_s, t.comm_s) == pytest.approx((0.010, 0.028, 0.002))
    assert t.hidden_comm_s == pytest.approx(0.010) and t.overlap == pytest.approx(0.010 / 0.028)
    assert t.other_s == pytest.approx(0.05 - 0.045) and t.step_s == pytest.approx(0.05)  # the loop's wall time
    one = from_summary(8, {**summary, "telemetry": {**summary["telemetry"], "comm_s": None, "exposed_comm_s": None}})
    assert one.comm_s == one.hidden_comm_s == one.overlap == 0.0 and one.backward_s == 0.030
    with pytest.raises(ValueError, match="telemetry"):
        from_summary(8, {"steps": 10, "epoch_time_s": [0.5], "telemetry": None})


def test_the_timed_run_lasts_the_least_steps_or_the_least_seconds_whichever_is_longer():
    from trainscale.plan.measure import _timed_steps

    assert _timed_steps({"steps": 3, "epoch_time_s": [0.03]}, 20, 2.0) == 200  # 10 ms steps: 2 s is 200 of them
    assert _timed_steps({"steps": 3, "epoch_time_s": [3.0]}, 20, 2.0) == 20  # 1 s steps: the 20 steps are longer
    assert _timed_steps({"steps": 3, "epoch_time_s": [0.0]}, 20, 2.0) == 20


def test_probed_rows_take_the_ddp_run_whole_and_its_measured_overlap_elsewhere():
    from trainscale.plan.measure import ComputeTime

    link = comm.Link(bus_bandwidth=1e9, latency=1e-4)
    one = ComputeTime(8, 0.010, 0.020, 0.003, "cpu", data_s=0.001, other_s=0.0005)
    # 2 processes through the Trainer under ddp: 0.006 s of the all-reduce exposed, 0.005 s hidden in backward
    together = ComputeTime(8, 0.015, 0.025, 0.004, "cpu", comm_s=0.006, data_s=0.002, other_s=0.001,
                           hidden_comm_s=0.005)
    result = planner.plan(ConvNet, sample=SAMPLE, devices=[1, 2, 4], batch_sizes=[8], strategies=["ddp", "fsdp"],
                          device_memory="1GB", measure=False)
    meta = build_meta_model(ConvNet)
    overlaps, source = planner._overlap(None, {"devices": 2, 8: together}, [8])
    assert overlaps == {8: pytest.approx(0.2)} and "measured" in source  # 0.005 s hidden / 0.025 s of backward
    assert planner._overlap(0.5, {"devices": 2, 8: together}, [8])[1] == "given"
    assert planner._overlap(None, {}, [8]) == ({8: 0.0}, planner._overlap(None, {}, [8])[1])
    planner._add_time(result.rows, {8: one}, {"devices": 2, 8: together}, meta, "32-true", {}, link, overlaps, 1000)
    by = {(r.strategy, r.devices): r for r in result.rows}
    assert by[("ddp", 1)].step_s == pytest.approx(0.001 + 0.033 + 0.0005) and by[("ddp", 1)].comm_s == 0.0
    assert by[("ddp", 2)].comm_s == 0.006 and "DDP run" in by[("ddp", 2)].note
    assert by[("ddp", 2)].step_s == pytest.approx(together.step_s)
    # other device counts and strategies: the probed compute plus the modelled collectives, 0.2 of backward hiding them
    four = by[("ddp", 4)]
    assert four.comm_s == pytest.approx(planner._comm_s(four, meta, "32-true", {}, link))
    assert four.step_s == pytest.approx(0.003 + 0.044 + max(0.0, four.comm_s - 0.2 * 0.025))
    fsdp = by[("fsdp", 2)]
    assert fsdp.step_s == pytest.approx(0.003 + 0.015 + 0.025 + 0.004 / 2 + max(0.0, fsdp.comm_s - 0.2 * 0.025))
    assert not fsdp.note


def test_one_device_is_timed_by_a_short_run_of_the_real_trainer(tmp_path):
    from torch.utils.data import TensorDataset

    from trainscale.plan.measure import trainer_steps

    data = TensorDataset(torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,)))
    times = trainer_steps(ConvNet(), data, None, [8], torch.nn.functional.cross_entropy,
                          lambda p: torch.optim.AdamW(p), "32-true", str(tmp_path), threads=1, steps=3)
    t = times[8]
    assert t.forward_s > 0 and t.backward_s > 0 and t.optimizer_s > 0 and t.data_s > 0
    assert t.comm_s == t.hidden_comm_s == 0.0  # one process communicates nothing


def test_gpt_worked_example_of_docs_plan_md_runs_and_prints_the_table(monkeypatch, capsys):
    """The command of docs/plan.md's worked example (8 GPUs of 80 GB at 400 GB/s, 989 TFLOP/s), in this process
    (test_cli_plan_prints_the_table_and_refuses_bad_flags runs the command whole): nothing is allocated (the GPT is
    traced on fake tensors), so it runs here; the 124M-parameter bytes are exact. pp: 8 stages of the 12 blocks; the
    largest peak is stage 0's, which holds the token embedding and 2 blocks (204.4 MiB of fp32 parameters) and runs
    8 forwards before its first backward."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the command puts the current directory on it
    code = cli.main(["plan", "--entry", "trainscale.jobs.workload:gpt_shakespeare", "--devices", "8",
                     "--batch-sizes", "8", "--strategy", "ddp,fsdp,pp", "--precision", "bf16-mixed",
                     "--device-memory", "80GB", "--bandwidth", "400GB/s,latency=10us", "--device-flops", "989e12"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert "ddp · bf16-mixed" in out.out and "fsdp · bf16-mixed" in out.out and "pp · bf16-mixed" in out.out
    assert "1f1b, 8 micro-batches, bubble 47%; stage 0 the largest" in out.out and "204.4 MiB" in out.out
    assert "474.4 MiB" in out.out  # 124,373,760 fp32 parameters (the tied output matrix counted once)
    assert "Fastest that fits: fsdp on 8 devices at bs 8/device" in out.out
