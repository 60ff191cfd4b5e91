"""Straggler detection: which ranks are slower than the others.

Under DDP every rank waits for the slowest one inside the gradient all-reduce, so per-rank step
times come out equal and cannot point at the culprit. The measure used is each rank's *compute time*
per step: step wall time minus its *exposed* communication, the time from its last gradient ready
to its last all-reduce done (``trainscale.telemetry.overlap``), where a fast rank waits for the
others. The straggler computes longest; the ranks waiting for it show the wait as exposed
communication. The all-reduce time hidden behind backward is not subtracted: the rank was computing
then. Exposed communication lies inside the step, so compute time stays positive (the whole
all-reduce time, summed over buckets, did not: it could exceed the step and bring every rank to 0).
Without all-reduce timing (no DDP hook) compute time is the step wall time.
"""

from __future__ import annotations

from statistics import median


def compute_per_step(wall_s: float, exposed_comm_s: float | None, steps: float) -> float:
    """Seconds per step a rank computed: its step wall time less its exposed communication (the wait
    at the end of backward for the all-reduce; None: not timed, nothing subtracted). Sums over
    ``steps`` steps in, seconds per step out (0.0 for no steps)."""
    if steps <= 0:
        return 0.0
    return max(0.0, wall_s - (exposed_comm_s or 0.0)) / steps


def find_stragglers(compute_s: list[float], margin: float = 0.2) -> list[int]:
    """Ranks whose compute time exceeds the median over ranks by more than ``margin`` (0.2 = 20 %).

    Args:
        compute_s: seconds per step for each rank, in rank order (:func:`compute_per_step`).
        margin: relative margin over the median.

    Returns:
        Rank numbers in ascending order; empty for one rank. A median of 0 does not turn detection
        off: every rank above 0 is then named.
    """
    if len(compute_s) < 2:
        return []
    limit = median(compute_s) * (1.0 + margin)
    return [rank for rank, seconds in enumerate(compute_s) if seconds > limit]
