"""benchmarks/gpu_check.py, the one command for a lent GPU, on this CPU machine: its CPU smoke run (every stage with
a CPU form, at tiny sizes), the budget that skips a stage that no longer fits and leaves the lease its slack, the
hard timeout of a stage's process tree with the partial results it keeps, the gpu tests' one pytest process, and
a machine without CUDA (a failure with a results.json under --expect-cuda). What it measures on a GPU is not
tested here (none ran)."""

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import run_distributed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _run(*args: str, timeout: float = 110) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = str(ROOT / "src")
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _smoke(tmp_path: Path, only: str, budget: str = "120", timeout: float = 110) -> dict:
    out = _run("--cpu-smoke", "--only", only, "--budget", budget, "--out", str(tmp_path), timeout=timeout)
    log = (tmp_path / "gpu_check.log").read_text()[-3000:] if (tmp_path / "gpu_check.log").exists() else ""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + log
    assert (tmp_path / "summary.md").read_text().startswith("# gpu_check (CPU smoke)")
    return json.loads((tmp_path / "results.json").read_text())["stages"]


def _stage_forked(rank: int, name: str, result: str, log: str) -> None:
    """What ``gpu_check.py --stage NAME --cpu-smoke --result RESULT`` runs, in a process forked warm by
    ``run_distributed`` (torch and torch._dynamo already imported), its output appended to the run's log."""
    for var in (*LAUNCHER_VARS, "LOCAL_WORLD_SIZE", "GROUP_RANK"):  # a stage process has no launcher's environment
        os.environ.pop(var, None)
    with open(log, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    _module()._run_stage_here(name, Path(result), smoke=True)


def _run_stage_forked(stage, smoke: bool, timeout_s: float, log: Path, partial=None) -> dict:
    """gpu_check's ``_run_stage_process`` with the stage's process forked warm instead of started fresh: each stage
    still runs in a process of its own, without the 3-5 s of imports a fresh one pays. The fresh start (``--stage``,
    its session, the kill at the timeout, the partial results) is what the budget and timeout tests run."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        started = time.monotonic()
        run_distributed(_stage_forked, stage.name, str(result), str(log), world_size=1, timeout=timeout_s)
        return {**json.loads(result.read_text()), "seconds": round(time.monotonic() - started, 1)}


# Two CPU smoke runs, each of several stages in one driver (as --cpu-smoke runs them all), shared by the tests that
# read their stages; the budget leaves every stage room on a loaded machine (the budget rule has its own tests). The
# driver is the command's main in this process and its stages are forked warm (``_run_stage_forked``).
SMOKE_GROUPS = {"first": "env,gpu_tests,precision,mfu,overhead", "second": "strategies,plan,compile"}


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """``smoke_runs(group)``: (the stages of results.json, the output folder) of that group's run, run once."""
    runs = {}

    def run(group: str) -> tuple[dict, Path]:
        if group not in runs:
            out = tmp_path_factory.mktemp(f"smoke_{group}")
            gc = _module()  # a module of this fixture's own: the stage launcher replaced in it only
            gc._run_stage_process = _run_stage_forked
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                code = gc.main(["--cpu-smoke", "--only", SMOKE_GROUPS[group], "--budget", "400", "--out", str(out)])
            assert code == 0, printed.getvalue()[-3000:] + (out / "gpu_check.log").read_text()[-3000:]
            assert (out / "summary.md").read_text().startswith("# gpu_check (CPU smoke)")
            runs[group] = (json.loads((out / "results.json").read_text())["stages"], out)
        return runs[group]

    return run


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_nothing_runs_and_it_says_so(tmp_path, capsys):
    code = _module().main(["--out", str(tmp_path)])  # in this process: the smoke runs start the script whole
    header, message = capsys.readouterr().out.strip().splitlines()
    assert header.startswith(f"gpu_check: torch {torch.__version__} (pyproject.toml declares torch>=")
    assert code == 0 and message == "no CUDA device: 8 stages skipped (--cpu-smoke runs their CPU forms)"
    assert not (tmp_path / "results.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_expect_cuda_without_cuda_fails_with_a_results_json_that_says_why(tmp_path, capsys):
    code = _module().main(["--expect-cuda", "--out", str(tmp_path)])
    assert code == 2 and "FAILED: no CUDA device, but --expect-cuda" in capsys.readouterr().err
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["error"].startswith("no CUDA device, but --expect-cuda: ")
    assert results["torch"] == torch.__version__ and results["torch_cuda"] == torch.version.cuda
    assert all(e == {"status": "skipped", "why": "no CUDA device"} for e in results["stages"].values())
    assert "no CUDA device, but --expect-cuda" in (tmp_path / "summary.md").read_text()
    if torch.version.cuda is None:
        assert f"torch {torch.__version__} is a build without CUDA" in results["error"]


def test_why_no_cuda_names_the_cause(monkeypatch):
    gc = _module()
    monkeypatch.setattr(torch.version, "cuda", None)
    assert gc.why_no_cuda() == f"torch {torch.__version__} is a build without CUDA"
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gc.why_no_cuda() == "CUDA_VISIBLE_DEVICES='' hides every GPU"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")

    def init():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 11040)")

    monkeypatch.setattr(torch.cuda, "init", init)
    why = gc.why_no_cuda()
    assert "RuntimeError: The NVIDIA driver on your system is too old" in why and "CUDA_VISIBLE_DEVICES='0'" in why


def test_the_lease_command_expects_cuda():
    """The documented lease command fails on a machine without CUDA instead of passing with nothing run."""
    doc = (ROOT / "docs" / "gpu-results.md").read_text()
    commands = [line for line in doc.splitlines() if line.startswith("run(command=") and "gpu_check.py" in line]
    assert commands and all("--expect-cuda" in c for c in commands)


def test_cpu_smoke_env_the_gpu_only_stage_and_precision_parity(smoke_runs):
    stages, tmp_path = smoke_runs("first")
    assert stages["env"]["status"] == "ran" and stages["env"]["numbers"]["torch"] == torch.__version__
    assert stages["gpu_tests"] == {"status": "skipped", "why": "no CPU form (needs CUDA)"}
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["torch"] == torch.__version__ and results["torch_declared"].startswith(">=")
    assert f"torch {torch.__version__} (CUDA build" in (tmp_path / "summary.md").read_text()
    precision = stages["precision"]
    checks = {c["name"].split(":")[0]: c for c in precision["checks"]}
    assert list(checks) == ["32-true", "16-mixed", "bf16-mixed", "bf16-true"]
    assert all(c["passed"] for c in checks.values()), checks  # on a CPU too: the same operations, the same numbers


def test_cpu_smoke_mfu(smoke_runs):
    stages, tmp_path = smoke_runs("first")
    mfu = stages["mfu"]
    assert mfu["status"] == "ran"
    numbers = mfu["numbers"]
    assert all(numbers[f"{v}_tokens_per_s"] > 0 for v in ("hand", "runtime", "trainer"))
    assert numbers["telemetry_vs_clock_error"] < 0.1  # the Trainer's own tokens/s against the clock outside its loop
    assert numbers["telemetry_flops_per_token"] == pytest.approx(numbers["analytic_flops_per_token"])  # declared
    assert "Trainer tokens/s / hand loop's" in {c["name"] for c in mfu["checks"]}
    log = (tmp_path / "gpu_check.log").read_text()
    assert "round 1 trainer" in log


def test_cpu_smoke_overhead(smoke_runs):
    overhead = smoke_runs("first")[0]["overhead"]
    assert overhead["status"] == "ran"
    assert all(overhead["numbers"][f"{v}_ms_per_step"] > 0 for v in ("plain", "runtime", "trainer", "trainer_lean"))


def test_cpu_smoke_strategies(smoke_runs):
    strategies = smoke_runs("second")[0]["strategies"]
    checks = {c["name"]: c for c in strategies["checks"]}
    assert strategies["status"] == "ran" and len(checks) == 4
    assert all(c["passed"] for c in checks.values())  # on a CPU too: the resumes and the parities hold


def test_cpu_smoke_plan_and_compile(smoke_runs):
    stages = smoke_runs("second")[0]
    assert [stages[name]["status"] for name in ("plan", "compile")] == ["ran", "ran"]
    assert stages["plan"]["numbers"]["predicted_peak_GiB"] > 0
    assert stages["compile"]["numbers"]["flops_method"] == "declared (the model's flops_per_token)"


def test_a_stage_that_does_not_fit_the_budget_is_skipped_and_recorded(tmp_path):
    stages = _smoke(tmp_path, "env,mfu,compile", budget="12")  # the whole command, each stage started fresh
    assert stages["env"]["status"] == "ran" and stages["env"]["numbers"]["torch"] == torch.__version__
    assert "===== env (timeout" in (tmp_path / "gpu_check.log").read_text()
    assert stages["mfu"] == {"status": "skipped", "why": stages["mfu"]["why"]}
    assert stages["mfu"]["why"].startswith("budget: needs ~25 s,")
    assert stages["compile"]["status"] == "skipped"


def test_budget_rule():
    gc = _module()
    mfu = next(s for s in gc.STAGES if s.name == "mfu")
    assert gc.plan_stage(mfu, smoke=False, left_s=mfu.estimate_s) == (mfu.estimate_s, None)
    assert gc.plan_stage(mfu, smoke=False, left_s=mfu.estimate_s - 1)[1].startswith("budget:")
    tests = next(s for s in gc.STAGES if s.name == "gpu_tests")
    assert gc.plan_stage(tests, smoke=True, left_s=1e9) == (None, "no CPU form (needs CUDA)")
    # the documented run fits all stages by their estimates, with at least 90 s of the lease's budget to spare
    assert gc.LEASE_SLACK_S >= 90
    assert sum(s.estimate_s for s in gc.STAGES) <= gc.DEFAULT_BUDGET_S - gc.LEASE_SLACK_S
    assert sum(s.cpu_estimate_s or 0 for s in gc.STAGES) <= 120


def test_a_stage_past_its_timeout_keeps_its_partial_numbers_and_leaves_no_process(tmp_path, monkeypatch):
    """A stage that hangs after measuring: results.json shows its numbers while it runs and keeps them when it is
    killed at its timeout; its children (in its process group and in a session of their own) die with it."""
    from trainscale.jobs.launcher import _alive

    gc = _module()
    stage = gc.Stage("hang", 1, 8, 1, "a number, two children, then a hang",
                     body=f"{ROOT / 'tests' / 'gpu_check_stages.py'}:sleep_past_timeout")
    written = []
    write_json = gc._write_json
    monkeypatch.setattr(gc, "_write_json", lambda path, data: (written.append(json.loads(json.dumps(data))),
                                                                write_json(path, data)))
    header = {"command": "test", "budget_s": 60, "cpu_smoke": True, "started": "now", "torch": torch.__version__}
    started = time.monotonic()
    assert gc._drive([stage], header, tmp_path, smoke=True) == 1
    assert time.monotonic() - started < 25
    running = [w["stages"]["hang"] for w in written if w["stages"].get("hang", {}).get("status") == "running"]
    assert running and running[-1]["numbers"]["measured_before_the_hang"] == 1.5  # written while it ran
    entry = json.loads((tmp_path / "results.json").read_text())["stages"]["hang"]
    assert entry["status"] == "timeout" and entry["why"] == "killed after 8 s, numbers measured until then kept"
    assert entry["numbers"]["measured_before_the_hang"] == 1.5 and entry["checks"][0]["passed"]
    assert all(not _alive(pid) for pid in entry["numbers"]["child_pids"])
    assert "| hang | timeout" in (tmp_path / "summary.md").read_text()


def test_gpu_tests_run_in_one_pytest_process(tmp_path):
    """pytest -m gpu without the suite's -n 2 (one CUDA context), its outcomes read line by line."""
    gc = _module()
    cmd = gc.gpu_tests_command(["tests/test_matmul_precision.py"])
    assert cmd[cmd.index("-p") + 1] == "no:xdist" and "-o" in cmd and cmd[cmd.index("-o") + 1].startswith("addopts=")
    lines = []
    rc = gc.stream_command(cmd, 60, lines.append)
    outcomes = [gc.parse_test_line(line) for line in lines if gc.parse_test_line(line)]
    assert rc == 0 and outcomes and not any(line.startswith(("[gw", "created:")) for line in lines)
    expected = "SKIPPED" if not torch.cuda.is_available() else "PASSED"
    assert {o for _, o, _ in outcomes} == {expected}


def test_a_command_past_its_timeout_is_killed_with_its_children():
    """What the gpu_tests stage does to pytest at its timeout: every process below it dies too."""
    from trainscale.jobs.launcher import _alive

    gc = _module()
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              "time.sleep(600)'], start_new_session=True); print('tests/t.py::t PASSED', flush=True); "
              "print('child', p.pid, flush=True); time.sleep(600)")
    lines = []
    started = time.monotonic()
    assert gc.stream_command([sys.executable, "-c", script], 3, lines.append) is None
    assert time.monotonic() - started < 12
    assert gc.parse_test_line(lines[0]) == ("tests/t.py::t", "PASSED", "")
    assert not _alive(int(lines[1].split()[1]))


def test_unknown_stage_names_are_refused():
    out = _run("--only", "env,mfu_typo")
    assert out.returncode != 0 and "unknown stage(s) mfu_typo" in out.stderr
