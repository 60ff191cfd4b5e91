"""``trainscale bench --plan``: the plan's predictions beside the sweep's measurements.

For every precision of the grid, :func:`trainscale.plan.plan` runs once for the same workload, device
counts, per-device batch sizes and strategies (with ``probe=True`` when the grid has several devices:
the link, and a short 2-process DDP run of the workload through the Trainer, whose step the 2-device ddp
cells take and whose measured overlap of communication and backward the other cells use), and each
measured row gets

- ``predicted_epoch_time_s``: the plan's epoch time for that cell (s);
- ``predicted_peak_bytes``: the plan's peak memory per device (bytes of live tensors; the measured
  ``peak_memory_bytes`` is CUDA's max allocated, or the process's peak RSS on a CPU, which also counts
  the interpreter and libraries);
- ``predicted_error``: predicted ÷ measured epoch time − 1 (e.g. -0.12: 12 % too fast).

Cells whose strategy the plan has no time model for (tp across nodes) or cannot split (pp of a model with
fewer blocks than stages) get no prediction (the columns stay empty).
"""

from __future__ import annotations


def _key(strategy: str, devices: int, batch: int) -> tuple:
    return ("ddp" if strategy == "single" else strategy), devices, batch


def add_predictions(rows: list[dict], entry: str, devices: list[int], strategies: list[str],
                    precisions: list[str]) -> list[dict]:
    """Copies of ``rows`` (after ``analysis.add_scaling``) with the predicted columns added.

    Raises:
        ValueError: see :func:`trainscale.plan.plan`.
    """
    from trainscale.plan import planner

    modelled = [s for s in strategies if s in planner.TIMED] or ["ddp"]  # cells with a time prediction
    out = [dict(r) for r in rows]
    for precision in precisions:
        mine = [r for r in out if r["precision"] == precision and r.get("status") == "ok"]
        batches = sorted({r["per_device_batch"] for r in mine})
        if not batches:
            continue
        several = max(devices) > 1  # one device communicates nothing: any link gives the same times
        result = planner.plan(entry=entry, devices=sorted(devices), batch_sizes=batches, strategies=modelled,
                              precision=precision, probe=several, link=None if several else "1GB/s")
        by_cell = {_key(p.strategy, p.devices, p.batch_size): p for p in result.rows}
        for r in mine:
            p = by_cell.get(_key(r["run_strategy"], r["devices"], r["per_device_batch"]))
            if p is None or p.epoch_s is None:
                continue
            r["predicted_epoch_time_s"] = p.epoch_s
            r["predicted_peak_bytes"] = p.memory.peak if p.memory else None
            r["predicted_error"] = p.epoch_s / r["epoch_time_s"] - 1 if r.get("epoch_time_s") else None
    return out
