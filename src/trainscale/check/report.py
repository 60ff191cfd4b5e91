"""The text ``trainscale check`` prints: the runs, a table of the steps, the run's end, the verdict, the causes."""

from __future__ import annotations

from trainscale.check.causes import FOUND, POSSIBLE, Finding
from trainscale.check.compare import Comparison
from trainscale.jobs.format import text_table

MAX_MISMATCHES = 8  # sentences listed; the rest counted


def header(ref: dict, dist: dict, workload: str, lr_scaling: str | None, steps: int) -> str:
    n, g = dist["world_size"], dist["global_batch_size"]
    mode = (f"per-device batch fixed, lr scaled by --lr-scaling {lr_scaling} in the reference" if lr_scaling else
            "same global batch")
    return (f"trainscale check: {workload}, {dist['strategy']} × {n} against 1 device, {steps} step(s), {mode}\n"
            f"  global batch {g}: 1 × {ref['micro_batch']} (× {ref['accumulate']} accumulation) against {n} × "
            f"{dist['micro_batch']} (× {dist['accumulate']})")


def step_table(comparison: Comparison, n: int) -> str:
    """One line per step: loss, gradient norm and learning rate of each run with their relative differences; a
    step whose runs saw different samples marked."""
    head = ["step", "loss 1 dev", f"loss {n} dev", "rel", "grad 1 dev", f"grad {n} dev", "rel", "lr 1 dev",
            f"lr {n} dev", ""]
    rows = [[str(r["step"]), f"{r['loss'][0]:.7g}", f"{r['loss'][1]:.7g}", f"{r['loss_rel']:.1e}",
             f"{r['grad_norm'][0]:.6g}", f"{r['grad_norm'][1]:.6g}", f"{r['grad_norm_rel']:.1e}", f"{r['lr'][0]:.4g}",
             f"{r['lr'][1]:.4g}", "← samples differ" if r["samples_differ"] else ""] for r in comparison.rows]
    return text_table(head, rows)


def end_lines(comparison: Comparison) -> str:
    fin = comparison.finals
    values = ", ".join(f"{k} {a:.6g} / {b:.6g}" if isinstance(b, (int, float)) else f"{k} {a:.6g} / -"
                       for k, (a, b) in fin["values"].items())
    diffs = ", ".join(f"{k} {v:.1e}" for k, v in fin["differences"].items())
    return f"end (1 device / N): {values}\n  relative differences: {diffs}"


def speed(ref: dict, dist: dict) -> str:
    """Where the N-process run's speed-up went against the 1-device run: the account of their telemetry
    (:func:`trainscale.telemetry.report.account_text`; strong scaling: both runs train the same global batch, with
    ``--lr-scaling`` too), from the few steps the check times; a line saying why when there is none."""
    from trainscale.telemetry.report import account_text

    if not (ref.get("telemetry") and dist.get("telemetry")):
        return "speed-up account: none (a run recorded no telemetry)"
    text = account_text(dist, ref).rstrip("\n")
    return f"{text}\n  (timed over the run's steps after 2 warm-up steps: few steps are noisy; more --steps firm it up)"


def verdict(comparison: Comparison, findings: list[Finding]) -> str:
    tol = f"tolerance: relative {comparison.rtol:g} (float32 reduction order; docs/check.md)"
    if comparison.ok:
        return f"{tol}\nPASS: every step and the run's end agree within the tolerance"
    shown = comparison.mismatches[:MAX_MISMATCHES]
    more = len(comparison.mismatches) - len(shown)
    lines = [tol, f"FAIL: {len(comparison.mismatches)} difference(s) beyond the tolerance, the first at step "
                  f"{comparison.first_step}" if comparison.first_step is not None else
             f"FAIL: {len(comparison.mismatches)} difference(s) beyond the tolerance at the run's end"]
    lines += [f"  - {m}" for m in shown] + ([f"  ... and {more} more"] if more else [])
    found = [f for f in findings if f.status == FOUND]
    lines.append("cause(s) found:" if found else "no cause found among the usual ones; check them in this order:")
    primary = found or [f for f in findings if f.status == POSSIBLE] or findings
    for f in primary:
        lines.append(f"  * {f.cause}: {f.evidence}\n    fix: {f.fix}")
    rest = [f for f in findings if f not in primary]
    if rest:
        lines.append("other usual causes:")
        lines += [f"  - {f.cause} ({f.status}): {f.evidence}" for f in rest]
    return "\n".join(lines)
