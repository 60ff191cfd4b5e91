"""The speed-up account: where the gap between the ideal and the measured step time went, in terms that add up.

A run on N devices is compared with a baseline on fewer (normally one device). Per optimizer step, in seconds:

- **ideal**: under *weak* scaling (the same per-device batch; N devices train N times the samples per step) the
  baseline's step time; under *strong* scaling (the same global batch, split N ways) the baseline's step time ÷ s,
  s = N ÷ baseline devices. Efficiency = ideal ÷ measured; the **gap** = measured − ideal.
- **measured**: the run's step time (telemetry's ``step_time_s``: the mean over ranks of each rank's wall time).

The step is read on the rank that waited most (the most exposed communication; every rank leaves DDP's all-reduce
together, so it is the rank with the least work of its own): its wall time = data + compute (forward, backward
without the exposed communication, optimizer) + exposed communication + time outside the phases. Its exposed
communication holds the all-reduce's own exposed cost, which the slowest rank (the least exposed communication)
shows alone, plus its wait for that rank. Each term is the run's part minus the ideal's part (the baseline's ÷ s):

=============================  =================================================================================
exposed communication          slowest rank's exposed communication (the all-reduce backward waits for)
data wait                      the data phase: waiting for the loader, moving the batch, the loop between steps
waiting for the slowest rank   the waiting rank's exposed communication − the slowest rank's (load imbalance)
per-step fixed overhead        the growth of compute that does not depend on the batch
compute slowdown               the growth of compute per sample × the per-device batch (devices sharing cores or
                               memory bandwidth)
residual                       gap − the terms above: time outside the phases, the ranks' clocks
=============================  =================================================================================

The compute growth (the run's compute − the ideal's) is split between per-step fixed overhead and compute slowdown
in the proportion that fits of compute time against per-device batch give (:func:`fit_compute`, one per device
count, over two or more batch sizes: the intercepts' growth, the slopes' growth × the batch; a part that shrank counts
as 0); without fits, or where neither part grew, one term, compute slowdown, holds all of it (with any fixed
overhead).

Each term names its fix and the efficiency the run would have without it: ideal ÷ (measured − term).
Pure arithmetic on telemetry's dicts (``summary.json["telemetry"]``); nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PHASES = ("data", "forward", "backward", "optimizer")
WEAK, STRONG = "weak", "strong"
COMM, DATA, WAIT, OVERHEAD, SLOWDOWN, RESIDUAL = ("exposed communication", "data wait", "waiting for the slowest rank",
                                                  "per-step fixed overhead", "compute slowdown", "residual")
SYMBOLS = {COMM: "C", DATA: "D", WAIT: "W", OVERHEAD: "O", SLOWDOWN: "S", RESIDUAL: "?"}


@dataclass(frozen=True)
class StepSplit:
    """One run's mean optimizer step as seen by the rank that waited most. Seconds per step.

    Attributes:
        step_s: the run's step time (mean over ranks).
        data_s, compute_s: that rank's data phase; its forward + backward (less exposed communication) + optimizer.
        comm_s: the all-reduce's exposed cost: the least exposed communication over ranks (0 when not timed).
        wait_s: that rank's exposed communication beyond ``comm_s``: its wait for the slowest rank.
        other_s: that rank's wall time outside the four phases.
        rank: which rank that is; ``slowest_rank``: the rank with the least exposed communication.
        devices, per_device_batch: the run's device count and batch per device (samples).
    """

    step_s: float
    data_s: float
    compute_s: float
    comm_s: float
    wait_s: float
    other_s: float
    devices: int
    per_device_batch: int
    rank: int = 0
    slowest_rank: int = 0


def step_split(telemetry: dict, devices: int, per_device_batch: int) -> StepSplit:
    """The :class:`StepSplit` of ``summary["telemetry"]`` (or a step record), from its per-rank fields
    (``rank_step_time_s``, ``rank_phase_s``, ``rank_exposed_comm_s``); a dict without them (older results) is
    read as one rank with the means over ranks.

    Raises:
        ValueError: ``telemetry`` has no step time or phases (a run without telemetry or without a step).
    """
    if not telemetry or not telemetry.get("phase_s") or not _finite(telemetry.get("step_time_s")):
        raise ValueError("no step telemetry to account for: the run needs enable_telemetry=True (the default) and "
                         "at least one timed step")
    walls = telemetry.get("rank_step_time_s") or [telemetry["step_time_s"]]
    phases = telemetry.get("rank_phase_s") or {p: [telemetry["phase_s"][p]] for p in PHASES}
    exposed = telemetry.get("rank_exposed_comm_s")
    if exposed is None:  # not timed (one rank, a strategy without a hook), or older results: the mean on every rank
        exposed = [telemetry.get("exposed_comm_s") or 0.0] * len(walls)
    waiting = max(range(len(walls)), key=lambda r: exposed[r])
    slowest = min(range(len(walls)), key=lambda r: exposed[r])
    mine = {p: phases[p][waiting] for p in PHASES}
    return StepSplit(step_s=telemetry["step_time_s"], data_s=mine["data"],
                     compute_s=mine["forward"] + mine["backward"] - exposed[waiting] + mine["optimizer"],
                     comm_s=exposed[slowest], wait_s=exposed[waiting] - exposed[slowest],
                     other_s=walls[waiting] - sum(mine.values()), devices=devices, per_device_batch=per_device_batch,
                     rank=waiting, slowest_rank=slowest)


@dataclass(frozen=True)
class ComputeFit:
    """Compute seconds per step ≈ ``fixed_s + per_sample_s × per-device batch``, at one device count
    (:func:`fit_compute`)."""

    fixed_s: float
    per_sample_s: float
    points: int


def fit_compute(splits: list[StepSplit]) -> ComputeFit | None:
    """Least squares of compute time against per-device batch over runs with one device count, each point
    weighted by 1 / its time² (relative errors: small and large batches count alike). None with fewer than two
    distinct batch sizes."""
    pts = [(s.per_device_batch, s.compute_s) for s in splits if s.compute_s > 0]
    if len({b for b, _ in pts}) < 2:
        return None
    w = [1.0 / t ** 2 for _, t in pts]
    sw = math.fsum(w)
    mb = math.fsum(wi * b for wi, (b, _) in zip(w, pts)) / sw
    mt = math.fsum(wi * t for wi, (_, t) in zip(w, pts)) / sw
    sbb = math.fsum(wi * (b - mb) ** 2 for wi, (b, _) in zip(w, pts))
    slope = math.fsum(wi * (b - mb) * (t - mt) for wi, (b, t) in zip(w, pts)) / sbb
    return ComputeFit(fixed_s=mt - slope * mb, per_sample_s=slope, points=len(pts))


@dataclass(frozen=True)
class Term:
    """One part of the gap: ``seconds`` per step (negative: better than ideal), its share of the gap, the
    efficiency without it (ideal ÷ (measured − seconds)) and what would remove it."""

    name: str
    seconds: float
    share: float
    efficiency_without: float
    fix: str


@dataclass(frozen=True)
class Account:
    """The account of one run (:func:`account`); ``terms`` hold every term, the residual last, and their
    seconds sum to ``gap_s``."""

    scaling: str
    devices: int
    baseline_devices: int
    ideal_s: float
    measured_s: float
    terms: list[Term] = field(default_factory=list)
    note: str = ""

    @property
    def gap_s(self) -> float:
        return self.measured_s - self.ideal_s

    @property
    def efficiency(self) -> float:
        return self.ideal_s / self.measured_s

    def term(self, name: str) -> Term | None:
        return next((t for t in self.terms if t.name == name), None)

    def as_dict(self) -> dict:
        return {"scaling": self.scaling, "devices": self.devices, "baseline_devices": self.baseline_devices,
                "ideal_s": self.ideal_s, "measured_s": self.measured_s, "gap_s": self.gap_s,
                "efficiency": self.efficiency, "note": self.note,
                "terms": [{"name": t.name, "seconds": t.seconds, "share": t.share,
                           "efficiency_without": t.efficiency_without, "fix": t.fix} for t in self.terms]}


def infer_scaling(run_global_batch: int, run_devices: int, base_global_batch: int, base_devices: int) -> str:
    """``"strong"`` when both runs train the same global batch, ``"weak"`` when they train the same batch per
    device.

    Raises:
        ValueError: neither (the two runs cannot be compared step for step).
    """
    if run_global_batch == base_global_batch:
        return STRONG
    if run_global_batch * base_devices == base_global_batch * run_devices:
        return WEAK
    raise ValueError(f"global batch {run_global_batch} on {run_devices} device(s) against {base_global_batch} on "
                     f"{base_devices}: neither the same global batch (strong scaling) nor the same batch per device "
                     "(weak scaling); give a baseline run that trains one of them")


def _fixes(run: StepSplit, scaling: str) -> dict[str, str]:
    rest = run.step_s - run.data_s
    workers = max(1, math.ceil(run.data_s / rest)) if rest > 0 else 1
    return {
        COMM: "overlap it with backward (smaller DDP buckets: bucket_cap_mb), all-reduce less often "
              "(accumulate_grad_batches), compress gradients (a bf16/fp16 comm hook), a faster interconnect",
        DATA: f"load ahead: {workers} DataLoader worker(s) (num_workers={workers}; pin_memory=True on GPUs), or "
              "lighter work per batch in the loop",
        WAIT: f"rank {run.slowest_rank} is slower than rank {run.rank}: balance the work per rank (equal batches and "
              "sequence lengths), or find what slows it (its data, its device, another process on its cores)",
        OVERHEAD: "fewer, larger steps: a larger per-device batch" + (" (strong scaling shrinks it N-fold)"
                                                                        if scaling == STRONG else "")
                  + ", torch.compile or CUDA graphs for the per-step launch cost",
        SLOWDOWN: "devices that do not share cores or memory bandwidth (on CPU: more cores per process, or GPUs)",
        RESIDUAL: "not attributed: time outside the timed phases, unequal step times across ranks",
    }


def account(run: StepSplit, baseline: StepSplit, scaling: str, fits: tuple[ComputeFit, ComputeFit] | None = None,
            note: str = "") -> Account:
    """The account of ``run`` against ``baseline`` (see the module docstring for every definition).

    Args:
        run, baseline: :func:`step_split` of the two runs (the baseline on fewer devices, normally one).
        scaling: ``"weak"`` (same per-device batch) or ``"strong"`` (same global batch).
        fits: (the run's device count's fit, the baseline's) from :func:`fit_compute`, to split the compute
            growth into per-step fixed overhead and compute slowdown; None: one term holds both.
        note: said with the account (e.g. which runs were compared).

    Raises:
        ValueError: an unknown ``scaling``, a baseline on as many devices or more, or a step time that is not
            positive.
    """
    if scaling not in (WEAK, STRONG):
        raise ValueError(f"scaling must be 'weak' or 'strong', not {scaling!r}")
    if baseline.devices >= run.devices:
        raise ValueError(f"the baseline runs on {baseline.devices} device(s), the run on {run.devices}: the baseline "
                         "needs fewer devices (normally one)")
    if not (run.step_s > 0 and baseline.step_s > 0):
        raise ValueError(f"step times must be positive (run {run.step_s}, baseline {baseline.step_s})")
    s = run.devices / baseline.devices if scaling == STRONG else 1.0
    ideal = baseline.step_s / s
    parts = {COMM: run.comm_s - baseline.comm_s / s, DATA: run.data_s - baseline.data_s / s,
             WAIT: run.wait_s - baseline.wait_s / s}
    growth = run.compute_s - baseline.compute_s / s
    fixed, per_sample = _fitted_growth(fits, s, run.per_device_batch)
    if fixed is not None:
        parts[OVERHEAD], parts[SLOWDOWN] = growth * fixed / (fixed + per_sample), growth * per_sample / (fixed + per_sample)
    else:
        parts[SLOWDOWN] = growth
    gap = run.step_s - ideal
    parts[RESIDUAL] = gap - math.fsum(parts.values())
    fixes = _fixes(run, scaling)
    terms = [Term(name, sec, sec / gap if gap else math.nan, ideal / (run.step_s - sec), fixes[name])
             for name, sec in parts.items()]
    return Account(scaling, run.devices, baseline.devices, ideal, run.step_s, terms, note)


def _fitted_growth(fits, s: float, batch: int) -> tuple[float | None, float | None]:
    """What the fits say compute grew by at ``batch`` per device: ``(fixed part, per-sample part)``, a part that
    shrank counted as 0; ``(None, None)`` without fits or when neither part grew (they do not separate the two)."""
    if fits is None:
        return None, None
    mine, base = fits
    fixed = max(0.0, mine.fixed_s - base.fixed_s / s)
    per_sample = max(0.0, (mine.per_sample_s - base.per_sample_s) * batch)
    return (fixed, per_sample) if fixed + per_sample > 0 else (None, None)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def bar(acc: Account, width: int = 60) -> str:
    """The step as a text stacked bar ``width`` characters long: ``=`` the ideal, then one letter per term that cost
    time, in the order of ``acc.terms`` (C, D, W, O, S, ? as in :data:`SYMBOLS`). The bar spans the ideal plus those
    terms: the measured step when no term is negative (terms below zero, faster than ideal, are not drawn; the text
    lists them)."""
    cells = [("=", acc.ideal_s)] + [(SYMBOLS[t.name], t.seconds) for t in acc.terms if _loss(t, acc)]
    scale = width / math.fsum(seconds for _, seconds in cells)
    out, used = [], 0.0
    for symbol, seconds in cells:  # round the running total, so the bar is exactly width long
        start, used = round(used * scale), used + seconds
        out.append(symbol * (round(used * scale) - start))
    return "[" + "".join(out) + "]"


def render(acc: Account, title: str = "", detail: bool = True) -> str:
    """The account as text: a head line, the stacked bar with each drawn term's seconds, and with ``detail`` one
    line per term (seconds, share of the gap, the efficiency without it, the fix)."""
    kind = (f"weak scaling: ideal = the {acc.baseline_devices}-device step" if acc.scaling == WEAK else
            f"strong scaling: ideal = the {acc.baseline_devices}-device step ÷ {acc.devices / acc.baseline_devices:g}")
    head = (f"{title + ': ' if title else ''}ideal {_ms(acc.ideal_s)}, measured {_ms(acc.measured_s)}, gap "
            f"{_ms(acc.gap_s)}, efficiency {acc.efficiency:.2f} ({kind})")
    ordered = sorted(acc.terms, key=lambda t: (t.name == RESIDUAL, -t.seconds))
    legend = ", ".join(f"{SYMBOLS[t.name]} {t.name} {_ms(t.seconds)}" for t in ordered if _loss(t, acc))
    lines = [head, f"  {bar(acc)}  = ideal" + (f", {legend}" if legend else "")]
    if not detail:
        return "\n".join(lines)
    from tabulate import tabulate

    rows = [(f"{SYMBOLS[t.name]} {t.name}", _ms(t.seconds), f"{t.share:.0%}" if _finite(t.share) else "—",
             "of the gap; " + (f"without it efficiency {acc.efficiency:.2f} → {t.efficiency_without:.2f}"
                               if _loss(t, acc) else "not a loss") + f": {t.fix}") for t in ordered]
    table = tabulate(rows, tablefmt="plain", disable_numparse=True, colalign=("left", "right", "right", "left"))
    lines += [f"  {line}" for line in table.splitlines()]
    if acc.term(OVERHEAD) is None:
        lines.append(f"  ({SLOWDOWN} includes any {OVERHEAD}: they are separated by timings at two or more batch "
                     "sizes on both device counts, as bench takes them)")
    if acc.note:
        lines.append(f"  ({acc.note})")
    return "\n".join(lines)


def _loss(term: Term, acc: Account) -> bool:
    """Whether ``term`` costs time worth drawing and listing: more than a thousandth of the measured step."""
    return term.seconds > 1e-3 * acc.measured_s


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
