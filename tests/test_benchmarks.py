"""The benchmark scripts run in their ``--quick`` smoke mode and print their tables.

Speed is never asserted here (the machine is shared; numbers come from ``make bench``); what is
checked is that each script runs end to end, prints every row, and the facts that do not depend
on speed: one gradient all-reduce per optimizer step with accumulation 4, and ``trainscale --help``
not importing torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import workers
from tests.helpers import run_distributed

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_bench(script: str, *args: str, timeout: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def table_rows(stdout: str, first_column: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.split()[:1] == [first_column]]


def test_overhead_prints_every_workload():
    # two of the three workloads: each goes through the same variants and table (only the model and batch differ)
    stdout = run_bench("overhead.py", "--workloads", "mlp,tiny")
    for workload in ("mlp", "tiny"):
        assert f"## {workload}:" in stdout
    for variant in ("plain", "runtime", "trainer", "trainer-lean", "trainer-flops"):
        rows = table_rows(stdout, variant)
        assert len(rows) == 2, stdout  # one per workload
        assert all(float(row[1]) > 0 for row in rows)  # a median step time in ms
    assert all(float(row[10]) == 0.0 for row in table_rows(stdout, "plain"))  # µs over itself


# Each bench run below is split in two launches, so that no test's set-up passes a minute on a loaded machine.
@pytest.fixture(scope="module")
def ddp_throughput_stdout() -> str:
    """ddp.py's throughput launch on the MLP: plain and the Trainer epoch by epoch, at accumulation 1 and 4 (the
    count does not depend on the model: one DDP bucket either way)."""
    return run_bench("ddp.py", "--variants", "trainer", "--launches", "0", "--workload", "mlp")


@pytest.fixture(scope="module")
def ddp_launch_stdout() -> str:
    """ddp.py's whole-process launches on the MLP: plain, and the Trainer relaunching itself under torchrun (the
    Trainer's own launch under torchrun runs the same worker as the throughput launch's, so it is not launched
    again)."""
    return run_bench("ddp.py", "--no-throughput", "--variants", "trainer", "--launch-variants", "trainer-relaunch",
                     "--workload", "mlp")


@pytest.mark.multiprocess
def test_ddp_throughput_counts_one_all_reduce_per_optimizer_step(ddp_throughput_stdout):
    throughput = ddp_throughput_stdout
    assert "## Whole-process time" not in throughput, throughput  # --launches 0
    for variant in ("plain", "trainer"):
        rows = table_rows(throughput, variant)
        assert [row[1] for row in rows] == ["1", "4"], throughput  # accumulation 1 and 4
        for row in rows:
            steps, allreduces, per_step = int(row[-3]), int(row[-2]), row[-1]
            assert steps > 0 and allreduces == steps and per_step == "1.00", throughput


@pytest.mark.multiprocess
def test_ddp_whole_process_launches_count_one_all_reduce_per_optimizer_step(ddp_launch_stdout):
    _, process = ddp_launch_stdout.split("## Whole-process time")
    assert table_rows(process, "trainer") == []  # launched only in the throughput table
    for variant in ("plain", "trainer-relaunch"):
        [row] = table_rows(process, variant)
        assert float(row[1]) > 0, ddp_launch_stdout  # process seconds
        for cell in row[-2:]:  # optimizer steps / all-reduces at accumulation 1 and 4
            steps, allreduces = cell.split("/")
            assert int(steps) > 0 and allreduces == steps, ddp_launch_stdout


def _has_rows(stdout: str, *commands: str) -> None:
    for command in commands:
        assert any(line.startswith(command + " ") for line in stdout.splitlines()), stdout


def test_startup_times_imports_first_steps_and_help_without_torch():
    stdout = run_bench("startup.py", "--part", "one-process")
    _has_rows(stdout, "import torch", "import trainscale", "from trainscale import Trainer",
              "trainscale --help", "first step, plain", "first step, Runtime", "first step, Trainer")
    assert "trainscale --help imports torch: no" in stdout


@pytest.mark.multiprocess
def test_startup_times_a_relaunch_against_raw_torchrun():
    # README's 2-rank shape (the Trainer made first; the other two jobs relaunch through the same path, and each
    # 2-rank launch costs three torch imports)
    stdout = run_bench("startup.py", "--part", "two-ranks", "--scripts", "trainer-first")
    _has_rows(stdout, "2 ranks Trainer first, python", "2 ranks Trainer first, torchrun")
    assert "2 ranks factory" not in stdout and "2 ranks, torchrun" not in stdout
    assert "(relaunched under torchrun, Trainer first) against raw torchrun:" in stdout


def test_scale_simulates_first_middle_and_last_rank_at_each_world_size():
    # one process, the fake process group: world sizes 8 and 64, ranks 0, W/2 and W-1
    stdout = run_bench("scale.py", "--repeats", "1")
    rows = [cells for line in stdout.splitlines() if line.startswith("|")
            and (cells := [c.strip() for c in line.strip("|").split("|")])[0].isdigit()]
    assert [(int(row[0]), int(row[1])) for row in rows] == [(8, 0), (8, 4), (8, 7), (64, 0), (64, 32), (64, 63)]
    for row in rows:
        assert all(cell.endswith(" ms") and float(cell.split()[0]) >= 0 for cell in row[2:-2]), stdout
    # every rank creates every layout's groups, its own or not (all ranks call new_group for each subgroup)
    groups = {size: {int(row[-2]) for row in rows if row[0] == size} for size in ("8", "64")}
    assert len(groups["8"]) == 1 and len(groups["64"]) == 1 and min(groups["64"]) > max(groups["8"]), stdout


@pytest.mark.multiprocess
def test_checkpoint_stall_compares_a_background_save_with_a_synchronous_one():
    stdout = run_bench("checkpoint_stall.py")
    assert "## checkpoint stall: fsdp × 2 ranks" in stdout, stdout
    for measure in ("sync save (s)", "async stall (s)", "stall / sync", "async background write (s)"):
        [line] = [line for line in stdout.splitlines() if line.startswith(measure)]
        assert float(line[len(measure):].split()[0]) > 0, line


# trainscale's own bytecodes per optimizer step of a default Trainer fit on the tiny workload (step records every
# 50 steps included): 1 464 measured with Python 3.11 (1 327 before the optimizer step went through Lightning's
# optimizer_step hook, its closure and StepOptimizer.step, and callback_metrics took what on_train_batch_end logs;
# 1 178 before the profiler's five named regions in train_step, Lightning's, each a `with` on a no-op context
# without a profiler), so ~10 % of margin above it.
# Counted, not timed (benchmarks/step_profile.py), so the same on a loaded machine: a new call per step fails it.
OWN_BYTECODES_PER_STEP = 1610


def test_step_profile_counts_each_variant_and_holds_the_bytecode_budget():
    stdout = run_bench("step_profile.py", "--steps", "100", timeout=180)
    totals = {row[0]: (float(row[1]), float(row[2])) for row in
              (line.split() for line in stdout.splitlines()) if row[:1] and row[0] in
              ("plain", "runtime", "trainer-lean", "trainer") and len(row) == 5}
    assert set(totals) == {"plain", "runtime", "trainer-lean", "trainer"}, stdout
    assert totals["plain"][1] == 0  # over itself
    assert 0 < totals["runtime"][1] < totals["trainer-lean"][1] < totals["trainer"][1], stdout
    own = {line.split("## ")[1].split(":")[0]: float(line.split("trainscale's own code: ")[1].split("/")[0])
           for line in stdout.splitlines() if line.startswith("## ")}
    assert own["trainer"] <= OWN_BYTECODES_PER_STEP, stdout


@pytest.mark.timeout(60)
def test_checkpoint_digests_prints_the_cost_per_gb():
    stdout = run_bench("checkpoint_digests.py", timeout=55)
    for row in ("hash at save", "verify at load", "load verify=False"):
        assert row in stdout, stdout


@pytest.mark.timeout(60)
def test_predict_prints_a_row_per_size():
    stdout = run_bench("predict.py", timeout=55)
    rows = table_rows(stdout, "100") + table_rows(stdout, "1000")
    assert len(rows) == 2 and all(float(row[1]) > 0 for row in rows), stdout


# trainscale's own functions and files a step runs, from train_step's entry to its return (benchmarks/step_trace.py:
# a default fit, ddp on 2 processes, accumulation 2; the logging step writes a step record, and here also runs the
# fault check, which is due at most every log_every_n_steps). Measured with Python 3.11: plain 49 functions in
# 20 files, logging 79 in 28 (78 before Trainer._zero_grad, the one place that zeroes the gradients, which the step
# and an L-BFGS re-evaluation share: its lines were written twice). Of the 31 functions only the logging step runs, 15 are telemetry's record (the
# interval's sums drained, every rank's gathered, the fixed numbers, stragglers, memory and GPU readings), the others
# the learning rates (one call: their names are kept between log steps), sync_dist's check, the writes to
# metrics.jsonl and the CSV logger, callback_metrics, the progress bar's postfix and the fault check's all-reduce (83
# when each record named the param groups again and telemetry had its own mean and median; 100 in 31 when the record
# went through a forwarding method, a per-field helper and the peak-FLOPs lookup without FLOPs to divide, and the
# fault check through five one-use helpers). Counted, not timed: a new call on the logging path fails it.
LOGGING_STEP_FUNCTIONS, LOGGING_STEP_FILES = 79, 28


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_logging_step_runs_no_more_functions_and_files_than_its_budget(tmp_path):
    found = run_distributed(workers.step_trace_body, str(tmp_path), timeout=55)[0]
    plain, logging = found["plain"], found["logging"]
    # the tracer sees the step: the record's reduction and write in the logging step only
    record_path = {"trainscale/loop/records.py:MetricsProcessor.reduce_across_ranks",
                   "trainscale/loop/records.py:MetricsProcessor.write", "trainscale/telemetry/processor.py:Telemetry.log"}
    assert record_path <= set(logging["function_names"]), logging["function_names"]
    assert not record_path & set(plain["function_names"]), plain["function_names"]
    assert "trainscale/loop/trainer.py:Trainer.train_step" in plain["function_names"]
    assert logging["functions"] <= LOGGING_STEP_FUNCTIONS, "\n".join(logging["function_names"])
    assert len(logging["files"]) <= LOGGING_STEP_FILES, logging["files"]
