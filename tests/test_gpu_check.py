"""benchmarks/gpu_check.py, the one command for a lent GPU, on this CPU machine: its CPU smoke run (every stage with
a CPU form, at tiny sizes), the budget that skips a stage that no longer fits, the hard timeout of a stage's
process, and the message of a machine without CUDA. What it measures on a GPU is not tested here (none ran)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def _smoke(tmp_path: Path, only: str, budget: str = "120") -> dict:
    out = _run("--cpu-smoke", "--only", only, "--budget", budget, "--out", str(tmp_path))
    log = (tmp_path / "gpu_check.log").read_text()[-3000:] if (tmp_path / "gpu_check.log").exists() else ""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + log
    assert (tmp_path / "summary.md").read_text().startswith("# gpu_check (CPU smoke)")
    return json.loads((tmp_path / "results.json").read_text())["stages"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_nothing_runs_and_it_says_so(tmp_path):
    out = _run("--out", str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == \
        "no CUDA device: 7 stages skipped (--cpu-smoke runs their CPU forms)"
    assert not (tmp_path / "results.json").exists()


def test_cpu_smoke_env_and_the_gpu_only_stage(tmp_path):
    stages = _smoke(tmp_path, "env,gpu_tests")
    assert stages["env"]["status"] == "ran" and stages["env"]["numbers"]["torch"] == torch.__version__
    assert stages["gpu_tests"] == {"status": "skipped", "why": "no CPU form (needs CUDA)"}


def test_cpu_smoke_mfu(tmp_path):
    [mfu] = _smoke(tmp_path, "mfu").values()
    assert mfu["status"] == "ran"
    numbers = mfu["numbers"]
    assert all(numbers[f"{v}_tokens_per_s"] > 0 for v in ("hand", "runtime", "trainer"))
    assert numbers["telemetry_vs_clock_error"] < 0.1  # the Trainer's own tokens/s against the clock outside its loop
    assert numbers["telemetry_flops_per_token"] == pytest.approx(numbers["analytic_flops_per_token"])  # declared
    assert "Trainer tokens/s / hand loop's" in {c["name"] for c in mfu["checks"]}
    log = (tmp_path / "gpu_check.log").read_text()
    assert "===== mfu" in log and "round 1 trainer" in log


def test_cpu_smoke_overhead(tmp_path):
    [overhead] = _smoke(tmp_path, "overhead").values()
    assert overhead["status"] == "ran"
    assert all(overhead["numbers"][f"{v}_ms_per_step"] > 0 for v in ("plain", "runtime", "trainer", "trainer_lean"))


def test_cpu_smoke_strategies(tmp_path):
    [strategies] = _smoke(tmp_path, "strategies").values()
    checks = {c["name"]: c for c in strategies["checks"]}
    assert strategies["status"] == "ran" and len(checks) == 4
    assert all(c["passed"] for c in checks.values())  # on a CPU too: the resumes and the parities hold


def test_cpu_smoke_plan_and_compile(tmp_path):
    stages = _smoke(tmp_path, "plan,compile")
    assert [s["status"] for s in stages.values()] == ["ran", "ran"]
    assert stages["plan"]["numbers"]["predicted_peak_GiB"] > 0
    assert stages["compile"]["numbers"]["flops_method"] == "declared (the model's flops_per_token)"


def test_a_stage_that_does_not_fit_the_budget_is_skipped_and_recorded(tmp_path):
    stages = _smoke(tmp_path, "env,mfu,compile", budget="12")
    assert stages["env"]["status"] == "ran"
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
    assert sum(s.estimate_s for s in gc.STAGES) <= 480  # the documented run fits all stages, by the estimates
    assert sum(s.cpu_estimate_s or 0 for s in gc.STAGES) <= 120


def test_a_stage_past_its_timeout_is_killed_and_recorded(tmp_path):
    gc = _module()
    mfu = next(s for s in gc.STAGES if s.name == "mfu")
    log = tmp_path / "log"
    log.write_text("")
    entry = gc._run_stage_process(mfu, smoke=True, timeout_s=0.5, log=log)
    assert entry["status"] == "timeout" and entry["why"].startswith("killed after") and entry["seconds"] < 5


def test_unknown_stage_names_are_refused():
    out = _run("--only", "env,mfu_typo")
    assert out.returncode != 0 and "unknown stage(s) mfu_typo" in out.stderr
