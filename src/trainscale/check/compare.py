"""Pure comparison of two ``trainscale check`` traces (the 1-device reference and the N-process run).

A trace is what :mod:`trainscale.check.worker` writes. Per optimizer step s the run's loss is the mean over
ranks of each rank's mean micro-batch loss (what the averaged gradient of DDP/FSDP is the gradient of); the
reference has one rank. Compared step by step: that loss, the total gradient norm, the learning rate
``step()`` read, and the checksum of the global batch's inputs; after the run: the weights' norm, the
validation metrics, and the buffers and eval-mode outputs of each rank (against each other and against the
reference's). Differences are relative: ``|a − b| / max(|a|, |b|)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# float32 runs: summing the same terms in another order (one process over the global batch against N
# partial sums all-reduced) changes a float32 result by a few units of float32's epsilon 1.19e-7 per
# operation; over 20 AdamW steps of the built-in ConvNet the losses, gradient norms, weights and eval outputs
# of 1 and 2 processes (ddp and fsdp) differed by at most 3.7e-7 relative (docs/check.md). 1e-4 leaves a
# margin of ~250× and is ~10× below the smallest first-step difference of the planted bugs (1.1e-3).
RTOL = {"32-true": 1e-4}
LR_RTOL = 1e-9  # learning rates are the same float arithmetic in both runs: equal to rounding
CHECKSUM_RTOL = 1e-9  # float64 sums of the same values in another order


def rel(a: float | None, b: float | None) -> float:
    """``|a − b| / max(|a|, |b|)`` (0 when both are 0; inf when one is missing or not finite)."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if a == b else math.inf
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0


def max_rel(xs: list[float] | None, ys: list[float] | None) -> float:
    """Largest elementwise difference of two vectors relative to the largest magnitude among them."""
    if xs is None or ys is None:
        return 0.0 if xs == ys else math.inf
    if len(xs) != len(ys):
        return math.inf
    scale = max([abs(v) for v in xs + ys] + [0.0])
    return max((abs(x - y) for x, y in zip(xs, ys)), default=0.0) / scale if scale else 0.0


@dataclass
class StepView:
    """One run's numbers per optimizer step (from its trace)."""

    loss: list[float]
    weighted_loss: list[float | None]  # rank losses weighted by their non-ignored targets
    targets: list[list[int | None]]  # per step, per rank
    rank_loss: list[list[float]]  # per step, per rank
    checksum: list[float]
    grad_norm: list[float]
    lr: list[float]


def step_view(trace: dict) -> StepView:
    """Group each rank's micro-batches into optimizer steps (``accumulate`` per step)."""
    a = trace["accumulate"]
    n = min(len(trace["steps"]), min(len(m) for m in trace["micro"]) // a)
    view = StepView([], [], [], [], [], [], [])
    for s in range(n):
        per_rank = [micro[s * a:(s + 1) * a] for micro in trace["micro"]]
        losses = [sum(m[0] for m in ms) / a for ms in per_rank]
        counts = [None if any(m[2] is None for m in ms) else sum(m[2] for m in ms) for ms in per_rank]
        view.rank_loss.append(losses)
        view.loss.append(sum(losses) / len(losses))
        view.targets.append(counts)
        weighted = [m[0] * m[2] for ms in per_rank for m in ms] if None not in counts else None
        total = sum(counts) if None not in counts else 0
        view.weighted_loss.append(sum(weighted) / total if weighted is not None and total else None)
        view.checksum.append(sum(m[3] for ms in per_rank for m in ms))
        view.grad_norm.append(trace["steps"][s]["grad_norm"])
        view.lr.append(trace["steps"][s]["lr"][0])
    return view


@dataclass
class Comparison:
    """Every difference found, by kind; ``ok`` when there is none."""

    rtol: float
    rows: list[dict] = field(default_factory=list)  # per step: both runs' loss, grad norm, lr, and differences
    mismatches: list[str] = field(default_factory=list)  # one sentence each
    first_step: int | None = None  # the first step that differs
    finals: dict = field(default_factory=dict)  # weights, val metrics, buffers, probes: the largest differences

    @property
    def ok(self) -> bool:
        return not self.mismatches


def compare_steps(ref: StepView, dist: StepView, rtol: float, out: Comparison) -> None:
    """Fill ``out.rows`` and note the steps whose loss, gradient norm, lr or samples differ."""
    for s in range(min(len(ref.loss), len(dist.loss))):
        row = {"step": s, "loss": (ref.loss[s], dist.loss[s]), "grad_norm": (ref.grad_norm[s], dist.grad_norm[s]),
               "lr": (ref.lr[s], dist.lr[s]), "loss_rel": rel(ref.loss[s], dist.loss[s]),
               "grad_norm_rel": rel(ref.grad_norm[s], dist.grad_norm[s]), "lr_rel": rel(ref.lr[s], dist.lr[s]),
               "samples_differ": rel(ref.checksum[s], dist.checksum[s]) > CHECKSUM_RTOL}
        out.rows.append(row)
        bad = [name for name, limit in (("loss", rtol), ("grad_norm", rtol), ("lr", LR_RTOL))
               if row[f"{name}_rel"] > limit] + (["samples"] if row["samples_differ"] else [])
        if bad and out.first_step is None:
            out.first_step = s
        for name in bad:
            out.mismatches.append(_step_sentence(name, row))


def _step_sentence(name: str, row: dict) -> str:
    s = row["step"]
    if name == "samples":
        return f"step {s}: the global batch holds other samples (input checksums differ)"
    a, b = row[name]
    return f"step {s}: {name.replace('_', ' ')} {a:.7g} (1 device) vs {b:.7g}, relative difference {row[name + '_rel']:.2g}"


def _rank_spread(ranks: list[dict], key: str) -> float:
    """The largest difference between rank 0's ``key`` and any other rank's."""
    first = ranks[0][key]
    if key == "probe":
        return max((max_rel(first, r[key]) for r in ranks[1:]), default=0.0)
    return max((max_rel(first.get(name), r[key].get(name)) for r in ranks[1:] for name in first), default=0.0)


def compare_finals(ref: dict, dist: dict, rtol: float, out: Comparison) -> None:
    """The run's end: weights, validation metrics, and per-rank buffers and eval outputs."""
    rf, df = ref["final"], dist["final"]
    val_ref = {k: v for k, v in (ref["history"] or [{}])[-1].items() if k.startswith("val_")}
    val_dist = {k: v for k, v in (dist["history"] or [{}])[-1].items() if k.startswith("val_")}
    buffers = rf["ranks"][0]["buffers"]
    finals = {"weights": rel(rf["weights_norm"], df["weights_norm"]),
              "buffers_vs_reference": max((max_rel(buffers[n], df["ranks"][0]["buffers"].get(n)) for n in buffers),
                                          default=0.0),
              "buffers_across_ranks": _rank_spread(df["ranks"], "buffers"),
              "probe_vs_reference": max_rel(rf["ranks"][0]["probe"], df["ranks"][0]["probe"]),
              "probe_across_ranks": _rank_spread(df["ranks"], "probe"),
              **{f"{k}": rel(v, val_dist.get(k)) for k, v in val_ref.items()}}
    out.finals = {"values": {"weights_norm": (rf["weights_norm"], df["weights_norm"]),
                             **{k: (v, val_dist.get(k)) for k, v in val_ref.items()}}, "differences": finals}
    words = {"weights": "the weights' norm after the last step", "buffers_vs_reference": "buffers against the reference",
             "buffers_across_ranks": "buffers across ranks", "probe_vs_reference": "eval outputs against the reference",
             "probe_across_ranks": "eval outputs across ranks"}
    for key, value in finals.items():
        if value > rtol:
            out.mismatches.append(f"end: {words.get(key, key)} differ, relative difference {value:.2g}")


def compare(ref: dict, dist: dict, rtol: float) -> tuple[Comparison, StepView, StepView]:
    """Compare two traces: every step, then the run's end."""
    out = Comparison(rtol)
    ref_view, dist_view = step_view(ref), step_view(dist)
    compare_steps(ref_view, dist_view, rtol, out)
    compare_finals(ref, dist, rtol, out)
    return out, ref_view, dist_view
