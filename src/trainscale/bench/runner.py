"""The sweep: each cell a fresh torchrun job, recorded as it finishes, resumable.

    from trainscale.bench import sweep
    result = sweep(devices=[1, 2], batch_sizes=[16, 64], steps=50, out="runs/bench-small")
    print(result.tables); print("\\n".join(result.advice))

Each cell runs ``python -m torch.distributed.run --standalone --nproc-per-node=N -m trainscale.bench.cell
--config cells/<key>/cell.json`` (torchrun's arguments and environment from
:mod:`trainscale.runtime.launch`) in its own process group, under a timeout. The cell's row (status
``ok``, ``oom``, ``timeout``, ``failed`` or ``crashed``, with the reason) is appended to
``results.jsonl`` as soon as the cell ends; ``resume=True`` skips every cell already there (delete a
line to measure that cell again). The report files are written at the end (:mod:`trainscale.bench.report`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from trainscale.bench.grid import DEFAULT_BATCH_SIZES, Cell, default_devices, plan
from trainscale.jobs.launcher import launch_job, next_version_dir, threads_per_process
from trainscale.jobs.workload import entry_name, resolve_entry
from trainscale.loop.config import TrainerConfig
from trainscale.runtime.flags import check_flags



@dataclass
class BenchResult:
    """What a sweep returns.

    Attributes:
        out: the run directory.
        rows: one dict per cell, with ``epoch_time_s``, ``gain`` and ``efficiency`` added.
        tables: the terminal tables, one per strategy × precision.
        advice: advice sentences.
        ran: keys of the cells run by this call (not skipped by ``resume``).
        accounts: each multi-device cell's speed-up account as a text stacked bar ("" when no cell and its
            baseline recorded telemetry).
    """

    out: Path
    rows: list[dict]
    tables: str
    advice: list[str]
    ran: list[str] = field(default_factory=list)
    accounts: str = ""




def _latest_dir(root: Path) -> Path | None:
    versions = sorted((p for p in root.glob("version_*") if p.name[8:].isdigit()), key=lambda p: int(p.name[8:]))
    return versions[-1] if versions else None


def read_rows(path: Path) -> list[dict]:
    """Rows of ``results.jsonl``; a torn last line (the sweep was killed while writing) is ignored."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


class Progress:
    """One line per event on stderr: cells done/total, elapsed time, the current cell, its outcome."""

    def __init__(self, total: int, enabled: bool = True, stream=None) -> None:
        self.total, self.enabled, self.stream = total, enabled, stream or sys.stderr
        self.done = 0
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        if self.enabled:
            from trainscale.jobs.format import fmt_time

            print(f"bench [{self.done:>{len(str(self.total))}}/{self.total} done, {fmt_time(time.monotonic() - self.t0)}"
                  f"] {text}", file=self.stream, flush=True)


def _cell_outcome(cell_dir: Path, returncode: int | None, timed_out: bool, timeout: float) -> tuple[str, str, dict]:
    """``(status, reason, result)`` from what the cell left in ``cell_dir``."""
    result_path = cell_dir / "result.json"
    if result_path.is_file():
        # Rank zero writes it after a collective that every rank reached, so the measurement is complete
        # even if a process failed afterwards, while exiting; that failure is noted, not hidden.
        note = "" if returncode == 0 else f"measured; then the job exited with code {returncode} (see log.txt)"
        return "ok", note, json.loads(result_path.read_text())
    if timed_out:
        return "timeout", f"no result after the {timeout:g} s per-cell timeout (process group killed)", {}
    errors = [json.loads(p.read_text()) for p in sorted(cell_dir.glob("error.rank*.json"))]
    if errors:
        err = next((e for e in errors if e.get("oom")), errors[0])
        status = "oom" if err.get("oom") else "failed"
        return status, f"rank {err['rank']}: {err['type']}: {err['message'].splitlines()[0][:300] if err['message'] else ''}", {}
    log = cell_dir / "log.txt"
    lines = [l.strip() for l in log.read_text(errors="replace").splitlines() if l.strip()] if log.is_file() else []
    # torchrun's failure summary names a worker's exit code or signal ("exitcode : -9", "Signal 9 (SIGKILL)").
    telling = [l for l in lines if "exitcode" in l or "Signal" in l or "Error" in l] or lines
    if returncode is not None and returncode < 0:
        why = f"killed by signal {-returncode}"
    else:
        why = f"exit code {returncode}"
    if returncode == -9 or any("SIGKILL" in l or "exitcode  : -9" in l for l in lines):
        why += " (a process got SIGKILL: out of host memory?)"
    return "crashed", f"{why}; log: {telling[-1][:300] if telling else '(empty)'}", {}






def run_cell(cell: Cell, cfg: dict, out: Path, timeout: float, threads: int | None = None) -> dict:
    """Launch one cell under torchrun, wait up to ``timeout`` s, and return its row."""
    cell_dir = out / "cells" / cell.key
    if cell_dir.exists():
        shutil.rmtree(cell_dir)  # a cell interrupted before it was recorded starts afresh
    cell_dir.mkdir(parents=True)
    config = {**cfg, "strategy": cell.run_strategy, "precision": cell.precision, "devices": cell.devices,
              "per_device_batch": cell.per_device_batch, "cell_dir": str(cell_dir.resolve())}
    (cell_dir / "cell.json").write_text(json.dumps(config, indent=2) + "\n")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t0 = time.monotonic()
    returncode, timed_out, omp_threads = launch_job("trainscale.bench.cell", cell_dir / "cell.json", cell.devices,
                                                    cell_dir / "log.txt", timeout, threads)
    status, reason, result = _cell_outcome(cell_dir, returncode, timed_out, timeout)
    return {**cell.as_dict(), "status": status, "reason": reason, "wall_s": time.monotonic() - t0,
            "omp_num_threads": omp_threads, "cpu_count": os.cpu_count(), "load_avg_1m": load,
            "finished_at": time.time(), **result}






def sweep(entry: str | Callable | None = None, *, devices: Sequence[int] | None = None,
          batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, strategies: Sequence[str] = ("ddp",),
          precisions: Sequence[str] = ("32-true",), scaling: str = "weak", epochs: int = 1, steps: int | None = None,
          warmup_steps: int = 5, timeout: float = 900.0, out: str | os.PathLike | None = None, resume: bool = False,
          target_accuracy: float | None = None, accelerator: str = "auto", seed: int = 0, progress: bool = True,
          plots: bool = True, predict: bool = False) -> BenchResult:
    """Run the scaling grid and write the report.

    Args:
        entry: ``"package.module:function"`` or an importable function returning the workload dict
            (see :mod:`trainscale.jobs.workload`); None: the ConvNet on MNIST-5k.
        devices: device counts (CPU: processes); default 1 and every power of two up to the GPUs, or CPU cores.
        batch_sizes: per-device (weak) or global (strong) batch sizes.
        strategies: among ``trainscale.runtime.strategies.STRATEGIES`` (not "auto"/"single").
        precisions: Lightning's precision names.
        scaling: "weak" keeps the per-device batch, "strong" keeps the global batch.
        epochs: epochs timed per cell (after warm-up); validation runs after each.
        steps: time this many optimizer steps instead of whole epochs (the epoch time is then estimated
            as step time × batches per epoch).
        warmup_steps: untimed steps run first in each cell (0: none).
        timeout: seconds per cell, launch included; the cell's process group is then killed.
        out: run directory; default ``runs/bench/version_N`` (the newest one when ``resume``).
        resume: keep the rows already in ``out/results.jsonl`` and run only the missing cells.
        target_accuracy: validation accuracy for the time-to-accuracy advice.
        accelerator: "auto", "cpu", "cuda" or "mps".
        seed: the same seed in every cell (same initial weights and data order for a given batch size).
        progress: progress lines on stderr.
        plots: write the PNG plots (needs matplotlib).
        predict: after the sweep, run ``trainscale.plan`` for the same cells (probing this machine) and add
            ``predicted_epoch_time_s``, ``predicted_peak_bytes`` and ``predicted_error`` to the rows and
            the table (:mod:`trainscale.bench.predicted`).

    Returns:
        A :class:`BenchResult`.

    Raises:
        ValueError: bad flags (before any cell runs), or a ``resume`` of a directory measured with other
            settings, or a new sweep into a directory that already holds results.
    """
    from trainscale.bench import report

    entry = entry_name(entry)
    resolve_entry(entry)  # import errors now, not once per cell
    if devices is None:
        devices = default_devices(accelerator)
    for name, value in (("epochs", epochs), ("warmup_steps", warmup_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "epochs" else 0):
            raise ValueError(f"{name}={value!r} must be an int >= {1 if name == 'epochs' else 0}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps={steps!r} must be an int >= 1 or None (whole epochs)")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    if target_accuracy is not None and not 0 < target_accuracy <= 1:
        raise ValueError(f"target_accuracy={target_accuracy!r} must be in (0, 1]")
    check_flags(TrainerConfig(seed=seed))  # the Trainer's rule, here once, not in every cell
    cells = plan(devices, batch_sizes, strategies, precisions, scaling)

    root = Path("runs/bench")
    if out is None:
        out = (_latest_dir(root) if resume else None) or next_version_dir(root)
    out = Path(out)
    settings = {"entry": entry, "scaling": scaling, "epochs": epochs, "steps": steps, "warmup_steps": warmup_steps,
                "seed": seed, "accelerator": accelerator}
    results_path = out / "results.jsonl"
    if (out / "sweep.json").is_file():
        before = json.loads((out / "sweep.json").read_text())["settings"]
        if not resume:
            raise ValueError(f"{out} already holds a sweep; pass --resume to complete it, or another --out")
        if before != settings:
            changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
            raise ValueError(f"cannot resume {out}: it was measured with other settings {changed} (before, now); "
                             "pass the same flags or another --out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(
        {"settings": settings, "devices": sorted(devices), "batch_sizes": sorted(batch_sizes),
         "strategies": list(strategies), "precisions": list(precisions)}, indent=2) + "\n")

    done = {r["key"] for r in read_rows(results_path)}
    todo = [c for c in cells if c.key not in done]
    bar = Progress(len(cells), progress)
    bar.done = len(cells) - len(todo)
    if done:
        bar.say(f"resuming {out}: {bar.done} finished cell(s) kept, {len(todo)} to run")
    cfg = {"entry": entry, "accelerator": accelerator, "epochs": epochs, "steps": steps,
           "warmup_steps": warmup_steps, "seed": seed}
    threads = threads_per_process(max(devices))
    ran = []
    for cell in todo:
        bar.say(f"running {cell.key} ({cell.devices} device(s), {cell.per_device_batch}/device)")
        row = run_cell(cell, cfg, out, timeout, threads)
        with open(results_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        ran.append(cell.key)
        bar.done += 1
        what = f"epoch {row['time_s'] / row['epochs']:.1f} s" if row["status"] == "ok" else row["reason"][:120]
        bar.say(f"{cell.key}: {row['status']} in {row['wall_s']:.1f} s ({what})")

    keys = {c.key for c in cells}
    rows = [r for r in read_rows(results_path) if r["key"] in keys]
    if predict:
        bar.say("predicting the same cells with trainscale plan --probe")
    result = report.write(out, rows, sorted(devices), sorted(batch_sizes), list(strategies), list(precisions),
                          scaling, target_accuracy, plots=plots, predict_entry=entry if predict else None)
    result.ran = ran
    return result
