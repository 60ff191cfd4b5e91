"""The usual causes of a mismatch between 1 and N devices, each with what the traces say about it.

Every function looks at the two traces (and their :class:`~trainscale.check.compare.StepView`) and returns a
:class:`Finding`: ``"found"`` when the traces show this cause at work (the evidence names the numbers),
``"possible"`` when its precondition holds but the traces cannot confirm it, ``"not seen"`` otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from trainscale.check.compare import Comparison, StepView, rel

FOUND, POSSIBLE, NOT_SEEN = "found", "possible", "not seen"


@dataclass(frozen=True)
class Finding:
    """One cause: its name, status, the evidence (numbers from the runs) and the fix."""

    cause: str
    status: str
    evidence: str
    fix: str

    def as_dict(self) -> dict:
        return {"cause": self.cause, "status": self.status, "evidence": self.evidence, "fix": self.fix}


@dataclass(frozen=True)
class Context:
    """What the causes look at."""

    ref: dict
    dist: dict
    ref_view: StepView
    dist_view: StepView
    comparison: Comparison
    lr_scaling: str | None  # the rule --lr-scaling expects (None: same global batch, no expectation)


def batchnorm(ctx: Context) -> Finding:
    """BatchNorm whose statistics are per rank: the forward differs from step 0, and the running statistics
    (what evaluation uses) differ across ranks and from the reference."""
    name = "unsynchronised BatchNorm"
    facts, fin = ctx.dist["model"], ctx.comparison.finals["differences"]
    fix = ("Trainer(sync_batchnorm=True) (SyncBatchNorm: CUDA only in torch), or GroupNorm/LayerNorm, which "
           "need no batch statistics")
    unsynced = facts["batchnorm"] - facts["sync_batchnorm"]
    if unsynced <= 0:
        return Finding(name, NOT_SEEN, f"{facts['batchnorm']} BatchNorm module(s), none unsynchronised", fix)
    rtol = ctx.comparison.rtol
    signs = [f"step 0 loss differs by {ctx.comparison.rows[0]['loss_rel']:.2g}" if ctx.comparison.rows and
             ctx.comparison.rows[0]["loss_rel"] > rtol else None,
             f"after {len(ctx.comparison.rows)} steps the ranks' running statistics differ by "
             f"{fin['buffers_across_ranks']:.2g}" if fin["buffers_across_ranks"] > rtol else None,
             f"eval outputs on the same samples differ across ranks by {fin['probe_across_ranks']:.2g} and from "
             f"the reference by {fin['probe_vs_reference']:.2g}" if fin["probe_across_ranks"] > rtol
             or fin["probe_vs_reference"] > rtol else None]
    signs = [s for s in signs if s]
    micro, ref_micro = ctx.dist["micro_batch"], ctx.ref["micro_batch"]
    evidence = (f"{unsynced} BatchNorm module(s) without SyncBatchNorm: each rank normalises over its own {micro} "
                f"samples, the 1-device run over {ref_micro}, and each rank keeps its own running statistics for "
                "evaluation" + (f"; {'; '.join(signs)}" if signs else ""))
    return Finding(name, FOUND if signs else POSSIBLE, evidence, fix)


def loss_normalisation(ctx: Context) -> Finding:
    """A loss averaged per rank over uneven counts of non-ignored targets: the mean of the rank losses is not
    the global mean, and the rank losses weighted by their counts give back the reference's loss."""
    name = "loss normalised per rank instead of per global token count"
    fix = ("sum the per-token losses and divide by the global count: loss = F.cross_entropy(logits, y, "
           "ignore_index=-100, reduction='sum') * world_size / n, with n the non-ignored targets all-reduced over "
           "ranks (DDP averages the ranks' gradients); or give every rank the same number of targets")
    view, rtol = ctx.dist_view, ctx.comparison.rtol
    for s, counts in enumerate(view.targets):
        if None in counts or len(set(counts)) < 2:
            continue
        plain, weighted = rel(ctx.ref_view.loss[s], view.loss[s]), rel(ctx.ref_view.loss[s], view.weighted_loss[s])
        evidence = (f"step {s}: the ranks' non-ignored targets (ignore_index -100) are {counts}; their losses "
                    f"{[round(v, 6) for v in view.rank_loss[s]]} average to {view.loss[s]:.7g}, the 1-device loss is "
                    f"{ctx.ref_view.loss[s]:.7g}, and the losses weighted by the target counts give {view.weighted_loss[s]:.7g}")
        if plain > rtol and weighted <= rtol:
            return Finding(name, FOUND, evidence + " (the reference's: the loss is a per-rank mean)", fix)
        return Finding(name, POSSIBLE, evidence, fix)
    return Finding(name, NOT_SEEN, "every rank had the same number of non-ignored targets (or the targets are "
                                   "not integer class indices)", fix)


def learning_rate(ctx: Context) -> Finding:
    """The lr ``step()`` read differs: with ``--lr-scaling``, the job did not scale it as the rule says."""
    name = "LR not scaled to the global batch"
    dist, ref = ctx.dist, ctx.ref
    rows = [r for r in ctx.comparison.rows if r["lr_rel"] > 0]
    job = dist["trainer"]
    if ctx.lr_scaling is not None:
        fix = (f"train with Trainer(lr_scaling={ctx.lr_scaling!r}, base_batch_size={ref['trainer']['base_batch_size']}) "
               "(in an --entry workload: its 'trainer' dict)")
    else:
        fix = "set the lr from the global batch size (Trainer(lr_scaling=..., base_batch_size=...)), not from the world size"
    if not rows:
        return Finding(name, NOT_SEEN, "both runs stepped with the same learning rates", fix)
    r = rows[0]
    evidence = (f"step {r['step']}: the {dist['world_size']}-process run stepped with lr {r['lr'][1]:.6g}, the "
                f"1-device reference with {r['lr'][0]:.6g} (× {r['lr'][1] / r['lr'][0]:.4g})")
    if ctx.lr_scaling is not None:
        evidence += (f"; --lr-scaling {ctx.lr_scaling} expects × {ref['lr_scale_factor']:.4g} of the lr tuned at batch "
                     f"{ref['trainer']['base_batch_size']} for the global batch {dist['global_batch_size']}, and the "
                     f"job scales by × {dist['lr_scale_factor']:.4g} (lr_scaling={job.get('lr_scaling')!r})")
    return Finding(name, FOUND, evidence, fix)


def padding(ctx: Context) -> Finding:
    """Samples repeated by DistributedSampler's padding (len % N != 0) or other samples in a global batch."""
    name = "samples duplicated by padding"
    n, length, micro = ctx.dist["world_size"], ctx.dist["dataset_len"], ctx.dist["micro_batch"]
    padded = math.ceil(length / n) * n - length
    end = (math.ceil(math.ceil(length / n) / micro) - 1) // ctx.dist["accumulate"]  # the epoch's last step
    fix = ("make the training set a multiple of the world size, or drop_last=True in the DataLoader; a sampler of "
           "your own must give rank r the samples r, r+N, ... of one shared order")
    differ = [r["step"] for r in ctx.comparison.rows if r["samples_differ"]]
    pad = (f"{length} samples over {n} ranks: DistributedSampler repeats {padded} sample(s) at the end of every "
           f"epoch (step {end})") if padded else f"{length} samples split evenly over {n} ranks (no padding)"
    if differ and padded and any(s % (end + 1) == end for s in differ):
        return Finding(name, FOUND, f"{pad}; the global batch differs from the reference's at step(s) {differ}", fix)
    if differ:
        return Finding("other samples in the global batch", FOUND,
                       f"the global batch differs from the reference's at step(s) {differ} ({pad}): a sampler, "
                       "shuffle or data set that differs between the runs", fix)
    return Finding(name, POSSIBLE if padded else NOT_SEEN, pad + "; every compared step held the same samples", fix)


def means_of_means(ctx: Context) -> Finding:
    """Validation metrics that differ while the weights agree: averaged as a mean of per-rank means?"""
    name = "metrics averaged as means of means"
    fin, rtol = ctx.comparison.finals["differences"], ctx.comparison.rtol
    fix = "sum each metric and its count over ranks, then divide (self.log in a TrainingModule does)"
    bad = [k for k, v in fin.items() if k.startswith("val_") and v > rtol]
    n, length = ctx.dist["world_size"], ctx.dist["val_len"]
    split = [len(range(r, length, n)) for r in range(n)] if length else []
    if not bad:
        return Finding(name, NOT_SEEN, "the validation metrics agree", fix)
    if fin["weights"] > rtol or fin["buffers_across_ranks"] > rtol:
        return Finding(name, POSSIBLE, f"{', '.join(bad)} differ, but so does the model", fix)
    status = FOUND if len(set(split)) > 1 else POSSIBLE
    return Finding(name, status, f"{', '.join(bad)} differ while the weights agree; the validation set of {length} "
                                 f"splits {split} over the ranks", fix)


def dropout(ctx: Context) -> Finding:
    """Random masks cannot match between 1 and N processes."""
    count = ctx.dist["model"]["dropout"]
    return Finding("randomness in the forward pass (dropout)", POSSIBLE if count else NOT_SEEN,
                   f"{count} dropout module(s) with p > 0: each process draws its own masks" if count else
                   "no dropout module with p > 0",
                   "compare with dropout off (p=0): random masks differ between 1 and N processes by construction")


CAUSES: tuple[Callable[[Context], Finding], ...] = (batchnorm, loss_normalisation, learning_rate, padding,
                                                     means_of_means, dropout)


def diagnose(ctx: Context) -> list[Finding]:
    """Every cause's finding, found first, then possible, then not seen."""
    order = {FOUND: 0, POSSIBLE: 1, NOT_SEEN: 2}
    return sorted((cause(ctx) for cause in CAUSES), key=lambda f: order[f.status])
