"""Straggler detection: which ranks are slower than the others.

Under DDP every rank waits for the slowest one inside the gradient all-reduce, so per-rank step
times come out equal and cannot point at the culprit. The measure used is each rank's *busy time*
per step: step wall time minus the time it spent in all-reduce (which includes waiting for the
others). The straggler is busy the longest; the ranks waiting for it show the wait as
communication. Without all-reduce timing (no DDP hook) busy time is the step wall time.
"""

from __future__ import annotations

import math


def mean(values) -> float:
    """Arithmetic mean (``math.fsum``) of an iterable of floats. The ``statistics`` module is not used
    in the modules a Trainer imports: with ``decimal`` and ``fractions`` it adds ~0.5 MiB to every
    training process.

    Raises:
        ZeroDivisionError: no values.
    """
    values = list(values)
    return math.fsum(values) / len(values)


def median(values) -> float:
    """The middle value (mean of the two middle ones for an even count), like ``statistics.median``.

    Raises:
        IndexError: no values.
    """
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def busy_per_step(wall_s: float, comm_s: float | None, steps: float) -> float:
    """Seconds per step a rank spent outside the gradient all-reduce (``comm_s`` None: no timing)."""
    if steps <= 0:
        return 0.0
    return max(0.0, wall_s - (comm_s or 0.0)) / steps


def find_stragglers(busy_s: list[float], margin: float = 0.2) -> list[int]:
    """Ranks whose busy time exceeds the median over ranks by more than ``margin`` (0.2 = 20 %).

    Args:
        busy_s: seconds per step for each rank, in rank order.
        margin: relative margin over the median.

    Returns:
        Rank numbers in ascending order (empty for one rank or a median of zero).
    """
    if len(busy_s) < 2:
        return []
    middle = median(busy_s)
    if middle <= 0:
        return []
    return [rank for rank, busy in enumerate(busy_s) if busy > middle * (1.0 + margin)]
