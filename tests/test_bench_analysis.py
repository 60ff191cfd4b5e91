"""bench as pure logic: the grid, gain/efficiency arithmetic, the table, and the advice on synthetic rows."""

import re

import pytest

from trainscale.bench import advice as adv
from trainscale.bench.analysis import add_scaling, fmt_time, shares, table
from trainscale.bench.grid import plan
from trainscale.jobs.workload import entry_name, parse_entry


def row(devices, bs, *, time_s=None, steps=100, batches=None, full=True, status="ok", strategy="ddp",
        precision="32-true", scaling="weak", per_device=None, **extra):
    """A result row as the sweep writes it (only the fields the analysis reads)."""
    per_device = per_device or (bs if scaling == "weak" else bs // devices)
    batches = batches or steps
    r = {"strategy": "single" if devices == 1 else strategy, "run_strategy": "single" if devices == 1 else strategy,
         "precision": precision, "devices": devices, "batch_size": bs, "per_device_batch": per_device,
         "scaling": scaling, "status": status, "reason": extra.pop("reason", ""), "device": "cpu",
         "key": f"{strategy if devices > 1 else 'single'}-{precision}-d{devices}-{scaling}-b{bs}"}
    if status == "ok":
        r.update({"time_s": time_s, "epochs": 1, "steps": steps, "batches_per_epoch": batches, "full_epochs": full,
                  "step_time_s": time_s / steps, "samples_per_s": per_device * devices * steps / time_s})
    r.update(extra)
    return r


def test_fmt_time():
    assert fmt_time(65.3) == "01:05.3"
    assert fmt_time(4.04) == "00:04.0"
    assert fmt_time(None) == "—"


def test_gain_and_efficiency_from_measured_epoch_times():
    rows = add_scaling([row(1, 64, time_s=10.0), row(2, 64, time_s=6.0), row(1, 4, time_s=8.0),
                        row(2, 4, time_s=16.0), row(4, 4, time_s=2.5)], devices=[1, 2, 4])
    by = {(r["devices"], r["batch_size"]): r for r in rows}
    assert by[(2, 64)]["gain"] == pytest.approx(10 / 6)
    assert by[(2, 64)]["efficiency"] == pytest.approx(10 / 6 / 2)
    assert by[(2, 4)]["gain"] == pytest.approx(0.5) and by[(2, 4)]["efficiency"] == pytest.approx(0.25)
    assert by[(4, 4)]["gain"] == pytest.approx(3.2) and by[(4, 4)]["efficiency"] == pytest.approx(0.8)
    assert by[(1, 64)]["gain"] == pytest.approx(1.0)


def test_epoch_time_is_estimated_from_steps_and_baseline_may_be_missing():
    rows = add_scaling([row(1, 8, time_s=2.0, steps=20, batches=500, full=False),  # 0.1 s/step × 500
                        row(2, 8, time_s=1.5, steps=20, batches=250, full=False),  # 0.075 s/step × 250
                        row(2, 16, time_s=1.0), row(1, 32, status="oom", reason="rank 0: OutOfMemoryError: x"),
                        row(2, 32, time_s=1.0)], devices=[1, 2])
    by = {(r["devices"], r["batch_size"]): r for r in rows}
    assert by[(1, 8)]["epoch_time_s"] == pytest.approx(50.0) and by[(1, 8)]["epoch_time_estimated"]
    assert by[(2, 8)]["gain"] == pytest.approx(50.0 / 18.75)
    assert by[(2, 16)]["gain"] is None  # no 1-device row at bs 16
    assert by[(2, 32)]["gain"] is None and by[(1, 32)]["epoch_time_s"] is None  # the baseline failed
    text = table(rows, [1, 2], [8, 16, 32], "ddp", "32-true")
    line8 = next(l for l in text.splitlines() if l.split()[0] == "8")
    assert "~00:50.0" in line8 and "~00:18.8" in line8 and "2.67×" in line8 and "1.33" in line8
    line32 = next(l for l in text.splitlines() if l.split()[0] == "32")
    assert "OOM" in line32


def test_strong_scaling_grid_and_gain():
    cells = plan([1, 2], [64], ["ddp"], ["32-true"], scaling="strong")
    assert [(c.devices, c.per_device_batch, c.run_strategy) for c in cells] == [(1, 64, "single"), (2, 32, "ddp")]
    rows = add_scaling([row(1, 64, time_s=9.0, scaling="strong"), row(2, 64, time_s=5.0, scaling="strong")], [1, 2])
    assert rows[1]["gain"] == pytest.approx(1.8) and rows[1]["efficiency"] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="not divisible by 2 devices"):
        plan([1, 2], [5], ["ddp"], ["32-true"], scaling="strong")


def test_grid_validation_and_shared_baseline():
    cells = plan([2, 1], [8, 4], ["ddp"], ["32-true", "bf16-mixed"])
    assert len(cells) == 8  # the 1-device cells are shared: 2 precisions × 2 batch sizes × 2 device counts
    assert [(c.batch_size, c.devices) for c in cells[:4]] == [(4, 1), (4, 2), (8, 1), (8, 2)]  # interleaved
    with pytest.raises(ValueError, match="unknown strategy 'nope'.*ddp"):
        plan([1, 2], [4], ["nope"], ["32-true"])
    with pytest.raises(ValueError, match="unknown precision"):
        plan([1, 2], [4], ["ddp"], ["8-true"])
    with pytest.raises(ValueError, match="positive ints"):
        plan([0, 2], [4], ["ddp"], ["32-true"])
    with pytest.raises(ValueError, match="scaling"):
        plan([1], [4], ["ddp"], ["32-true"], scaling="linear")


def test_entry_strings():
    assert parse_entry("pkg.mod:build") == ("pkg.mod", "build")
    for bad in ("pkg.mod", "pkg.mod:", ":f", "pkg mod:f"):
        with pytest.raises(ValueError, match="package.module:function"):
            parse_entry(bad)
    assert entry_name(None) == "trainscale.jobs.workload:mnist_convnet"
    with pytest.raises(ValueError, match="cannot be imported"):
        entry_name(lambda: {})


def tel(step, data=0.0, comm=None, fwd=None):
    """Telemetry in the shape of a run's summary.json (``telemetry`` section)."""
    fwd = step * 0.3 if fwd is None else fwd
    rest = step - data - fwd
    phase_s = {"data": data, "forward": fwd, "backward": rest * 0.8, "optimizer": rest * 0.2}
    return {"step_time_s": step, "phase_s": phase_s, "phase_share": {k: v / step for k, v in phase_s.items()},
            "comm_s": comm, "exposed_comm_s": comm, "samples_per_s": None}


def scaled(*rows):
    return add_scaling(list(rows), devices=[1, 2])


def test_advice_communication_bound():
    rows = scaled(row(1, 4, time_s=2.0, steps=100, telemetry=tel(0.02)),
                  row(2, 4, time_s=2.5, steps=50, telemetry=tel(0.05, comm=0.02)))
    kind, text = adv.diagnose(rows[1], rows)
    assert kind == "communication"
    assert "efficiency 0.40, step 50.0 ms): against the ideal 20.0 ms (weak scaling) each step loses 30.0 ms" in text
    assert "exposed communication 20.0 ms (67% of it; without it efficiency 0.40 → about 0.67)" in text
    assert "compute slowdown 10.0 ms (33% of it" in text and "unattributed residual 0.0 ms (0%)" in text
    assert rows[1]["account"]["gap_s"] == pytest.approx(0.03)  # in results.json too


def test_advice_data_bound():
    rows = scaled(row(1, 64, time_s=4.0, telemetry=tel(0.04, data=0.02)),
                  row(2, 64, time_s=3.0, steps=50, telemetry=tel(0.06, data=0.03, comm=0.001)))
    kind, text = adv.diagnose(rows[1], rows)
    assert kind == "data" and "data wait 10.0 ms (50% of it; without it efficiency 0.67 → about 0.80)" in text
    assert "num_workers=1" in text
    assert adv.is_poor(rows[0]) and adv.diagnose(rows[0], rows)[0] == "data"  # data-bound on 1 device too


def test_advice_overhead_bound_and_compute_bound():
    rows = scaled(row(1, 4, time_s=1.0, telemetry=tel(0.01)),
                  row(2, 4, time_s=1.25, steps=50, telemetry=tel(0.025, comm=0.001)),
                  row(1, 512, time_s=10.0, telemetry=tel(0.1)),
                  row(2, 512, time_s=6.0, steps=50, telemetry=tel(0.12, comm=0.002)))
    kind, text = adv.diagnose(rows[1], rows)  # fits over bs 4 and 512 split the compute growth
    assert kind == "overhead" and "efficiency 0.40" in text and "rises to 0.83 at bs 512" in text
    assert "per-step fixed overhead 14.0 ms (93% of it" in text
    flat = scaled(row(1, 4, time_s=1.0, telemetry=tel(0.01)),
                  row(2, 4, time_s=0.8, steps=50, telemetry=tel(0.016, comm=0.001)),
                  row(1, 512, time_s=10.0, telemetry=tel(0.1)),
                  row(2, 512, time_s=8.0, steps=50, telemetry=tel(0.16, comm=0.002)))
    kind, text = adv.diagnose(flat[1], flat)  # at bs 4 the fixed part dominates, at bs 512 the per-sample part
    assert kind == "overhead" and "per-step fixed overhead 4.6 ms (76% of it" in text
    assert "Larger batches did not help here (best efficiency 0.62, at bs 512)" in text
    kind, text = adv.diagnose(flat[3], flat)
    assert kind == "compute" and "compute slowdown 53.4 ms (89% of it" in text and "share the machine's cores" in text
    one_batch = scaled(row(1, 4, time_s=10.0, telemetry=tel(0.1)),  # no fit: slowdown holds all the compute growth
                       row(2, 4, time_s=12.5, steps=50, telemetry=tel(0.25, comm=0.001)))
    kind, text = adv.diagnose(one_batch[1], one_batch)
    assert kind == "compute" and "compute slowdown 149.0 ms (99% of it" in text
    tiny = scaled(row(1, 4, time_s=1.0, telemetry=tel(0.01)),  # no fit, tiny steps, a larger batch more efficient
                  row(2, 4, time_s=1.25, steps=50, telemetry=tel(0.025, comm=0.001)),
                  row(1, 512, time_s=10.0), row(2, 512, time_s=6.0, steps=50))
    assert adv.diagnose(tiny[1], tiny)[0] == "overhead"


def test_advice_memory_failed_and_unexplained():
    rows = scaled(row(1, 256, time_s=5.0, peak_memory_bytes=[2**30], peak_memory_kind="max_rss"),
                  row(1, 512, status="oom", reason="rank 0: OutOfMemoryError: CUDA out of memory"),
                  row(2, 256, status="timeout", reason="no result after the 60 s per-cell timeout"),
                  row(2, 512, time_s=5.0, steps=50))
    kind, text = adv.diagnose(rows[1], rows)
    assert kind == "memory" and "OutOfMemoryError" in text and "256/device, peaked at 1.00 GiB" in text
    kind, text = adv.diagnose(rows[2], rows)
    assert kind == "failed" and "60 s per-cell timeout" in text
    poor_without_split = scaled(row(1, 4, time_s=1.0), row(2, 4, time_s=1.0, steps=50))
    assert adv.diagnose(poor_without_split[1], poor_without_split)[0] == "unexplained"


def test_probes_stand_in_for_missing_telemetry():
    r = row(2, 8, time_s=1.0, steps=100, probe_allreduce_s=0.004, probe_data_s=0.001)
    s = shares(r)
    assert s["source"] == "probe" and s["comm_share"] == pytest.approx(0.4) and s["data_share"] == pytest.approx(0.1)
    rows = scaled(row(1, 8, time_s=1.0), r)
    kind, text = adv.diagnose(rows[1], rows)
    assert kind == "communication" and "source: probe" in text


def test_advice_summary_sentences_quote_the_numbers():
    def acc(t, accs):
        return {"val_accuracy": accs[-1],
                "history": [{"epoch": i, "epoch_time_s": t, "val_accuracy": a} for i, a in enumerate(accs)]}

    rows = scaled(row(1, 64, time_s=10.0, **acc(10.0, [0.96])),
                  row(2, 64, time_s=6.0, steps=50, **acc(6.0, [0.93])),
                  row(1, 8, time_s=20.0, **acc(20.0, [0.97])),
                  row(2, 8, time_s=25.0, steps=50, **acc(25.0, [0.975])))
    text = "\n".join(adv.advise(rows, target_accuracy=0.95))
    assert "Fastest for throughput: bs 64 on 2 devices (ddp, 32-true): 1,067 samples/s, epoch 00:06.0, 1.67×" in text
    assert "gain 0.80× (bs 8) to 1.67× (bs 64)" in text and "faster than 1 device(s) at bs 64, slower or equal at bs 8" in text
    assert "Fastest to val_accuracy ≥ 0.95: bs 64 on 1 device (single, 32-true), after 00:10.0" in text
    assert "Note: no cell recorded telemetry" in text and "Caution" not in text
    rows[1].update(load_avg_1m=7.7, cpu_count=2)
    assert "load average up to 7.7 on 2 cores, at bs 64 on 2 devices" in "\n".join(adv.advise(rows))
    text = "\n".join(adv.advise(rows, target_accuracy=0.99))
    assert "No cell reached val_accuracy ≥ 0.99; the best was 0.9750" in text


def test_report_files_from_synthetic_rows_with_telemetry(tmp_path):
    pytest.importorskip("matplotlib")
    import csv
    import json

    from trainscale.bench import report

    rows = [row(1, 4, time_s=1.0, telemetry=tel(0.01, data=0.002)),
            row(2, 4, time_s=1.25, steps=50, telemetry=tel(0.025, data=0.002, comm=0.008)),
            row(2, 64, status="crashed", reason="killed by signal 9")]
    result = report.write(tmp_path, rows, [1, 2], [4, 64], ["ddp"], ["32-true"], "weak", None)
    assert (tmp_path / "scaling.png").stat().st_size > 0 and (tmp_path / "phases.png").stat().st_size > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved[1]["gain"] == pytest.approx(0.8) and saved[1]["telemetry"]["comm_s"] == 0.008
    with open(tmp_path / "results.csv") as f:
        table_rows = list(csv.DictReader(f))
    assert float(table_rows[1]["telemetry.phase_share.data"]) == pytest.approx(0.08)
    assert table_rows[2]["status"] == "crashed"
    md = (tmp_path / "report.md").read_text()
    assert result.tables in md and "![phases.png](phases.png)" in md and "CRASHED" in md
    assert (tmp_path / "account.png").stat().st_size > 0 and "![account.png](account.png)" in md
    # 1 device: 10 ms; 2 devices: 25 ms, of which 8 ms exposed communication; the rest is compute slowdown
    assert "## Where the speed-up went" in md and "ideal 10.0 ms, measured 25.0 ms, gap 15.0 ms" in md
    assert re.search(r"C exposed communication +8\.0 ms +53% +of the gap", md)
    assert result.accounts.splitlines()[0] == ("ddp · 32-true · bs 4 on 2 devices: ideal 10.0 ms, measured 25.0 ms, "
                                               "gap 15.0 ms, efficiency 0.40 (weak scaling: ideal = the 1-device step)")


def test_cell_outcome_from_what_the_cell_left(tmp_path):
    import json

    from trainscale.bench.runner import _cell_outcome

    (tmp_path / "error.rank1.json").write_text(json.dumps(
        {"rank": 1, "type": "OutOfMemoryError", "message": "CUDA out of memory. Tried to allocate 2 GiB", "oom": True}))
    (tmp_path / "error.rank0.json").write_text(json.dumps(
        {"rank": 0, "type": "DistBackendError", "message": "Connection closed by peer", "oom": False}))
    status, reason, _ = _cell_outcome(tmp_path, 1, False, 60)
    assert status == "oom" and reason.startswith("rank 1: OutOfMemoryError: CUDA out of memory")
    assert _cell_outcome(tmp_path, None, True, 60)[0] == "timeout"
    for p in tmp_path.glob("error.*"):
        p.unlink()
    (tmp_path / "log.txt").write_text("epoch 1/1\n  exitcode  : -9 (pid: 123)\n=====\n")
    status, reason, _ = _cell_outcome(tmp_path, 1, False, 60)
    assert status == "crashed" and "SIGKILL" in reason and "exitcode  : -9" in reason
    (tmp_path / "result.json").write_text('{"steps": 3}')
    assert _cell_outcome(tmp_path, 0, False, 60) == ("ok", "", {"steps": 3})
    status, note, _ = _cell_outcome(tmp_path, 1, False, 60)  # a process failed while exiting, after the result
    assert status == "ok" and "exited with code 1" in note


def assert_efficiencies_quoted_match(text, rows, devices):
    """Every 'efficiency X ... at bs Y' the advice quotes is the table's efficiency of that cell."""
    import re

    quoted = re.findall(r"efficiency (?:rises to )?(\d\.\d\d),? at bs (\d+)", text)
    for value, bs in quoted:
        cell = next(r for r in rows if r["devices"] == devices and r["batch_size"] == int(bs))
        assert f"{cell['efficiency']:.2f}" == value, (value, bs, cell["efficiency"])
    return len(quoted)


def test_forward_that_slowed_is_compute_not_communication_and_no_false_batch_tip():
    """The case found wrong: on 2 processes forward itself slowed (6 → 20 ms) while the all-reduce took
    26 % of the step, and the larger batch was *less* efficient. It was called communication-bound with
    "larger batches amortize it"."""
    rows = scaled(row(1, 16, time_s=2.0, steps=100, telemetry=tel(0.02, fwd=0.006)),
                  row(2, 16, time_s=2.5, steps=50, telemetry=tel(0.05, comm=0.013, fwd=0.02)),
                  row(1, 64, time_s=8.0, steps=100, telemetry=tel(0.08, fwd=0.024)),
                  row(2, 64, time_s=12.0, steps=50, telemetry=tel(0.24, comm=0.01, fwd=0.1)))
    kind, text = adv.diagnose(rows[1], rows)
    assert kind == "compute"
    assert "compute slowdown 17.0 ms (57% of it" in text and "exposed communication 13.0 ms (43% of it" in text
    assert "helps here" not in text and "Larger batches did not help here (best efficiency 0.33, at bs 64)" in text
    assert assert_efficiencies_quoted_match(text, rows, 2) == 1


def test_communication_advice_recommends_larger_batches_only_when_the_table_shows_it_helps():
    def table_with(eff64_time):
        return scaled(row(1, 16, time_s=2.0, steps=100, telemetry=tel(0.02)),
                      row(2, 16, time_s=4.0, steps=50, telemetry=tel(0.08, comm=0.05)),
                      row(1, 64, time_s=8.0, steps=100, telemetry=tel(0.08)),
                      row(2, 64, time_s=eff64_time, steps=50, telemetry=tel(0.08 * eff64_time / 4, comm=0.03)))
    helps = table_with(5.0)  # bs 64: efficiency 0.80 > 0.25
    kind, text = adv.diagnose(helps[1], helps)
    assert kind == "communication" and "exposed communication 50.0 ms (83% of it" in text
    assert "A larger per-device batch helps here: efficiency rises to 0.80 at bs 64" in text
    assert assert_efficiencies_quoted_match(text, helps, 2) == 1
    worse = table_with(20.0)  # bs 64: efficiency 0.20 < 0.25
    kind, text = adv.diagnose(worse[1], worse)
    assert kind == "communication" and "helps here" not in text
    assert "Larger batches did not help here (best efficiency 0.20, at bs 64)" in text
    assert "accumulate_grad_batches" in text
    assert assert_efficiencies_quoted_match(text, worse, 2) == 1


def test_each_class_is_named_by_the_largest_term_of_the_account():
    """One table per class, built so that class is true; the advice names it and its term."""
    base = row(1, 32, time_s=2.0, steps=100, telemetry=tel(0.02, data=0.002))
    # rank 1 computes 28 ms longer; rank 0 waits for it at the end of backward
    waits = dict(tel(0.05, data=0.002, comm=0.015), rank_step_time_s=[0.05, 0.05], rank_exposed_comm_s=[0.028, 0.002],
                 rank_phase_s={"data": [0.002, 0.002], "forward": [0.015, 0.041], "backward": [0.030, 0.004],
                               "optimizer": [0.003, 0.003]})
    cases = {"data": tel(0.05, data=0.03, comm=0.001), "communication": tel(0.05, data=0.002, comm=0.03),
             "compute": tel(0.05, data=0.002, comm=0.001, fwd=0.03), "imbalance": waits}
    phases = {"data": "data wait 28.0 ms", "communication": "exposed communication 30.0 ms",
              "compute": "compute slowdown", "imbalance": "waiting for the slowest rank 26.0 ms (87% of it"}
    for kind, t in cases.items():
        rows = scaled(base, row(2, 32, time_s=2.5, steps=50, telemetry=t))
        got, text = adv.diagnose(rows[1], rows)
        assert got == kind and phases[kind] in text, (kind, text)


def test_fastest_sentence_says_faster_for_a_faster_cell():
    rows = scaled(row(1, 64, time_s=10.0), row(2, 64, time_s=6.0, steps=50))
    text = adv.advise(rows)[0]
    assert "1.67× faster than 1 device(s)" in text and "the 1-device epoch time" not in text


def test_bench_shows_exposed_communication_not_the_whole_all_reduce():
    """A cell whose all-reduce took 30 ms of a 50 ms step, of which backward waited 10 ms: the table and the
    shares say 20 % (exposed), not 60 %; the advice quotes the exposed time."""
    from trainscale.bench import report

    t = dict(tel(0.05, comm=0.03), exposed_comm_s=0.01)
    rows = scaled(row(1, 4, time_s=2.0, steps=100, telemetry=tel(0.02)),
                  row(2, 4, time_s=2.5, steps=50, telemetry=t))
    s = shares(rows[1])
    assert s["comm_s"] == pytest.approx(0.01) and s["comm_share"] == pytest.approx(0.2)
    (line,) = [line for line in report.cell_table(rows) if "-d2-" in line]
    assert line.rstrip(" |").split(" | ")[-2:] == ["20%", "0%"]  # exposed comm, data
    assert "| exposed comm | data |" in report.cell_table(rows)[0]
    text = adv.diagnose(rows[1], rows)[1]
    assert "exposed communication 10.0 ms (33% of it" in text


def test_a_pipeline_cell_probes_no_gradient_all_reduce():
    """Under pp each stage holds different parameters and all-reduces no gradients: the cell's all-reduce probe
    (sized by this rank's parameters) would all-reduce different sizes on the stages and abort gloo
    ("Received data size doesn't match expected size"), so it is skipped before any collective."""
    from types import SimpleNamespace

    from trainscale.bench.cell import _probe_allreduce

    def no_collective():
        raise AssertionError("the probe issued a collective")

    rt = SimpleNamespace(world_size=2, strategy=SimpleNamespace(pipelined=True), barrier=no_collective)
    assert _probe_allreduce(rt, 1000) is None


def test_a_ctrl_c_while_a_job_starts_is_held_until_the_job_can_be_stopped():
    import os
    import signal

    from trainscale.jobs.launcher import _interrupt_deferred

    # Python's own handler, as in a terminal: a suite started in the background (`make test &`) inherits SIGINT
    # ignored, which is the second case below
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with _interrupt_deferred() as interrupted:
            os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt inside the block
        assert interrupted
        with _interrupt_deferred() as interrupted:
            pass
        assert not interrupted
        with pytest.raises(KeyboardInterrupt):  # the usual handler is back
            os.kill(os.getpid(), signal.SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job: nothing to defer, and it stays ignored
        with _interrupt_deferred() as interrupted:
            os.kill(os.getpid(), signal.SIGINT)
        assert not interrupted and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_stopping_a_job_kills_a_worker_it_started_and_returns_when_it_is_gone(tmp_path, monkeypatch):
    import subprocess
    import sys
    import time

    from trainscale.jobs import launcher
    from trainscale.jobs.launcher import _alive, _kill_group

    monkeypatch.setattr(launcher, "KILL_GRACE_S", 0.5)
    # a parent that ignores SIGTERM (so it gets SIGKILL after the grace period) and a child in its own session,
    # as torchrun's workers are: killing the parent's process group alone would leave the child running
    script = ("import subprocess, sys, time, signal\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
              f"open({str(tmp_path / 'child')!r}, 'w').write(str(p.pid))\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    child = tmp_path / "child"
    while not (child.is_file() and child.read_text()):
        assert proc.poll() is None
        time.sleep(0.01)
    pid = int(child.read_text())
    _kill_group(proc)
    assert proc.returncode is not None and not _alive(pid)
