"""The sweep's files: results.json, results.csv, report.md and PNG plots (matplotlib, imported lazily, Agg).

- ``results.json``: one object per cell with every measured field (telemetry nested) plus
  ``epoch_time_s``, ``gain``, ``efficiency`` (and with ``--plan`` ``predicted_epoch_time_s``,
  ``predicted_peak_bytes``, ``predicted_error``).
- ``results.csv``: the same rows flattened (``telemetry.phase_share.data``, ...; lists as JSON).
- ``scaling.png``: gain and scaling efficiency against batch size, one line per device count.
- ``phases.png``: the step-phase split (data, forward, backward, optimizer) of each cell, when the
  cells recorded telemetry.
- ``account.png``: each multi-device cell's step as the ideal plus the terms of its speed-up account
  (:func:`trainscale.bench.analysis.cell_account`), when it and its baseline recorded telemetry; report.md holds
  the same accounts as text.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from trainscale.bench import analysis
from trainscale.bench.advice import advise

PHASES = ("data", "forward", "backward", "optimizer")


def _flatten(row: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in row.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        elif isinstance(v, list):
            flat[prefix + k] = json.dumps(v)
        else:
            flat[prefix + k] = v
    return flat


def write_csv(path: Path, rows: list[dict]) -> None:
    flat = [_flatten(r) for r in rows]
    columns: list[str] = []
    for r in flat:
        columns += [k for k in r if k not in columns]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(flat)


def _groups(strategies: list[str], precisions: list[str]) -> list[tuple[str, str]]:
    return [(s, p) for p in precisions for s in strategies]


def plot_scaling(path: Path, rows: list[dict], devices: list[int], batch_sizes: list[int],
                 strategies: list[str], precisions: list[str]) -> bool:
    """Gain and efficiency against batch size (log2 axis), one line per strategy/precision/device count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    more = [d for d in devices if d != devices[0]]
    if not more:
        return False
    fig, (ax_gain, ax_eff) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s, p in _groups(strategies, precisions):
        for d in more:
            pts = [(b, r) for b in batch_sizes if (r := analysis.find(rows, s, p, d, b)) and r.get("gain") is not None]
            if not pts:
                continue
            name = f"{d} devices, {s}, {p}"
            ax_gain.plot([b for b, _ in pts], [r["gain"] for _, r in pts], marker="o", label=name)
            ax_eff.plot([b for b, _ in pts], [r["efficiency"] for _, r in pts], marker="o", label=name)
    for ax, what, ideal in ((ax_gain, "gain (epoch time ratio)", None), (ax_eff, "scaling efficiency", 1.0)):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size" + (" per device" if rows and rows[0].get("scaling") == "weak" else " (global)"))
        ax.set_ylabel(what)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
    ax_gain.set_title(f"gain over {devices[0]} device(s)")
    ax_eff.set_title("efficiency = gain ÷ device ratio (1 = linear)")
    ax_eff.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_phases(path: Path, rows: list[dict]) -> bool:
    """Stacked bars of seconds per step in each phase for every cell with telemetry ``phase_s``."""
    have = [r for r in rows if r.get("status") == "ok" and (r.get("telemetry") or {}).get("phase_s")]
    if not have:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    have.sort(key=lambda r: (r["precision"], r["batch_size"], r["devices"], r["run_strategy"]))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(have) + 3.5), 4.2))
    x = range(len(have))
    bottom = [0.0] * len(have)
    for phase in PHASES:
        ms = [1e3 * ((r["telemetry"]["phase_s"] or {}).get(phase) or 0.0) for r in have]
        ax.bar(x, ms, bottom=bottom, label=phase)
        bottom = [b + m for b, m in zip(bottom, ms)]
    # The exposed communication (DDP's all-reduce not hidden behind backward: the wait at its end) is part of
    # backward: drawn hatched over the end of the backward segment.
    comm = [(i, 1e3 * r["telemetry"]["exposed_comm_s"], 1e3 * sum((r["telemetry"]["phase_s"] or {}).get(p) or 0.0
                                                                 for p in ("data", "forward", "backward")))
            for i, r in enumerate(have) if r["telemetry"].get("exposed_comm_s")]
    if comm:
        ax.bar([i for i, _, _ in comm], [c for _, c, _ in comm], bottom=[top - c for _, c, top in comm], fill=False,
               hatch="///", edgecolor="black", linewidth=0.5, label="exposed communication (part of backward)")
    _save_cells(plt, fig, ax, path, "step-phase split per cell",
                [f"{r['devices']}d bs{r['batch_size']}" + ("" if len({h['precision'] for h in have}) == 1
                 else f" {r['precision']}") for r in have])
    return True


def _save_cells(plt, fig, ax, path: Path, title: str, labels: list[str], ylabel: str = "ms per step") -> None:
    """A per-cell bar chart's labels, axis, legend and file."""
    ax.set_xticks(list(range(len(labels))), labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_account(path: Path, rows: list[dict]) -> bool:
    """Stacked bars, one per cell with an account, in per cent of the cell's measured step (so cells of any step
    time compare): the ideal step (the efficiency), then each term that cost time; terms below zero (faster than
    ideal) are not drawn."""
    from trainscale.telemetry.account import RESIDUAL

    cells = [(r, acc) for r in rows if (acc := analysis.cell_account(r, rows)) is not None]
    if not cells:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells.sort(key=lambda c: (c[0]["precision"], c[0]["run_strategy"], c[0]["batch_size"], c[0]["devices"]))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(cells) + 4.0), 4.2))
    x = range(len(cells))
    ax.bar(x, [100 * acc.efficiency for _, acc in cells], color="lightgrey", label="ideal (the efficiency)")
    bottom = [100 * acc.efficiency for _, acc in cells]
    for name in [t.name for t in cells[0][1].terms]:
        ms = [100 * max(0.0, acc.term(name).seconds) / acc.measured_s if acc.term(name) else 0.0 for _, acc in cells]
        if any(ms):
            ax.bar(x, ms, bottom=bottom, label=name, hatch="//" if name == RESIDUAL else None)
            bottom = [b + m for b, m in zip(bottom, ms)]
    _save_cells(plt, fig, ax, path, "where the speed-up went", [f"{r['devices']}d bs{r['batch_size']} "
                                                              f"{r['run_strategy']}" for r, _ in cells],
                "% of the measured step")
    return True


def cell_table(rows: list[dict]) -> list[str]:
    """A markdown table with one line per cell: status, epoch time, samples/s, gain, efficiency, peak
    memory (largest rank, MiB), validation accuracy, exposed communication (the all-reduce a step waits for) and
    data shares of a step."""
    def num(v, f):
        return "—" if v is None else format(v, f)

    lines = ["| cell | status | epoch | samples/s | gain | eff | peak mem (MiB) | val acc | exposed comm | data |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["precision"], r["devices"], r["run_strategy"], r["batch_size"])):
        sh = analysis.shares(r) if r.get("status") == "ok" else {}
        peak = max(r["peak_memory_bytes"]) / 2**20 if r.get("peak_memory_bytes") else None
        lines.append(f"| {r.get('key', '?')} | {r.get('status')} | {analysis.fmt_time(r.get('epoch_time_s'))} | "
                     f"{num(r.get('samples_per_s'), ',.0f')} | {num(r.get('gain'), '.2f')} | "
                     f"{num(r.get('efficiency'), '.2f')} | {num(peak, ',.0f')} | {num(r.get('val_accuracy'), '.4f')} | "
                     f"{num(sh.get('comm_share'), '.0%')} | {num(sh.get('data_share'), '.0%')} |")
    return lines


def write(out: Path, rows: list[dict], devices: list[int], batch_sizes: list[int], strategies: list[str],
          precisions: list[str], scaling: str, target_accuracy: float | None, plots: bool = True,
          predict_entry: str | None = None):
    """Compute gain/efficiency and advice (and, with ``predict_entry``, the plan's predictions: see
    :mod:`trainscale.bench.predicted`); write every file; return a ``BenchResult``."""
    from trainscale.bench.runner import BenchResult

    rows = analysis.add_scaling(rows, devices)
    if predict_entry is not None:
        from trainscale.bench.predicted import add_predictions

        rows = add_predictions(rows, predict_entry, devices, strategies, precisions)
    tables = "\n\n".join(analysis.table(rows, devices, batch_sizes, s, p, scaling) for s, p in _groups(strategies, precisions))
    advice = advise(rows, target_accuracy)
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    write_csv(out / "results.csv", rows)
    pngs = []
    if plots:
        try:
            drawn = {"scaling.png": plot_scaling(out / "scaling.png", rows, devices, batch_sizes, strategies, precisions),
                     "phases.png": plot_phases(out / "phases.png", rows),
                     "account.png": plot_account(out / "account.png", rows)}
            pngs = [name for name, done in drawn.items() if done]
        except ImportError:
            advice.append("Plots skipped: matplotlib is not installed (pip install 'trainscale[plot]').")
    settings = json.loads((out / "sweep.json").read_text())["settings"] if (out / "sweep.json").is_file() else {}
    ok = [r for r in rows if r.get("status") == "ok"]
    env = f"torch {ok[0].get('torch_version')}, device {ok[0].get('device')}." if ok else ""
    md = ["# trainscale bench", "", f"Settings: `{json.dumps(settings)}`; {len(rows)} cells, {len(ok)} ok. {env}", ""]
    md += ["```text", tables, "```", "", "## Advice", ""] + [f"- {a}" for a in advice] + [""]
    accounts = analysis.accounts_text(rows, detail=True)
    if accounts:
        md += ["## Where the speed-up went", "", "Per step, against the ideal (docs/bench.md, \"Where the speed-up "
               "went\"); `=` is the ideal step, each letter a term of the gap.", "", "```text", accounts, "```", ""]
    md += ["## Cells", "", *cell_table(rows), ""]
    if "phases.png" not in pngs:
        md += ["No step-phase plot: no cell recorded telemetry (`summary.json` \"telemetry\").", ""]
    md += [f"![{p}]({p})" for p in pngs]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return BenchResult(out=out, rows=rows, tables=tables, advice=advice,
                       accounts=analysis.accounts_text(rows, detail=False))
