"""``trainscale report RUN_DIR``: plots and a short text summary of a finished (or crashed) run.

Reads ``metrics.jsonl`` and ``summary.json`` of a run directory and writes, next to them:

- ``loss_accuracy.png`` — training loss per log interval and epoch, validation loss and accuracy;
- ``throughput.png`` — samples/s (and tokens/s) per log interval;
- ``step_phases.png`` — stacked step-phase split per log interval, and per rank;
- ``memory.png`` — peak memory per rank;
- ``gpu_utilization.png`` — NVML GPU utilisation per device, when the run had it;
- ``report.txt`` — where the time goes in per cent, throughput, MFU, memory, the slowest rank; for a run on several
  devices, the speed-up account against a ``baseline`` run directory (``trainscale report RUN --baseline RUN1``:
  :mod:`trainscale.telemetry.account`), or without one the parts of it the run measures alone.

matplotlib is imported only when plotting, with the non-interactive Agg backend. Without it
(``make demo`` does not install it) ``report.txt`` is still written and the plots are skipped;
``pip install 'trainscale[plot]'`` adds them.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

PHASES = ("data", "forward", "backward", "optimizer")
MIB = 1024 * 1024


def load_run(run_dir: str | os.PathLike) -> tuple[list[dict], dict | None]:
    """The records of ``metrics.jsonl`` and ``summary.json`` (None if absent) of a run directory.

    A torn last line (the run crashed while writing it) is skipped with a warning.

    Raises:
        ValueError: ``run_dir`` holds no metrics.jsonl (names what to pass instead), or a line
            before the last one is not JSON.
    """
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{str(run_dir)!r} has no metrics.jsonl; pass a run directory such as runs/version_0 "
                         "(the 'run dir' a Trainer prints when it starts)")
    records = _records(metrics)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    return records, summary


def _records(metrics: Path) -> list[dict]:
    lines = [(n, line) for n, line in enumerate(metrics.read_text().splitlines(), 1) if line.strip()]
    records = []
    for n, line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if n != lines[-1][0]:
                raise ValueError(f"{str(metrics)!r} line {n} is not JSON ({err.msg}): the file is damaged") from None
            warnings.warn(f"{str(metrics)!r}: skipped its torn last line {n} (the run stopped while writing "
                          f"it: a crash?): {line[:60]!r}", stacklevel=3)
    return records


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def summary_line(tele: dict) -> str:
    """One line: step time and its split, throughput, peak memory (from ``summary["telemetry"]``); a run that
    took no training step (e.g. resumed at its end) has no step time to show and says so."""
    if math.isnan(tele["step_time_s"]):
        return "telemetry: no training step in this run"
    share = tele["phase_share"]
    parts = [f"telemetry: step {tele['step_time_s'] * 1e3:.1f} ms = "
             + ", ".join(f"{p} {_pct(share[p])}" for p in PHASES)]
    if tele.get("exposed_comm_s") is not None:
        parts.append(f"exposed communication {tele['exposed_comm_s'] * 1e3:.1f} ms/step "
                     f"({_pct(tele['exposed_comm_share'])} of the step; all-reduce {tele['comm_s'] * 1e3:.1f} ms/step, "
                     "the rest hidden behind backward)")
    parts.append(f"{tele['samples_per_s']:.0f} samples/s")
    if tele.get("mfu") is not None:
        parts.append(f"MFU {_pct(tele['mfu'])}")
    peak = max(tele["peak_memory_bytes"]) / MIB
    parts.append(f"peak memory {peak:.0f} MiB ({tele['peak_memory_kind']})")
    return "; ".join(parts)


def text_summary(records: list[dict], summary: dict | None) -> str:
    """The report's text: where the time goes (per cent), throughput, FLOPs, memory, slowest rank."""
    lines = []
    tele = (summary or {}).get("telemetry")
    if summary:
        lines.append(f"run: world size {summary['world_size']}, strategy {summary['strategy']}, precision "
                     f"{summary['precision']}, {summary['steps']} steps, global batch {summary['global_batch_size']}")
        if summary.get("val_accuracy") is not None:
            losses = [f"{label} {summary[key]:.4f}" for key, label in (("train_loss", "train loss"),
                      ("val_loss", "val loss")) if summary.get(key) is not None]
            lines.append(f"final: {', '.join(losses)}{', ' if losses else ''}val accuracy {summary['val_accuracy']:.4f}")
    if not tele:
        lines.append("no telemetry summary (the run did not finish, or ran with enable_telemetry=False)")
        return "\n".join(lines) + "\n"
    share, phase_s = tele["phase_share"], tele["phase_s"]
    lines.append(f"where the time goes (mean step {tele['step_time_s'] * 1e3:.2f} ms, warm-up steps excluded):")
    from tabulate import tabulate

    phases = tabulate([(p, f"{100 * share[p]:.1f} %", f"{phase_s[p] * 1e3:.2f} ms") for p in PHASES], tablefmt="plain",
                      disable_numparse=True, colalign=("left", "right", "right"))
    lines += [f"  {line}" for line in phases.splitlines()]
    if tele.get("exposed_comm_s") is not None:
        lines.append(f"  (exposed communication {tele['exposed_comm_s'] * 1e3:.2f} ms/step, "
                     f"{_pct(tele['exposed_comm_share'])} of the step: backward's wait for the all-reduce, which "
                     f"took {tele['comm_s'] * 1e3:.2f} ms/step in all; counted inside backward)")
    line = f"throughput: {tele['samples_per_s']:.1f} samples/s ({tele['samples_per_s_per_device']:.1f} per device)"
    if tele.get("tokens_per_s") is not None:
        line += f", {tele['tokens_per_s']:.0f} tokens/s"
    lines.append(line)
    if tele.get("flops_per_sample") is not None:
        line = (f"FLOPs: {tele['flops_per_sample'] / 1e6:.2f} MFLOP/sample, achieved "
                f"{tele['achieved_flops_per_s'] / 1e9:.2f} GFLOP/s in total")
        line += f", MFU {_pct(tele['mfu'])}" if tele.get("mfu") is not None else ", MFU n/a (no peak FLOP/s known)"
        lines.append(line)
    lines.append(f"peak memory ({tele['peak_memory_kind']}): "
                 + ", ".join(f"rank {r} {b / MIB:.0f} MiB" for r, b in enumerate(tele["peak_memory_bytes"])))
    if tele.get("gpu_utilization"):
        lines.append("GPU utilisation: " + ", ".join(f"rank {r} {u:.0f} %" for r, u in
                                                     enumerate(tele["gpu_utilization"])))
    compute = _mean_lists([r["rank_compute_s"] for r in records if r.get("kind") == "step" and "rank_compute_s" in r])
    slow = tele["slowest_rank"]
    line = f"slowest rank: {slow}"
    if compute and len(compute) > 1:
        line += " (compute " + ", ".join(f"rank {r} {b * 1e3:.2f}" for r, b in enumerate(compute)) + " ms/step)"
    lines.append(line)
    stragglers = tele.get("straggler_ranks") or []
    lines.append("stragglers: " + (", ".join(f"rank {r}" for r in stragglers) if stragglers else "none"))
    return "\n".join(lines) + "\n"


def _stacked(ax, x, width, phase_s: dict[str, list[float]], comm_s: list[float], colors: dict) -> float:
    """Stacked bars in ms; the exposed communication in backward (``comm_s``, wait included) hatched on top of it."""
    bottom = [0.0] * len(x)
    for p in PHASES:
        h = [1e3 * v for v in phase_s[p]]
        if p == "backward" and any(comm_s):
            c = [min(1e3 * v, b) for v, b in zip(comm_s, h)]
            ax.bar(x, [b - v for b, v in zip(h, c)], width, bottom=bottom, label="backward", color=colors[p])
            ax.bar(x, c, width, bottom=[b + hb - v for b, hb, v in zip(bottom, h, c)], color=colors[p],
                   hatch="//", edgecolor="white", label="exposed communication (in backward, wait included)")
        else:
            ax.bar(x, h, width, bottom=bottom, label=p, color=colors[p])
        bottom = [b + v for b, v in zip(bottom, h)]
    return max(bottom, default=0.0)


def _mean_lists(rows: list[list[float]]) -> list[float]:
    rows = [r for r in rows if r]
    if not rows:
        return []
    return [sum(col) / len(col) for col in zip(*rows)]


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


PLOTS_SKIPPED = "plots skipped: matplotlib is not installed (pip install 'trainscale[plot]' adds them)"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib cannot be imported."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def account_text(summary: dict | None, baseline: dict | None) -> str:
    """The speed-up account of a run on several devices (``summary``, its summary.json) against ``baseline`` (the
    summary.json of the same job on fewer devices, normally one), scaling inferred from the global batches; without a
    baseline, the terms the run measures alone. "" for a run on one device or without telemetry.

    Raises:
        ValueError: the baseline has no telemetry, does not run on fewer devices, or trains neither the same global
            batch nor the same per-device batch.
    """
    from trainscale.telemetry.account import COMM, DATA, WAIT, account, infer_scaling, render, step_split

    tele = (summary or {}).get("telemetry")
    if baseline is not None and summary is not None and baseline["world_size"] >= summary["world_size"]:
        raise ValueError(f"the run is on {summary['world_size']} device(s), the baseline on {baseline['world_size']}: "
                         "the baseline needs fewer devices (normally one); swap the two directories?")
    if not tele or summary["world_size"] < 2 or math.isnan(tele["step_time_s"]):
        return ""
    world = summary["world_size"]
    run = step_split(tele, world, summary["global_batch_size"] // world)
    if baseline is None:
        return (f"within this run, per step: {COMM} {run.comm_s * 1e3:.1f} ms, {WAIT} {run.wait_s * 1e3:.1f} ms "
                f"(rank {run.rank} for rank {run.slowest_rank}), {DATA} {run.data_s * 1e3:.1f} ms; the account of the "
                "whole speed-up needs the same job on one device: trainscale report RUN_DIR --baseline RUN_DIR_1\n")
    if not baseline.get("telemetry"):
        raise ValueError("the baseline run has no telemetry (summary.json \"telemetry\" is null): rerun it with "
                         "enable_telemetry=True, the default")
    base_world = baseline["world_size"]
    scaling = infer_scaling(summary["global_batch_size"], world, baseline["global_batch_size"], base_world)
    base = step_split(baseline["telemetry"], base_world, baseline["global_batch_size"] // base_world)
    note = "" if tele.get("exposed_comm_s") is not None else \
        "communication was not timed (no DDP hook under this strategy): its exposed part counts as compute here"
    return "speed-up account, " + render(account(run, base, scaling, note=note),
                                         f"{world} devices against {base_world}") + "\n"


def make_report(run_dir: str | os.PathLike, baseline: str | os.PathLike | None = None) -> tuple[list[Path], str]:
    """Write report.txt and, when matplotlib is installed, the PNG plots into ``run_dir``.

    Args:
        run_dir: the run directory (metrics.jsonl, summary.json).
        baseline: the run directory of the same job on fewer devices, normally one: report.txt then holds the
            speed-up account of ``run_dir`` against it (:func:`account_text`).

    Returns:
        ``(paths of the files written, the text summary)``; without matplotlib only ``report.txt``.

    Raises:
        ValueError: no metrics.jsonl in ``run_dir`` or ``baseline``; a baseline that cannot be compared.
    """
    run_dir = Path(run_dir)
    records, summary = load_run(run_dir)
    base_summary = load_run(baseline)[1] if baseline is not None else None
    if baseline is not None and base_summary is None:
        raise ValueError(f"{str(baseline)!r} has no summary.json: the baseline run did not finish")
    text = text_summary(records, summary) + account_text(summary, base_summary) + profiler_text(run_dir)
    (run_dir / "report.txt").write_text(text)
    plt = pyplot()
    plots = write_plots(plt, run_dir, records, summary) if plt is not None else []
    return [*plots, run_dir / "report.txt"], text


def profiler_text(run_dir: Path) -> str:
    """The files ``Trainer(profiler="pytorch")`` wrote into ``run_dir``: each rank's Chrome/Perfetto trace
    (``*.pt.trace.json``, torch's suffix) and operator table (``*-ops.txt``); "" when there are none."""
    traces, tables = sorted(run_dir.glob("*.pt.trace.json")), sorted(run_dir.glob("*-ops.txt"))
    if not traces and not tables:
        return ""
    lines = ["profiler traces (open in https://ui.perfetto.dev or chrome://tracing):", *(f"  {p}" for p in traces)]
    lines += ["profiler operator tables:", *(f"  {p}" for p in tables)] if tables else []
    return "\n".join(lines) + "\n"


def write_plots(plt: Any, run_dir: Path, records: list[dict], summary: dict | None) -> list[Path]:
    """The PNG plots of a run's records, drawn with ``plt`` (:func:`pyplot`); the paths written."""
    steps = [r for r in records if r.get("kind") == "step"]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    timed = [r for r in steps if "phase_s" in r]
    written: list[Path] = []

    def save(fig, name: str) -> None:
        path = run_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    # loss and accuracy
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    pts = [(r["step"], r["train_loss"]) for r in steps if _finite(r.get("train_loss"))]
    if pts:
        ax_loss.plot(*zip(*pts), lw=1, alpha=0.7, label="train loss (log interval)")
    for key, label, style in (("train_loss", "train loss (epoch)", "o-"), ("val_loss", "val loss (epoch)", "s-")):
        pts = [(r["step"], r[key]) for r in epochs if _finite(r.get(key))]
        if pts:
            ax_loss.plot(*zip(*pts), style, label=label)
    ax_loss.set(xlabel="optimizer step", ylabel="loss", title="Loss")
    ax_loss.legend()
    pts = [(r["step"], r["val_accuracy"]) for r in epochs if _finite(r.get("val_accuracy"))]
    if pts:
        ax_acc.plot(*zip(*pts), "o-", color="tab:green")
        ax_acc.set(ylim=(0, 1))
    else:
        ax_acc.text(0.5, 0.5, "no validation accuracy in this run", ha="center", va="center",
                    transform=ax_acc.transAxes)
    ax_acc.set(xlabel="optimizer step", ylabel="accuracy", title="Validation accuracy")
    save(fig, "loss_accuracy.png")

    # throughput
    fig, ax = plt.subplots(figsize=(7, 4))
    pts = [(r["step"], r["samples_per_s"]) for r in timed if _finite(r.get("samples_per_s"))]
    if pts:
        ax.plot(*zip(*pts), "o-", label="samples/s (all devices)")
    tok = [(r["step"], r["tokens_per_s"]) for r in timed if _finite(r.get("tokens_per_s"))]
    if tok:
        ax2 = ax.twinx()
        ax2.plot(*zip(*tok), "s--", color="tab:orange", label="tokens/s")
        ax2.set_ylabel("tokens/s")
    if not pts:
        ax.text(0.5, 0.5, "no step telemetry (enable_telemetry=False?)", ha="center", va="center",
                transform=ax.transAxes)
    ax.set(xlabel="optimizer step", ylabel="samples/s", title="Throughput per log interval")
    ax.set_ylim(bottom=0)
    save(fig, "throughput.png")

    # stacked step-phase split: per interval (mean over ranks) and per rank (mean over intervals)
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    colors = {"data": "tab:red", "forward": "tab:blue", "backward": "tab:purple", "optimizer": "tab:gray"}
    if timed:
        x = [r["step"] for r in timed]
        width = 0.8 * (min(b - a for a, b in zip(x, x[1:])) if len(x) > 1 else 1)
        comm = [r["exposed_comm_s"] if _finite(r.get("exposed_comm_s")) else 0.0 for r in timed]
        top = _stacked(ax_t, x, width, {p: [r["phase_s"][p] for r in timed] for p in PHASES}, comm, colors)
        ax_t.set_ylim(0, 1.35 * top)  # room for the legend above the bars
        ax_t.legend(fontsize=8, ncol=3, loc="upper center")
        per_rank = {p: _mean_lists([r["rank_phase_s"][p] for r in timed if "rank_phase_s" in r]) for p in PHASES}
        ranks = list(range(len(per_rank["data"])))
        rank_comm = _mean_lists([r["rank_exposed_comm_s"] for r in timed if "rank_exposed_comm_s" in r]) \
            or [0.0] * len(ranks)
        _stacked(ax_r, ranks, 0.6, per_rank, rank_comm, colors)
        ax_r.set_xticks(ranks)
    ax_t.set(xlabel="optimizer step (end of log interval)", ylabel="ms per step",
             title="Where a step's time goes (mean over ranks)")
    ax_r.set(xlabel="rank", ylabel="ms per step", title="Per rank")
    save(fig, "step_phases.png")

    # memory per rank
    fig, ax = plt.subplots(figsize=(7, 4))
    mem = [r for r in timed if r.get("peak_memory_bytes")]
    kind = mem[0].get("peak_memory_kind", "") if mem else ""
    if not kind and summary and summary.get("telemetry"):
        kind = summary["telemetry"]["peak_memory_kind"]
    for rank in range(len(mem[0]["peak_memory_bytes"]) if mem else 0):
        ax.plot([r["step"] for r in mem], [r["peak_memory_bytes"][rank] / MIB for r in mem], "o-",
                label=f"rank {rank}")
    if mem:
        ax.legend()
        ax.set_ylim(bottom=0)
    ax.set(xlabel="optimizer step", ylabel="MiB",
           title=f"Peak memory per rank ({'CUDA allocated' if kind == 'cuda_allocated' else 'process RSS'})")
    save(fig, "memory.png")

    # GPU utilisation, when NVML sampled it
    gpu = [r for r in timed if r.get("gpu_utilization")]
    if gpu:
        fig, ax = plt.subplots(figsize=(7, 4))
        for rank in range(len(gpu[0]["gpu_utilization"])):
            ax.plot([r["step"] for r in gpu], [r["gpu_utilization"][rank] for r in gpu], "o-", label=f"rank {rank}")
        ax.set(xlabel="optimizer step", ylabel="%", ylim=(0, 100), title="GPU utilisation (NVML)")
        ax.legend()
        save(fig, "gpu_utilization.png")
    return written
