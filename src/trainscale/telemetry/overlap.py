"""Communication and its overlap with backward, from one step's per-bucket all-reduce intervals.

DDP all-reduces gradients bucket by bucket while backward still computes the gradients of the
earlier layers (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB, section 3.2.3): a bucket is handed to the communication hook when its last
gradient is ready, and buckets are launched in order, so the last hand-over is the moment the last
gradient was produced. Several buckets are in flight at once, so their (ready, done) intervals
overlap and their sum counts the same seconds several times (on a rank that waits for a slower
one, every bucket's interval holds the same wait).

- **communication time** is the length of the *union* of the intervals: seconds during which at
  least one all-reduce was in flight, overlap counted once;
- **exposed communication** is the part the step waits for: from the last gradient ready (the
  last hand-over) to the last all-reduce done, when DDP's backward returns. The rest of the
  communication is hidden behind backward's computation.

Holistic Trace Analysis's "communication computation overlap" (time spent in computation while
communicating / time spent in communication, from a profiler trace;
https://hta.readthedocs.io/en/latest/source/features/comm_comp_overlap.html) is, on these numbers,
about ``(communication - exposed) / communication``, measured here without a trace.
"""

from __future__ import annotations

from typing import Iterable


def comm_overlap(intervals: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """``(communication_s, exposed_s)`` of one step's bucket all-reduces.

    Args:
        intervals: ``(ready, done)`` pairs in seconds on one clock: when DDP handed the bucket to the
            hook (its gradients ready) and when its all-reduce completed. Any order.

    Returns:
        The length of the union of the intervals (never more than their sum, nor than
        ``max(done) - min(ready)``), and ``max(done) - max(ready)`` clipped at 0 (never more than the union).
        ``(0.0, 0.0)`` for no intervals.
    """
    ordered = sorted(intervals)
    if not ordered:
        return 0.0, 0.0
    union = 0.0
    run_start, run_end = ordered[0]
    last_done = run_end
    for start, end in ordered[1:]:
        if start > run_end:  # a gap: close the run of overlapping intervals
            union += run_end - run_start
            run_start, run_end = start, end
        elif end > run_end:
            run_end = end
        last_done = max(last_done, end)
    union += run_end - run_start
    return union, max(0.0, last_done - ordered[-1][0])
