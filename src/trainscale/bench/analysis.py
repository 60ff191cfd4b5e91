"""Pure arithmetic on result rows: epoch time, gain, scaling efficiency, bottleneck shares, the table.

A row is a dict as written to ``results.jsonl`` (see :mod:`trainscale.bench.runner`). Nothing here
imports torch.

- epoch time (s): measured (training time ÷ epochs) when whole epochs ran, else estimated as
  step time × batches per epoch (``--steps N``), flagged ``epoch_time_estimated``.
- gain = epoch time of the baseline ÷ epoch time of the cell, where the baseline is the cell with the
  fewest devices of the grid (normally 1) at the same batch-size column, strategy and precision. Both
  cells process the same epoch of data, so the gain is the speed-up of an epoch.
- scaling efficiency = gain ÷ (devices ÷ baseline devices): 1.0 is perfect linear scaling.
- the speed-up account of a cell (:func:`cell_account`): its step against its baseline's, the gap split into
  terms that add up (:mod:`trainscale.telemetry.account`), per-step fixed overhead and compute slowdown separated by
  fits over the batch sizes of the grid.
"""

from __future__ import annotations

from typing import Iterable

from trainscale.jobs.format import fmt_time, text_table
from trainscale.telemetry.account import Account, account, fit_compute, render, step_split


def epoch_time(row: dict) -> tuple[float | None, bool]:
    """``(epoch time in seconds, estimated?)`` of an ``ok`` row; ``(None, False)`` otherwise."""
    if row.get("status") != "ok" or not row.get("steps"):
        return None, False
    if row.get("full_epochs"):
        return row["time_s"] / row["epochs"], False
    return row["step_time_s"] * row["batches_per_epoch"], True


def group_key(row: dict) -> tuple[str, str]:
    """``(strategy, precision)``: the table a row belongs to (1-device rows belong to every strategy)."""
    return row["strategy"], row["precision"]


def add_scaling(rows: list[dict], devices: Iterable[int]) -> list[dict]:
    """Return copies of ``rows`` with ``epoch_time_s``, ``epoch_time_estimated``, ``baseline_devices``,
    ``gain`` and ``efficiency`` (None where a time is missing).

    Args:
        rows: result rows; 1-device rows carry ``strategy`` "single" and serve every strategy's table.
        devices: the device counts of the grid; the smallest is the baseline.
    """
    base_devices = min(devices)
    out = [dict(r) for r in rows]
    for r in out:
        r["epoch_time_s"], r["epoch_time_estimated"] = epoch_time(r)
    for r in out:
        r["baseline_devices"] = base_devices
        base = find(out, r["strategy"], r["precision"], base_devices, r["batch_size"])
        t, t0 = r["epoch_time_s"], base["epoch_time_s"] if base else None
        if t and t0:
            r["gain"] = t0 / t
            r["efficiency"] = r["gain"] / (r["devices"] / base_devices)
        else:
            r["gain"] = r["efficiency"] = None
    for r in out:
        acc = cell_account(r, out)
        r["account"] = acc.as_dict() if acc is not None else None
    return out


def _timed(row: dict | None) -> bool:
    return row is not None and row.get("status") == "ok" and bool((row.get("telemetry") or {}).get("phase_s"))


def _split(row: dict):
    return step_split(row["telemetry"], row["devices"], row["per_device_batch"])


def cell_account(row: dict, rows: list[dict]) -> Account | None:
    """The speed-up account of a cell on more devices than its baseline (fewest devices, same batch column), when
    both recorded telemetry; per-step fixed overhead and compute slowdown are separated when the grid timed at
    least two batch sizes on both device counts (:func:`trainscale.telemetry.account.fit_compute`). None
    otherwise. ``rows`` must carry ``baseline_devices`` (:func:`add_scaling`)."""
    base_devices = row.get("baseline_devices", 1)
    base = find(rows, row["strategy"], row["precision"], base_devices, row["batch_size"])
    if not (_timed(row) and _timed(base)) or row["devices"] <= base_devices:
        return None
    mine = [_split(r) for r in rows if _timed(r) and r["devices"] == row["devices"]
            and r["run_strategy"] == row["run_strategy"] and r["precision"] == row["precision"]]
    theirs = [_split(r) for r in rows if _timed(r) and find(rows, row["strategy"], row["precision"], base_devices,
                                                           r["batch_size"]) is r]
    fits = fit_compute(mine), fit_compute(theirs)
    return account(_split(row), _split(base), row.get("scaling", "weak"), fits if None not in fits else None)


def accounts_text(rows: list[dict], detail: bool = False) -> str:
    """Every cell's account (:func:`cell_account`) as text stacked bars, one block per cell; "" when none."""
    blocks = []
    for r in sorted(rows, key=lambda r: (r["strategy"], r["precision"], r["batch_size"], r["devices"])):
        acc = cell_account(r, rows)
        if acc is not None:
            blocks.append(render(acc, f"{r['run_strategy']} · {r['precision']} · bs {r['batch_size']} on "
                                      f"{r['devices']} devices", detail))
    return "\n".join(blocks)


def find(rows: list[dict], strategy: str, precision: str, devices: int, batch_size: int) -> dict | None:
    """The row of one cell of a table: ``strategy`` is the table's; a 1-device row (run with the
    "single" strategy) matches any strategy."""
    for r in rows:
        if (r["precision"] == precision and r["devices"] == devices and r["batch_size"] == batch_size
                and (r["strategy"] == strategy or (devices == 1 and r["run_strategy"] == "single"))):
            return r
    return None


def shares(row: dict) -> dict:
    """The measurements that explain a cell, from telemetry when present, else from the cell's probes.

    Returns a dict with ``step_time_s``, ``comm_s``, ``comm_share``, ``data_s``, ``data_share``
    (shares are fractions of the step time; None when not measured) and ``source``
    ("telemetry", "probe" or None). ``comm_s`` is the communication the step waits for: telemetry's
    exposed communication (the all-reduce not hidden behind backward), else the probe's lone
    all-reduce, which bounds it from above.
    """
    tel = row.get("telemetry") or {}
    step = tel.get("step_time_s") or row.get("step_time_s")
    out = {"step_time_s": step, "comm_s": None, "comm_share": None, "data_s": None, "data_share": None,
           "source": None}
    if tel:
        out["source"] = "telemetry"
        if tel.get("exposed_comm_s") is not None and step:
            out["comm_s"], out["comm_share"] = tel["exposed_comm_s"], tel["exposed_comm_s"] / step
        phase_s, phase_share = tel.get("phase_s") or {}, tel.get("phase_share") or {}
        if phase_share.get("data") is not None:
            out["data_share"] = phase_share["data"]
            out["data_s"] = phase_s.get("data", phase_share["data"] * step if step else None)
    if out["comm_share"] is None and row.get("probe_allreduce_s") is not None and step:
        out["comm_s"], out["comm_share"] = row["probe_allreduce_s"], row["probe_allreduce_s"] / step
        out["source"] = out["source"] or "probe"
    if out["data_share"] is None and row.get("probe_data_s") is not None and step:
        out["data_s"], out["data_share"] = row["probe_data_s"], row["probe_data_s"] / step
        out["source"] = out["source"] or "probe"
    return out


def _cell(row: dict | None, what: str) -> str:
    if row is None:
        return "—"
    if row.get("status") != "ok":
        return row.get("status", "?").upper()
    if what == "batches":
        return str(row["batches_per_epoch"])
    if what == "time":
        return ("~" if row.get("epoch_time_estimated") else "") + fmt_time(row.get("epoch_time_s"))
    if what == "predicted_epoch_time_s":
        return fmt_time(row.get(what))
    value = row.get(what)
    if value is None:
        return "—"
    if what == "predicted_error":
        return f"{value:+.0%}"
    if what == "tokens_per_s":
        return f"{value:,.0f}"
    return f"{value:.2f}×" if what == "gain" else f"{value:.2f}"


def _flops_per_token(rows: list[dict]) -> str:
    """The workload's FLOPs per token (the same in every cell), for a table's title; "" when unknown."""
    values = {r["flops_per_token"] for r in rows if r.get("flops_per_token")}
    return f"; FLOPs/token {min(values):.3g}" if len(values) == 1 else ""


def table(rows: list[dict], devices: list[int], batch_sizes: list[int], strategy: str, precision: str,
          scaling: str = "weak") -> str:
    """The classic table for one strategy and precision: bs | batches/epoch per device count |
    epoch time (mm:ss.s) per device count | gain | efficiency (one column per device count above the
    baseline); for a language-model workload (cells that counted tokens) tokens/s per device count, with
    the FLOPs per token in the title; when the rows carry predictions (``bench --plan``) the predicted
    epoch and its error per device count. ``rows`` must have been through :func:`add_scaling`. "~" marks
    an epoch time estimated from ``--steps``; OOM/TIMEOUT/FAILED/CRASHED mark failed cells."""
    devices = sorted(devices)
    more = [d for d in devices if d != devices[0]]
    cells = {bs: {d: find(rows, strategy, precision, d, bs) for d in devices} for bs in batch_sizes}
    mine = [c for by_device in cells.values() for c in by_device.values() if c is not None]
    tokens = devices if any(c.get("tokens_per_s") for c in mine) else []
    predicted = devices if any("predicted_epoch_time_s" in c for c in mine) else []
    # (column name, cell value, device counts) per group of columns
    groups = [("batches/ep", "batches", devices), ("epoch", "time", devices), ("gain", "gain", more),
              ("eff", "efficiency", more), ("tok/s", "tokens_per_s", tokens),
              ("plan", "predicted_epoch_time_s", predicted), ("err", "predicted_error", predicted)]
    bs_name = "bs/device" if scaling == "weak" else "global bs"
    head = [bs_name] + [f"{name} {d}d" for name, _, ds in groups for d in ds]
    body = [[str(bs)] + [_cell(cells[bs][d], what) for _, what, ds in groups for d in ds] for bs in batch_sizes]
    title = f"{strategy} · {precision} · {scaling} scaling (epoch time mm:ss.s; gain = epoch time on " \
            f"{devices[0]} device{'s' if devices[0] > 1 else ''} ÷ epoch time; efficiency = gain ÷ device ratio" \
            f"{'; tok/s: tokens per second over the data-parallel ranks' if tokens else ''}{_flops_per_token(mine)}" \
            + ("; plan = trainscale plan's predicted epoch, err = plan ÷ measured − 1)" if predicted else ")")
    return f"{title}\n{text_table(head, body)}"
