"""Telemetry pieces in one process: timers, FLOPs, MFU, memory, NVML sampler, stragglers, metrics.jsonl."""

import csv
import json
import os
import random
import sys
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from tests import telemetry_body, workers
from tests.helpers import run_distributed
from trainscale.telemetry import flops, nvml
from trainscale.telemetry.memory import PeakMemory
from trainscale.telemetry.sinks import JsonlSink
from trainscale.telemetry.overlap import comm_overlap
from trainscale.telemetry.report import summary_line, text_summary
from trainscale.telemetry.stragglers import compute_per_step, find_stragglers
from trainscale.telemetry.timers import StepTimer
from trainscale.loop.trainer import Trainer

CONTRACT = {"step_time_s", "phase_s", "phase_share", "comm_s", "exposed_comm_s", "exposed_comm_share",
            "samples_per_s", "samples_per_s_per_device",
            "tokens_per_s", "flops_per_sample", "flops_method", "achieved_flops_per_s", "mfu", "peak_memory_bytes",
            "peak_memory_kind", "gpu_utilization", "slowest_rank", "straggler_ranks",
            "rank_step_time_s", "rank_phase_s", "rank_exposed_comm_s", "rank_compute_s"}


def test_marks_attribute_each_phase_its_own_time():
    timer = StepTimer("cpu")
    timer.start()
    for _ in range(2):
        time.sleep(0.02)
        timer.mark("data")
        timer.count(4)
        time.sleep(0.04)
        timer.mark("forward")
        timer.mark("backward")  # nothing happened: ~0
        timer.end_step()
    steps = timer.collect()
    assert len(steps) == 2 and timer.collect() == []  # collect drains
    for st in steps:
        assert st.phase_s["data"] >= 0.02 and st.phase_s["forward"] >= 0.04
        assert 0 <= st.phase_s["backward"] < st.phase_s["data"]
        # contiguous marks attribute the whole step: the remainder is the optimizer mark-less tail
        assert sum(st.phase_s.values()) == pytest.approx(st.wall_s, abs=1e-3)
        assert st.samples == 4 and st.tokens is None and st.comm_s is None
    assert steps[0].phase_s["forward"] < 0.04 * 4  # and not the whole sleep of the other phases


def test_phase_context_manager_counts_only_inside():
    timer = StepTimer()
    timer.start()
    time.sleep(0.03)  # outside any phase
    with timer.phase("forward"):
        time.sleep(0.01)
    timer.end_step()
    (st,) = timer.collect()
    assert st.phase_s["forward"] >= 0.01 and st.phase_s["forward"] < 0.03
    assert st.wall_s >= 0.04  # the step's wall time still holds everything


@pytest.mark.parametrize("running", [False, True])
def test_comm_readings_are_a_union_per_step_and_exposed_from_the_last_bucket_ready(running):
    timer = StepTimer(time_comm=True, running=running)
    timer.start()
    timer.record_comm(1.0, 1.25)  # bucket 0: hidden behind the rest of backward
    timer.record_comm(1.1, 1.5)  # bucket 1 overlaps bucket 0: 0.15 s counted once
    timer.record_comm(2.0, 2.5)  # the last bucket, ready at 2.0: backward waits until 2.5
    timer.end_step()
    timer.end_step()  # a step without all-reduce (accumulation)
    if running:
        (row,) = timer.totals(("data",))
        assert row[3:5] == pytest.approx([1.0, 0.5])  # comm, exposed comm over both steps
        return
    first, second = timer.collect()
    assert first.comm_s == pytest.approx(1.0) and first.exposed_comm_s == pytest.approx(0.5)
    assert second.comm_s == 0.0 and second.exposed_comm_s == 0.0


class _FakeEvent:
    """A resolved ``torch.cuda.Event`` at ``t`` seconds (``elapsed_time`` in ms, as CUDA's)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, other: "_FakeEvent") -> float:
        return (other.t - self.t) * 1e3

    def synchronize(self) -> None: ...


def test_comm_readings_as_cuda_events_resolve_against_the_step_start():
    """The CUDA path (events resolved at collect), with events faked: the same union and exposed time."""
    timer = StepTimer("cuda", time_comm=True)
    timer.clock = iter(map(_FakeEvent, (10.0, 13.0))).__next__  # the step's start and end
    timer.start()
    for ready, done in ((10.5, 11.5), (11.0, 12.0), (12.2, 12.8)):
        timer.record_comm(_FakeEvent(ready), _FakeEvent(done))
    timer.end_step()
    (st,) = timer.collect()
    assert st.wall_s == pytest.approx(3.0)
    assert st.comm_s == pytest.approx(2.1) and st.exposed_comm_s == pytest.approx(0.6)


def test_comm_overlap_union_and_exposed_on_interval_lists():
    assert comm_overlap([]) == (0.0, 0.0)
    assert comm_overlap([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx((4.0, 1.0))  # sum 5
    # the last bucket ready (4.0) finished first; backward waits for the long first bucket until 5.0
    assert comm_overlap([(0.0, 5.0), (4.0, 4.5)]) == pytest.approx((5.0, 1.0))
    assert comm_overlap([(3.0, 4.0), (0.0, 1.0)]) == pytest.approx((2.0, 1.0))  # any order
    assert comm_overlap([(1.0, 1.0)]) == (0.0, 0.0)
    rng = random.Random(0)
    for _ in range(200):  # integer end points: the union is the number of unit cells covered
        intervals = [(a, a + rng.randint(0, 10)) for a in (rng.randint(0, 40) for _ in range(rng.randint(1, 8)))]
        union, exposed = comm_overlap(intervals)
        cells = {t for a, b in intervals for t in range(a, b)}
        assert union == len(cells)
        assert 0 <= exposed <= union <= sum(b - a for a, b in intervals)
        assert union <= max(b for _, b in intervals) - min(a for a, _ in intervals)
        assert exposed == max(0, max(b for _, b in intervals) - max(a for a, _ in intervals))


def test_flops_per_sample_counts_forward_and_backward():
    a, b, c, n = 32, 64, 10, 8
    model = nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c))
    counter = flops.FlopsPerSample()
    x, y = torch.randn(n, a), torch.randint(0, c, (n,))
    with counter.measure(samples=n):
        F.cross_entropy(model(x), y).backward()
    # forward 2ab + 2bc; backward: both weight grads (2ab + 2bc) and layer 2's input grad (2bc);
    # the input needs no grad. Multiply-add = 2 FLOPs (torch.utils.flop_counter).
    assert counter.value == 4 * a * b + 6 * b * c
    with counter.measure(samples=n):  # counted once: later calls do nothing
        model(x).sum().backward()
    assert counter.value == 4 * a * b + 6 * b * c


def test_count_flops_by_default_on_cuda_only_and_never_under_compile():
    assert flops.resolve_count_flops(None, "cuda", compiled=False) is True
    assert flops.resolve_count_flops(None, "cpu", compiled=False) is False
    assert flops.resolve_count_flops(None, "mps", compiled=False) is False
    assert flops.resolve_count_flops(None, "cuda", compiled=True) is False
    assert flops.resolve_count_flops(True, "cpu", compiled=False) is True
    assert flops.resolve_count_flops(False, "cuda", compiled=False) is False
    with pytest.raises(ValueError, match="count_flops=True cannot be combined with compile"):
        flops.resolve_count_flops(True, "cuda", compiled=True)
    with pytest.raises(ValueError, match="choose True, False or None"):
        flops.resolve_count_flops("yes", "cpu", compiled=False)


def test_peak_flops_table_and_mfu():
    assert flops.peak_flops_per_s("NVIDIA A100-SXM4-80GB", "bf16-mixed") == 312e12
    assert flops.peak_flops_per_s("NVIDIA A100-SXM4-80GB", "32-true") == 19.5e12
    assert flops.peak_flops_per_s("NVIDIA A10", "16-mixed") == 125e12  # not taken for an A100
    assert flops.peak_flops_per_s("NVIDIA H100 PCIe", "bf16-true") == 756e12
    assert flops.peak_flops_per_s("NVIDIA H100 80GB HBM3", "bf16-true") == 989e12
    assert flops.peak_flops_per_s("Tesla V100-SXM2-16GB", "bf16-mixed") is None  # no bf16 on Volta
    assert flops.peak_flops_per_s(None, "32-true") is None
    assert flops.mfu(156e12, 312e12, 2) == pytest.approx(0.25)
    assert flops.mfu(1e9, None, 1) is None and flops.mfu(None, 1e12, 1) is None


def test_stragglers_by_median_margin():
    assert find_stragglers([0.10, 0.10, 0.10, 0.20]) == [3]
    assert find_stragglers([0.10, 0.11, 0.10, 0.105]) == []
    assert find_stragglers([0.10, 0.30], margin=0.2) == [1]
    assert find_stragglers([0.10]) == [] and find_stragglers([0.0, 0.0]) == []
    # a median of 0 (two ranks that only waited) does not turn detection off
    assert find_stragglers([0.0, 0.0, 0.01]) == [2]
    assert compute_per_step(1.0, 0.4, 4) == pytest.approx(0.15)
    assert compute_per_step(1.0, None, 4) == pytest.approx(0.25)
    assert compute_per_step(1.0, 0.4, 0) == 0.0


def test_run_summary_shows_exposed_communication_beside_the_all_reduce_time():
    tele = {"step_time_s": 0.05, "phase_share": dict.fromkeys(("data", "forward", "backward", "optimizer"), 0.25),
            "phase_s": dict.fromkeys(("data", "forward", "backward", "optimizer"), 0.0125), "comm_s": 0.03,
            "exposed_comm_s": 0.01, "exposed_comm_share": 0.2, "samples_per_s": 100.0, "samples_per_s_per_device": 50.0,
            "peak_memory_bytes": [2**20, 2**20], "peak_memory_kind": "rss", "slowest_rank": 1, "straggler_ranks": [1]}
    line = summary_line(tele)
    assert "exposed communication 10.0 ms/step (20.0 % of the step; all-reduce 30.0 ms/step" in line
    records = [{"kind": "step", "rank_compute_s": [0.01, 0.04]}]
    text = text_summary(records, {"telemetry": tele} | dict(world_size=2, strategy="ddp", precision="32-true",
                                                              steps=8, global_batch_size=8))
    assert "exposed communication 10.00 ms/step, 20.0 % of the step" in text
    assert "slowest rank: 1 (compute rank 0 10.00, rank 1 40.00 ms/step)" in text and "stragglers: rank 1" in text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the current RSS from /proc/self/statm")
def test_peak_memory_on_cpu_is_rss_and_grows():
    import mmap
    import os

    mem = PeakMemory(torch.device("cpu"))
    before = mem.peak_bytes()
    assert mem.kind == "rss" and before > 10 * 2**20 and mem.peak_reserved_bytes() is None
    # Fresh anonymous pages, not the allocator's: memory that malloc freed but kept is already
    # counted in the RSS, and an allocation that reuses it would not lift the peak.
    page = os.sysconf("SC_PAGE_SIZE")
    current = int(open("/proc/self/statm").read().split()[1]) * page  # Linux: RSS now
    extra = max(before - current, 0) + 64 * 2**20  # enough to lift the peak 64 MiB above the earlier one
    block = mmap.mmap(-1, extra)
    block[::page] = b"\1" * len(range(0, extra, page))  # one byte per page: every page resident
    assert mem.peak_bytes() >= before + 32 * 2**20
    block.close()


def test_gpu_sampler_ties_samples_to_steps_with_a_fake_reader():
    readings = iter([(10.0, 1e9), (30.0, 2e9)] + [(50.0, 3e9)] * 1000)
    sampler = nvml.GpuSampler(0, interval_s=0.01, read=lambda: next(readings)).start()
    sampler.step = 7
    time.sleep(0.1)
    sampler.stop()
    samples = sampler.take()
    assert len(samples) >= 3 and sampler.take() == []
    assert samples[0][1:] == (10.0, 1e9) and samples[-1][0] == 7
    assert all(0 <= s[1] <= 100 for s in samples)


def test_nvml_degrades_to_not_available(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as if nvidia-ml-py were absent
    assert nvml._nvml_reader(0) is None
    sampler = nvml.GpuSampler(0).start()
    assert not sampler.available and sampler.take() == []
    sampler.stop()
    assert not nvml.GpuSampler(None).available  # CPU rank: nothing to sample


def test_timer_totals_per_step_and_running_add_up_the_times_of_collect():
    phases = ("data", "forward", "backward", "optimizer")
    timers = [StepTimer("cpu", time_comm=True), StepTimer("cpu", time_comm=True),
              StepTimer("cpu", time_comm=True, running=True)]
    rng = random.Random(0)
    readings = sorted(rng.uniform(0.0, 10.0) for _ in range(16))  # uneven gaps
    for timer in timers:  # identical fake clocks: each sees the same readings
        timer.clock = iter(readings).__next__
        timer.start()
        for step in range(3):
            timer.mark("data")
            timer.count(4, 7 if step else None)
            timer.mark("forward")
            timer.mark("custom")  # not a telemetry phase: in collect's dict, left out of totals
            timer.record_comm(1.0, 1.5)
            timer.end_step("optimizer")
    steps, rows, (running,) = timers[0].collect(), timers[1].totals(phases), timers[2].totals(phases)
    assert len(rows) == len(steps) == 3 and timers[1].totals() == [] and timers[2].totals() == []  # both drain
    for st, row in zip(steps, rows):
        assert row == [1.0, st.wall_s, st.phase_s["data"], st.phase_s["forward"], 0.0, st.phase_s["optimizer"],
                       st.comm_s, st.exposed_comm_s, float(st.samples), float(st.tokens or 0)]
    assert running == pytest.approx([sum(column) for column in zip(*rows)], rel=1e-12)
    with pytest.raises(RuntimeError, match="totals"):
        timers[2].collect()
    with pytest.raises(ValueError, match="CPU"):
        StepTimer("cuda", running=True)


@pytest.mark.parametrize("running", [False, True])
def test_micro_batch_equals_three_marks(running):
    rng = random.Random(1)
    readings = sorted(rng.uniform(0.0, 10.0) for _ in range(20))
    by_marks, by_micro = StepTimer("cpu", running=running), StepTimer("cpu", running=running)
    by_marks.clock = iter(readings).__next__
    by_micro.clock = iter(readings).__next__
    for timer in (by_marks, by_micro):
        timer.start()
        for step in range(2):
            for micro in range(2):  # accumulation: two micro-batches per optimizer step
                if timer is by_marks:
                    timer.mark("data")
                    timer.count(4, 5 if micro else None)
                    timer.mark("forward")
                    timer.mark("backward")
                else:
                    t_data, t_forward, t_backward = timer.clock(), timer.clock(), timer.clock()
                    timer.micro_batch(t_data, t_forward, t_backward, 4, 5 if micro else None)
            timer.end_step("optimizer")
    a, b = by_marks.totals(), by_micro.totals()
    assert len(a) == len(b) == (1 if running else 2)
    for row_a, row_b in zip(a, b):
        assert row_a == pytest.approx(row_b, rel=1e-12) and min(row_a[1:6]) > 0  # wall and all four phases timed
    if running:  # samples, tokens: one row for both steps, or the last step's row
        assert a[0][-2:] == [16.0, 10.0]
    else:
        assert a[-1][-2:] == [8.0, 5.0]


def test_file_sinks_flush_at_epoch_records_after_flush_secs_and_at_close(tmp_path):
    sink, file = JsonlSink(tmp_path / "metrics.jsonl", flush_secs=3600), tmp_path / "metrics.jsonl"
    sink.write({"kind": "step", "step": 1, "loss": 0.5})  # the first record flushes (nothing flushed yet)
    sink.write({"kind": "step", "step": 2, "loss": 0.4})  # buffered: flush_secs not reached
    assert len(file.read_text().splitlines()) == 1
    sink.write({"kind": "epoch", "epoch": 0, "loss": 0.45})  # an epoch record: everything reaches the file
    assert len(file.read_text().splitlines()) == 3
    sink.flush_secs = 0.0
    sink.write({"kind": "step", "step": 3, "loss": 0.3})  # flush_secs passed: flushed
    assert len(file.read_text().splitlines()) == 4
    sink.flush_secs = 3600
    sink._flushed = time.monotonic()
    sink.write({"kind": "step", "step": 4, "loss": 0.2})
    assert len(file.read_text().splitlines()) == 4
    sink.close()
    assert len(file.read_text().splitlines()) == 5


def test_file_sinks_flush_the_first_record_on_a_machine_booted_a_minute_ago(tmp_path, monkeypatch):
    # time.monotonic() counts from boot on Linux: a minute after boot it reads ~60, less than flush_secs
    monkeypatch.setattr(time, "monotonic", lambda: 60.0)
    sink = JsonlSink(tmp_path / "metrics.jsonl", flush_secs=3600)
    sink.write({"kind": "step", "step": 1, "loss": 0.5})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    sink.close()


def test_trainer_closes_its_sinks_when_fit_raises(tmp_path):
    class Explodes(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 2)
            self.calls = 0

        def training_step(self, batch):
            self.calls += 1
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            return loss * float("nan") if self.calls == 7 else loss

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, default_root_dir=tmp_path, log_every_n_steps=2,
                      enable_progress_bar=False)
    with pytest.raises(Exception, match="non-finite"):
        trainer.fit(Explodes(), DataLoader(data, batch_size=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    steps = [json.loads(line)["step"] for line in open(tmp_path / "version_0" / "metrics.jsonl")]
    assert steps[:3] == [2, 4, 6]  # every record written before the error reached the file


def test_jsonl_sink_keeps_nested_values(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.write({"phase_s": {"data": float("nan")}, "ranks": [1]})
    sink.close()
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {"phase_s": {"data": "nan"}, "ranks": [1]}


def test_trainer_summary_has_the_telemetry_contract(tmp_path):
    out = workers.trainer_fit(0, str(tmp_path), 8, 1, extra={"log_every_n_steps": 3, "count_flops": True})
    tele = out["summary"]["telemetry"]
    assert set(tele) == CONTRACT
    assert tele["comm_s"] is None and tele["mfu"] is None and tele["gpu_utilization"] is None  # CPU, one rank
    assert tele["peak_memory_kind"] == "rss" and len(tele["peak_memory_bytes"]) == 1
    assert sum(tele["phase_share"].values()) == pytest.approx(1.0)
    assert tele["flops_per_sample"] > 1e6  # the ConvNet: ~16 MFLOP per sample, forward and backward
    assert tele["achieved_flops_per_s"] == pytest.approx(tele["flops_per_sample"] * tele["samples_per_s"])
    assert tele["slowest_rank"] == 0 and tele["straggler_ranks"] == []
    steps = [json.loads(line) for line in open(tmp_path / "version_0" / "metrics.jsonl")]
    steps = [r for r in steps if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [3, 6, 9, 12] and all(r["rank"] == "all" for r in steps)
    # one output path: metrics.jsonl and the default CSVLogger's metrics.csv, each record once in each
    run_dir = tmp_path / "version_0"
    assert sorted(p.name for p in run_dir.glob("metrics*")) == ["metrics.csv", "metrics.jsonl"]
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [int(r["step"]) for r in rows] == [r["step"] for r in records]
    assert [float(r["step/train_loss"]) for r in rows if r["step/train_loss"]] == [r["train_loss"] for r in steps]


def test_trainer_on_cpu_counts_no_flops_unless_asked(tmp_path, monkeypatch):
    """By default a CPU run never enters FlopCounterMode (its dispatch path costs ~1.5 MiB of PyTorch's code
    pages in RSS, and a CPU has no peak FLOP/s for an MFU); FLOP fields are null, the rest is measured."""
    from torch.utils import flop_counter

    entered = []
    original = flop_counter.FlopCounterMode.__enter__
    monkeypatch.setattr(flop_counter.FlopCounterMode, "__enter__", lambda self: entered.append(1) or original(self))
    out = workers.trainer_fit(0, str(tmp_path / "default"), 8, 1)
    tele = out["summary"]["telemetry"]
    assert entered == [] and tele["flops_per_sample"] is None and tele["achieved_flops_per_s"] is None
    assert tele["mfu"] is None and tele["samples_per_s"] > 0
    out = workers.trainer_fit(0, str(tmp_path / "asked"), 8, 1, extra={"count_flops": True})
    assert entered == [1] and out["summary"]["telemetry"]["flops_per_sample"] > 1e6


def test_trainer_with_telemetry_off(tmp_path):
    trainer = Trainer(accelerator="cpu", max_epochs=1, log_every_n_steps=2, enable_progress_bar=False,
                      default_root_dir=tmp_path, enable_checkpointing=False, enable_telemetry=False)
    summary = trainer.fit(workers.make_model(), DataLoader(workers.tiny_dataset(32), batch_size=8),
                          optimizer=workers.sgd)
    assert summary["telemetry"] is None
    records = [json.loads(line) for line in open(tmp_path / "version_0" / "metrics.jsonl")]
    assert [r["step"] for r in records if r["kind"] == "step"] == [2, 4]
    assert all("phase_s" not in r for r in records)


def test_tensorboard_is_written_on_request_only(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for flag in (False, True):
        trainer = Trainer(accelerator="cpu", max_epochs=1, log_every_n_steps=2, enable_progress_bar=False,
                          enable_checkpointing=False, default_root_dir=tmp_path / str(flag), tensorboard=flag)
        trainer.fit(workers.make_model(), DataLoader(workers.tiny_dataset(32), batch_size=8), optimizer=workers.sgd)
        assert (trainer.run_dir / "tensorboard").is_dir() == flag
    events = EventAccumulator(str(trainer.run_dir / "tensorboard"))
    events.Reload()  # written at close, although the sink no longer flushes at each record
    assert [e.step for e in events.Scalars("step/samples_per_s")] == [2, 4]


def test_tensorboard_without_the_package_is_a_clear_error(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'trainscale\[tensorboard\]'"):
        Trainer(accelerator="cpu", tensorboard=True)


@pytest.mark.multiprocess
def test_default_fit_does_not_import_tensorboard():
    """In a process that has not imported trainscale yet (forked from the warm server, which holds only torch)."""
    (imported,) = run_distributed(telemetry_body.default_fit_imported_tensorboard_modules, world_size=1, timeout=120)
    assert imported == []


def test_bad_straggler_margin_is_a_clear_error():
    with pytest.raises(ValueError, match="straggler_margin"):
        Trainer(accelerator="cpu", straggler_margin=-1)


def test_runtime_loop_uses_the_same_telemetry(tmp_path):
    """The docs/telemetry.md example: a hand-written Runtime loop, dict batches with tokens."""
    from trainscale import Runtime
    from trainscale.telemetry import Telemetry

    class TokenModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.head = nn.Linear(16, 50)

        def forward(self, input_ids):
            return self.head(self.emb(input_ids))  # (B, T, V)

    rt = Runtime(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model, optimizer = rt.setup(TokenModel(), lambda p: torch.optim.SGD(p, lr=0.1))
    tele = Telemetry(rt, warmup_steps=1, count_flops=True)
    tele.attach(model)
    ids = torch.randint(0, 50, (40, 12))
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    tele.start()
    for step in range(1, 7):
        batch = rt.to_device({"input_ids": ids[(step - 1) * 4: step * 4]})
        tele.mark("data", batch)
        with tele.count_flops(batch):
            with tele.phase("forward"), rt.autocast():
                logits = model(batch["input_ids"][:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), batch["input_ids"][:, 1:].flatten())
            with tele.phase("backward"):
                rt.backward(loss)
        rt.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        tele.end_step()
        if step % 3 == 0:
            sink.write(tele.log(step, 0, loss))
    summary = tele.summary()
    sink.close()
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 12)
    assert summary["flops_per_sample"] > 0
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records] == [3, 6] and all(r["steps"] == 3 and r["samples"] == 12 for r in records)
    assert all(r["tokens_per_s_per_device"] == pytest.approx(r["samples_per_s"] * 12) for r in records)


@pytest.mark.gpu
def test_cuda_timer_resolves_events_lazily():
    timer = StepTimer("cuda")
    x = torch.randn(2048, 2048, device="cuda")
    timer.start()
    for _ in range(3):
        timer.mark("data")
        y = x @ x
        timer.mark("forward")
        timer.end_step()
    steps = timer.collect()  # the only host sync
    assert len(steps) == 3 and all(s.phase_s["forward"] > 0 for s in steps)
    assert all(sum(s.phase_s.values()) == pytest.approx(s.wall_s, rel=0.05) for s in steps)
    del y


@pytest.mark.gpu
def test_cuda_peak_memory_and_nvml():
    mem = PeakMemory(torch.device("cuda", 0))
    mem.reset()
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    assert mem.kind == "cuda_allocated" and mem.peak_bytes() >= 256 * 2**20
    assert mem.peak_reserved_bytes() >= mem.peak_bytes()
    del block
    pytest.importorskip("pynvml")
    sampler = nvml.GpuSampler(0, interval_s=0.05).start()
    time.sleep(0.3)
    sampler.stop()
    samples = sampler.take()
    assert sampler.available and samples and all(0 <= s[1] <= 100 and s[2] > 0 for s in samples)


@pytest.mark.gpu
def test_trainer_on_cuda_reports_memory_utilization_and_mfu(tmp_path):
    trainer = Trainer(accelerator="cuda", devices=1, max_epochs=1, log_every_n_steps=2, enable_progress_bar=False,
                      default_root_dir=tmp_path, enable_checkpointing=False)
    summary = trainer.fit(workers.make_model(), DataLoader(workers.tiny_dataset(256), batch_size=8),
                          optimizer=workers.sgd)
    tele = summary["telemetry"]
    assert tele["peak_memory_kind"] == "cuda_allocated" and tele["peak_memory_bytes"][0] > 0
    assert sum(tele["phase_s"].values()) == pytest.approx(tele["step_time_s"], rel=0.1)
    name = torch.cuda.get_device_name(0)
    if flops.peak_flops_per_s(name, "32-true") is not None:
        assert 0 < tele["mfu"] < 1


def test_report_plots_gpu_utilization_when_the_run_had_it(tmp_path):
    pytest.importorskip("matplotlib")
    from trainscale.telemetry.report import make_report

    phases = {"data": 0.01, "forward": 0.02, "backward": 0.03, "optimizer": 0.01}
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in (10, 20, 30):
            f.write(json.dumps({"kind": "step", "rank": "all", "step": step, "epoch": 0, "train_loss": 1.0 / step,
                                "phase_s": phases, "rank_phase_s": {p: [v, v] for p, v in phases.items()},
                                "samples_per_s": 100.0, "peak_memory_bytes": [2**30, 2**30],
                                "peak_memory_kind": "cuda_allocated", "gpu_utilization": [40.0 + step, 90.0]}) + "\n")
    written, text = make_report(tmp_path)
    assert (tmp_path / "gpu_utilization.png").read_bytes()[:4] == b"\x89PNG"
    assert {p.name for p in written} >= {"gpu_utilization.png", "step_phases.png", "report.txt"}
    assert "no telemetry summary" in text  # no summary.json: a crashed or unfinished run


def test_report_skips_the_torn_last_line_of_a_crashed_run_with_a_warning(tmp_path):
    from trainscale.telemetry.report import load_run

    good = [{"kind": "step", "step": 1, "epoch": 0, "rank": "all", "loss": 0.5},
            {"kind": "step", "step": 2, "epoch": 0, "rank": "all", "loss": 0.4}]
    text = "".join(json.dumps(r) + "\n" for r in good)
    (tmp_path / "metrics.jsonl").write_text(text + '{"kind": "step", "step": 3, "lo')  # killed mid-write
    with pytest.warns(UserWarning, match="skipped its torn last line 3"):
        records, summary = load_run(tmp_path)
    assert records == good and summary is None
    (tmp_path / "metrics.jsonl").write_text('{"kind": "st\n' + text)  # damage before the end is an error
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        load_run(tmp_path)


def test_tensor_parallel_ranks_reading_the_same_batch_count_its_samples_and_tokens_once():
    """Under tp 2 (world size 2, one data-parallel rank) both ranks train on the same 4,000 samples a
    second: throughput is 4,000 samples/s (2,000 per device), not 8,000."""
    from types import SimpleNamespace

    from trainscale.runtime.connector import RunConfig
    from trainscale.telemetry.processor import _IDX

    from trainscale.telemetry import Telemetry

    rt = SimpleNamespace(device=torch.device("cpu"), config=RunConfig("cpu", 2, 1, "tp", "32-true"),
                         is_rank_zero=True, world_size=2, data_parallel_size=1, strategy=None)
    tele = Telemetry(rt)
    fields = {"steps": 10.0, "wall": 1.0, "samples": 4000.0, "tokens": 128000.0, "loss": float("nan"),
              "gpu_util": float("nan")}
    row = [fields.get(name, 0.0) for name in _IDX]  # each rank: 10 steps, the same 4000 samples in 1 s
    numbers = tele._numbers([row, list(row)], per_rank=True)
    assert numbers["samples"] == 4000 and numbers["samples_per_s"] == 4000.0
    assert numbers["samples_per_s_per_device"] == 2000.0
    assert numbers["tokens_per_s"] == 128000.0 and numbers["tokens_per_s_per_device"] == 64000.0


def test_a_run_without_training_steps_says_so_instead_of_printing_nan():
    nan = float("nan")
    tele = {"step_time_s": nan, "phase_share": dict.fromkeys(("data", "forward", "backward", "optimizer"), nan),
            "exposed_comm_s": nan, "exposed_comm_share": nan, "comm_s": nan, "samples_per_s": nan,
            "peak_memory_bytes": [2**20], "peak_memory_kind": "rss"}
    assert summary_line(tele) == "telemetry: no training step in this run"
