"""``trainscale check``: the CLI as a user runs it (a subprocess launching its runs through torchrun; run these under
the shared flock lock) on the built-in ConvNet under ddp; the command in this process, its runs' ranks forked from
the warm forkserver (tests/check_launch.py), under fsdp, on three workloads with a planted scaling bug and one
without (tests/check_workloads.py), and with bad flags; the comparison and the causes as pure logic on synthetic
traces."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainscale.check
from tests import check_launch
from trainscale import cli
from trainscale.check import causes, compare, runner
from trainscale.jobs import launcher

ROOT = Path(__file__).resolve().parents[1]


def check_cli(*args: str, out: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "trainscale.cli", "check", "--steps", "3", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def check_here(monkeypatch, capsys, *args: str, out: Path) -> tuple[int, str, str]:
    """``trainscale check --steps 3 ARGS`` in this process, its runs' ranks forked from the warm forkserver:
    (exit status, stdout, stderr)."""
    monkeypatch.setattr(launcher, "launch_job", check_launch.launch_job)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the command puts the current directory on it
    monkeypatch.chdir(ROOT)
    code = cli.main(["check", "--steps", "3", "--out", str(out), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_demo_convnet_passes(tmp_path, monkeypatch, capsys, strategy):
    if strategy == "ddp":  # the command whole, as a user runs it
        proc = check_cli("--strategy", strategy, out=tmp_path / "check")
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        code, stdout, stderr = check_here(monkeypatch, capsys, "--strategy", strategy, out=tmp_path / "check")
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert f"{strategy} × 2 against 1 device, 3 step(s), same global batch" in stdout
    assert "PASS: every step and the run's end agree within the tolerance" in stdout
    report = json.loads((tmp_path / "check" / "report.json").read_text())
    assert report["passed"] and len(report["rows"]) == 3
    assert max(r["loss_rel"] for r in report["rows"]) < report["rtol"]  # and the loss was not trivially equal:
    assert len({r["loss"][0] for r in report["rows"]}) == 3  # three different steps were trained
    # the speed-up account of the same two runs: the same global batch is strong scaling
    assert "speed-up account, 2 devices against 1: ideal" in stdout and "(strong scaling" in stdout
    assert ("communication was not timed" in stdout) == (strategy == "fsdp")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("entry, flags, cause", [
    ("batchnorm", [], "unsynchronised BatchNorm: 1 BatchNorm module(s) without SyncBatchNorm"),
    ("uneven_tokens", [], "loss normalised per rank instead of per global token count: step 0: the ranks' "
                          "non-ignored targets"),
    ("unscaled_lr", ["--lr-scaling", "linear", "--batch-size", "8"], "LR not scaled to the global batch: step 0: "
                                                                     "the 2-process run stepped with lr 0.1, the "
                                                                     "1-device reference with 0.2"),
])
def test_a_planted_bug_fails_naming_its_cause(tmp_path, monkeypatch, capsys, entry, flags, cause):
    code, stdout, stderr = check_here(monkeypatch, capsys, "--entry", f"tests.check_workloads:{entry}", *flags,
                                      out=tmp_path / "check")
    assert code == 1, stdout[-3000:] + stderr[-3000:]
    assert "FAIL:" in stdout
    found = stdout.split("cause(s) found:\n", 1)[1].split("other usual causes:")[0]
    assert found.count("  * ") == 1 and f"  * {cause}" in found, stdout
    report = json.loads((tmp_path / "check" / "report.json").read_text())
    assert [f["cause"] for f in report["findings"] if f["status"] == "found"] == [cause.split(":")[0]]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_lr_scaled_by_the_trainer_passes_the_lr_scaling_check(tmp_path, monkeypatch, capsys):
    code, stdout, stderr = check_here(monkeypatch, capsys, "--entry", "tests.check_workloads:scaled_lr",
                                      "--lr-scaling", "linear", "--batch-size", "8", out=tmp_path / "check")
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    rows = json.loads((tmp_path / "check" / "report.json").read_text())["rows"]
    assert [r["lr"] for r in rows] == [[0.2, 0.2]] * 3  # SGD's 0.1 tuned at 8, × 2 for 2 × 8 in both runs
    # the reference trains the same global batch (2 × 8) on one device: strong scaling here too
    assert "speed-up account, 2 devices against 1" in stdout and "(strong scaling" in stdout


@pytest.mark.parametrize("flags, message", [
    (["--devices", "1"], "devices=1 must be an int >= 2"),
    (["--batch-size", "33"], "batch_size=33 must split into 2 devices × 1 accumulated micro-batch(es) evenly"),
    (["--precision", "bf16-mixed"], "no measured tolerance for precision='bf16-mixed'"),
    (["--entry", "nosuchpkg.mod:fn"], "cannot import 'nosuchpkg.mod'"),
])
def test_bad_flags_fail_before_any_run_with_a_one_line_error(tmp_path, monkeypatch, capsys, flags, message):
    code, _, stderr = check_here(monkeypatch, capsys, *flags, out=tmp_path / "check")
    assert code == 2 and message in stderr and stderr.count("\n") == 1, stderr
    assert not (tmp_path / "check").exists()


def test_python_api_is_exported_lazily():
    assert trainscale.check.check is runner.check  # the package named after the command holds it


def test_runs_keep_the_global_batch_or_the_per_device_batch():
    work = {"trainer": {"accumulate_grad_batches": 2}}
    ref, job = runner.plan_runs(work, 4, 32, None)
    assert (ref["micro_batch"], job["micro_batch"], job["devices"]) == (16, 4, 4)  # 1 × 16 × 2 = 4 × 4 × 2 = 32
    ref, job = runner.plan_runs({"trainer": {}}, 2, 8, "sqrt")
    assert (ref["micro_batch"], job["micro_batch"]) == (16, 8)
    assert ref["trainer"] == {"lr_scaling": "sqrt", "base_batch_size": 8} and job["trainer"] == {}
    ref, _ = runner.plan_runs({"trainer": {"lr_scaling": "linear", "base_batch_size": 64}}, 2, 8, "sqrt")
    assert ref["trainer"] == {"lr_scaling": "sqrt", "base_batch_size": 64}  # the job's base: where its lr was tuned


def trace(world: int, micro: list[list], steps: int, dataset_len: int = 64, val: dict | None = None,
          micro_batch: int | None = None) -> dict:
    """A synthetic trace: ``micro`` per rank, ``[loss, samples, targets, checksum]`` per micro-batch."""
    final_rank = {"buffers": {}, "probe": [1.0, 2.0]}
    return {"world_size": world, "strategy": "ddp", "global_batch_size": 8, "micro_batch": micro_batch or 8 // world,
            "accumulate": 1, "lr_scale_factor": 1.0, "trainer": {}, "dataset_len": dataset_len, "val_len": 9,
            "model": {"batchnorm": 0, "sync_batchnorm": 0, "dropout": 0}, "micro": micro,
            "steps": [{"grad_norm": 1.0, "lr": [0.1]} for _ in range(steps)],
            "history": [{"epoch": 0, **(val or {})}], "final": {"weights_norm": 1.0, "ranks": [final_rank] * world}}


def diagnose(ref: dict, dist: dict) -> tuple[compare.Comparison, list[causes.Finding]]:
    comparison, rv, dv = compare.compare(ref, dist, 1e-4)
    return comparison, causes.diagnose(causes.Context(ref, dist, rv, dv, comparison, None))


def test_padding_duplicates_are_found_at_the_epochs_last_step():
    # 7 samples over 2 ranks: 4 per rank, sample 0 repeated; batches of 2 per rank: the epoch's last step is 1
    ref = trace(1, [[[1.0, 4, None, 10.0], [1.0, 3, None, 11.0]]], 2, dataset_len=7, micro_batch=4)
    dist = trace(2, [[[1.0, 2, None, 5.0], [1.0, 2, None, 6.0]], [[1.0, 2, None, 5.0], [1.0, 2, None, 5.5]]], 2,
                 dataset_len=7, micro_batch=2)
    comparison, findings = diagnose(ref, dist)
    assert not comparison.ok and comparison.first_step == 1
    assert comparison.mismatches == ["step 1: the global batch holds other samples (input checksums differ)"]
    assert findings[0].cause == "samples duplicated by padding" and findings[0].status == causes.FOUND
    assert "repeats 1 sample(s) at the end of every epoch (step 1)" in findings[0].evidence


def test_a_metric_that_differs_while_the_weights_agree_is_a_mean_of_means():
    micro = [[1.0, 8, None, 3.0]]
    ref = trace(1, [micro], 1, val={"val_accuracy": 0.5})
    dist = trace(2, [[[1.0, 4, None, 1.0]], [[1.0, 4, None, 2.0]]], 1, val={"val_accuracy": 0.52})
    comparison, findings = diagnose(ref, dist)
    assert comparison.mismatches == ["end: val_accuracy differ, relative difference 0.038"]
    assert findings[0].cause == "metrics averaged as means of means" and findings[0].status == causes.FOUND
    assert "splits [5, 4] over the ranks" in findings[0].evidence


def test_agreeing_traces_pass_and_differences_are_relative():
    ref = trace(1, [[[2.0, 8, 8, 3.0]]], 1)
    dist = trace(2, [[[2.0 + 1e-6, 4, 4, 1.0]], [[2.0 - 1e-6, 4, 4, 2.0]]], 1)
    comparison, findings = diagnose(ref, dist)
    assert comparison.ok and all(f.status == causes.NOT_SEEN for f in findings)
    assert compare.rel(1.0, 1.0001) == pytest.approx(1e-4 / 1.0001) and compare.rel(0.0, 0.0) == 0.0
    assert compare.rel(1.0, math.nan) == math.inf
