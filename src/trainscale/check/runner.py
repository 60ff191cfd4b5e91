"""``trainscale check``: is the N-process run learning the same thing as the 1-device run?

    from trainscale.check import check
    result = check(devices=2, strategy="ddp", steps=5)
    print(result.text); assert result.passed

Two jobs, each started like a bench cell (:func:`trainscale.jobs.launcher.launch_job`: torchrun, its own process
group, a timeout) running :mod:`trainscale.check.worker`: the reference on 1 device and the job on N processes,
with the same seed, initial weights and sample order (DistributedSampler's permutation does not depend on
the world size: rank r takes samples r, r+N, ..., so a global batch holds the same samples in both runs).

- Default (same global batch G = ``batch_size``): the reference trains on G per step, each of the N processes
  on G/N; both with the workload's own Trainer flags. Everything must agree within the tolerance.
- ``lr_scaling="linear"|"sqrt"`` (per-device batch B = ``batch_size`` fixed): the job trains N × B per step
  with the workload's flags; the reference trains N × B on one device with the lr the rule prescribes for the
  global batch N·B from the lr tuned at ``base_batch_size`` (the workload's, else B). A job that does not scale
  its lr, or scales it by another rule, fails, naming the cause.

The traces are compared by :mod:`trainscale.check.compare` and explained by :mod:`trainscale.check.causes`.
Files in ``out`` (default ``runs/check/version_N``): ``reference/`` and ``distributed/`` (job.json, log.txt,
trace.json), ``report.txt`` and ``report.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainscale.check.causes import Finding

STRATEGIES = ("ddp", "fsdp")
PROBE_SAMPLES = 8


class CheckRunError(RuntimeError):
    """A run of the check failed or timed out (the message names which, with its error or log)."""


@dataclass
class CheckResult:
    """What :func:`check` returns.

    Attributes:
        passed: every compared number agrees within ``rtol``.
        text: the report (what the command prints).
        rows: per step, both runs' loss, gradient norm and lr, and their relative differences.
        mismatches: one sentence per difference beyond the tolerance.
        findings: the usual causes with their status ("found", "possible", "not seen") and evidence.
        rtol: the relative tolerance used. out: the run directory.
    """

    passed: bool
    text: str
    rows: list[dict]
    mismatches: list[str]
    findings: list[Finding]
    rtol: float
    out: Path

    @property
    def causes_found(self) -> list[str]:
        return [f.cause for f in self.findings if f.status == "found"]


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")


def _validate(devices, strategy, steps, batch_size, lr_scaling, precision, rtol, timeout) -> float:
    """Check the flags; return the tolerance.

    Raises:
        ValueError: a bad value, naming the fix.
    """
    from trainscale.check.compare import RTOL

    for name, value in (("steps", steps), ("batch_size", batch_size)):
        _positive_int(name, value)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 2:
        raise ValueError(f"devices={devices!r} must be an int >= 2 (the check compares N processes with 1 device)")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: the check runs {' or '.join(STRATEGIES)}")
    if lr_scaling not in (None, "linear", "sqrt"):
        raise ValueError(f"lr_scaling={lr_scaling!r}; choose 'linear' or 'sqrt' (or leave it out)")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    if rtol is None and precision not in RTOL:
        raise ValueError(f"no measured tolerance for precision={precision!r} (only {', '.join(RTOL)}); pass rtol=")
    tol = RTOL.get(precision) if rtol is None else rtol
    if not 0 < tol < 1:
        raise ValueError(f"rtol={tol!r} must be in (0, 1)")
    return tol


def plan_runs(work: dict, devices: int, batch_size: int, lr_scaling: str | None) -> tuple[dict, dict]:
    """``(reference, job)``: each run's micro-batch and Trainer flags.

    Raises:
        ValueError: a batch that does not split into the devices and the workload's accumulation.
    """
    flags = dict(work["trainer"])
    accumulate = flags.get("accumulate_grad_batches", 1)
    per_device = batch_size if lr_scaling else batch_size // devices
    if (not lr_scaling and batch_size % devices) or per_device % accumulate:
        raise ValueError(f"batch_size={batch_size} must split into {'' if lr_scaling else f'{devices} devices × '}"
                         f"{accumulate} accumulated micro-batch(es) evenly")
    ref_flags = flags
    if lr_scaling:  # the reference takes the lr the rule gives for the global batch, whatever the job does
        ref_flags = {**flags, "lr_scaling": lr_scaling,
                     "base_batch_size": flags.get("base_batch_size") or batch_size}
    return ({"devices": 1, "strategy": "auto", "micro_batch": per_device * devices // accumulate, "trainer": ref_flags},
            {"devices": devices, "micro_batch": per_device // accumulate, "trainer": flags})


def _run(name: str, run: dict, common: dict, out: Path, timeout: float, threads: int) -> dict:
    """Launch one run and return its trace.

    Raises:
        CheckRunError: the run failed or timed out.
    """
    from trainscale.jobs.launcher import launch_job

    run_dir = out / name
    run_dir.mkdir(parents=True)
    config = {**common, **run, "run_dir": str(run_dir.resolve())}
    (run_dir / "job.json").write_text(json.dumps(config, indent=2) + "\n")
    code, timed_out, _ = launch_job("trainscale.check.worker", run_dir / "job.json", run["devices"],
                                    run_dir / "log.txt", timeout, threads)
    trace = run_dir / "trace.json"
    if trace.is_file():
        return json.loads(trace.read_text())
    errors = sorted(run_dir.glob("error.rank*.json"))
    if timed_out:
        why = f"no result after the {timeout:g} s timeout (process group killed)"
    elif errors:
        err = json.loads(errors[0].read_text())
        why = f"rank {err['rank']}: {err['type']}: {err['message']}"
    else:
        log = (run_dir / "log.txt").read_text(errors="replace").strip().splitlines()
        why = f"exit code {code}; log: {' | '.join(log[-5:])}"
    raise CheckRunError(f"the {name} run failed ({why}); see {run_dir / 'log.txt'}")


def check(entry: str | Callable | None = None, *, devices: int = 2, strategy: str = "ddp", steps: int = 5,
          batch_size: int = 32, lr_scaling: str | None = None, precision: str = "32-true", accelerator: str = "auto",
          seed: int = 0, rtol: float | None = None, timeout: float = 600.0, out: str | os.PathLike | None = None,
          progress: bool = True) -> CheckResult:
    """Run the workload for ``steps`` optimizer steps on 1 device and on ``devices`` processes; compare.

    Args:
        entry: ``"package.module:function"`` (bench's workload contract, with its optional ``"trainer"`` flags)
            or an importable function; None: the ConvNet on MNIST-5k without BatchNorm
            (:mod:`trainscale.check.workload`).
        devices: processes (CPU) or GPUs of the distributed run (>= 2).
        strategy: "ddp" or "fsdp". steps: optimizer steps compared.
        batch_size: the global batch (default), or with ``lr_scaling`` the per-device batch.
        lr_scaling: None, or the rule ("linear", "sqrt") the job's lr must follow (module docstring).
        precision: "32-true" (other precisions need ``rtol``). rtol: relative tolerance (default: by precision,
            :data:`trainscale.check.compare.RTOL`).
        timeout: seconds per run before its process group is killed. out: the run directory.
        progress: a line on stderr as each run starts.

    Returns:
        A :class:`CheckResult` (``passed`` False names the differences and their causes).

    Raises:
        ValueError: bad flags or workload (before any run). CheckRunError: a run failed or timed out.
    """
    import sys

    from trainscale.jobs.launcher import next_version_dir, threads_per_process
    from trainscale.jobs.workload import entry_name, load_workload
    from trainscale.check import causes, compare, report

    tol = _validate(devices, strategy, steps, batch_size, lr_scaling, precision, rtol, timeout)
    entry = entry_name(entry if entry is not None else "trainscale.check.workload:convnet")
    work = load_workload(entry)
    ref_run, job_run = plan_runs(work, devices, batch_size, lr_scaling)
    out = Path(out) if out is not None else next_version_dir(Path("runs/check"))
    common = {"entry": entry, "accelerator": accelerator, "strategy": strategy, "precision": precision,
              "steps": steps, "seed": seed, "probe_samples": PROBE_SAMPLES}
    threads = threads_per_process(devices)
    traces = {}
    for name, run in (("reference", ref_run), ("distributed", job_run)):
        if progress:
            print(f"check: {name} run, {run['devices']} process(es) × micro-batch {run['micro_batch']} ...",
                  file=sys.stderr, flush=True)
        traces[name] = _run(name, run, common, out, timeout, threads)
    ref, dist = traces["reference"], traces["distributed"]
    comparison, ref_view, dist_view = compare.compare(ref, dist, tol)
    findings = causes.diagnose(causes.Context(ref, dist, ref_view, dist_view, comparison, lr_scaling))
    text = "\n".join([report.header(ref, dist, entry, lr_scaling, steps), report.step_table(comparison, devices),
                      report.end_lines(comparison), report.verdict(comparison, findings), report.speed(ref, dist)])
    result = CheckResult(comparison.ok, text, comparison.rows, comparison.mismatches, findings, tol, out)
    (out / "report.txt").write_text(text + "\n")
    (out / "report.json").write_text(json.dumps(
        {"passed": result.passed, "rtol": tol, "rows": comparison.rows, "mismatches": comparison.mismatches,
         "finals": comparison.finals, "findings": [f.as_dict() for f in findings]}, indent=2) + "\n")
    return result
