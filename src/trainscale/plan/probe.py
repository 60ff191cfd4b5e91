"""``trainscale plan --probe``: measure this machine's link between processes, and the workload's step
as N synchronised processes run it.

Two processes (``trainscale.runtime.spawn``, gloo on CPU, nccl on GPUs) time ``all_reduce`` and
``all_gather_into_tensor`` at several message sizes (median of repetitions after a warm-up). A straight
line ``t = a + b·S`` fitted to the all-reduce times by least squares gives, with nccl-tests'
definitions (``doc/PERFORMANCE.md``; see :mod:`trainscale.plan.comm`), the bus bandwidth
``B = 2(N−1)/N / b`` and the latency per ring step ``α = a / (2(N−1))``.

Given a workload, the same processes then run it through the real Trainer under ``strategy="ddp"``, a
short run per batch size (:func:`trainscale.plan.measure.trainer_steps`), all ranks at once: the step
as this machine runs it with N processes (their contention for the host, DDP's forward and its
Reducer's bucketed all-reduce, the distributed sampler's loader, the Trainer's own work), and the
share of backward that hid the all-reduce (the Trainer's telemetry, :mod:`trainscale.telemetry.overlap`).
A collective issued after compute waits for the slowest rank and, on a busy host, for a descheduled
peer to wake: the idle link fit misses both, this run holds them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

from trainscale.plan.comm import Link

SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)  # bytes: 4 KiB … 16 MiB
REPS = 5


def _time_steps(spec: dict) -> dict:
    """Each batch size's step in a real DDP run on every rank at once (``ComputeTime`` fields, s; the
    Trainer's telemetry averages its phases over the ranks)."""
    from trainscale.plan.measure import trainer_steps

    work = spec["workload"]
    model, sample, dataset = work.real()
    times = trainer_steps(model, dataset, sample, spec["batch_sizes"], work.loss_fn, work.optimizer_fn,
                          spec["precision"], spec["root"], threads=spec["threads"], loader_kwargs=work.loader_kwargs,
                          strategy_options=spec.get("strategy_options"))
    return {bs: asdict(t) for bs, t in times.items()}


def _time_collectives(sizes: tuple[int, ...], reps: int, steps: dict | None = None) -> dict:
    """Body of each probe process: median seconds per size of all_reduce and all_gather (rank 0's), and
    with ``steps`` (workload, batch_sizes, precision, threads, root) the timed DDP steps."""
    import torch
    import torch.distributed as dist

    from trainscale.runtime.runtime import Runtime

    rt = Runtime(devices="auto", strategy="ddp", timeout=120).launch()
    out: dict = {"all_reduce": [], "all_gather": []}
    try:
        for size in sizes:
            buf = torch.ones(size // 4, dtype=torch.float32, device=rt.device)
            gathered = torch.empty(buf.numel() * rt.world_size, dtype=torch.float32, device=rt.device)
            for name, op in (("all_reduce", lambda: dist.all_reduce(buf)),
                             ("all_gather", lambda: dist.all_gather_into_tensor(gathered, buf))):
                samples = []
                for i in range(reps + 1):  # the first one warms up
                    dist.barrier()
                    t0 = time.perf_counter()
                    op()
                    if buf.is_cuda:
                        torch.cuda.synchronize()
                    if i:
                        samples.append(time.perf_counter() - t0)
                out[name].append(statistics.median(samples))
        if steps:
            out["steps"] = _time_steps(steps)
    finally:
        dist.destroy_process_group()
    return {"sizes": list(sizes), "world_size": rt.world_size, **out}


def fit_link(sizes: list[int], seconds: list[float], n: int) -> Link:
    """Bus bandwidth and latency of a ring all-reduce on ``n`` ranks from times at message sizes.

    Raises:
        ValueError: fewer than two sizes, or times that do not grow with the size (no bandwidth to fit).
    """
    if len(sizes) < 2 or len(sizes) != len(seconds):
        raise ValueError("fit_link needs at least two (size, seconds) pairs")
    mean_s, mean_t = statistics.fmean(sizes), statistics.fmean(seconds)
    slope = sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, seconds)) / sum((s - mean_s) ** 2 for s in sizes)
    if slope <= 0:
        raise ValueError(f"all-reduce times {seconds} do not grow with the message size {sizes}; probe again")
    intercept = max(0.0, mean_t - slope * mean_s)
    return Link(bus_bandwidth=2 * (n - 1) / n / slope, latency=intercept / (2 * (n - 1)), source="probe")


def probe(nprocs: int = 2, sizes: tuple[int, ...] = SIZES, reps: int = REPS,
          steps: dict | None = None) -> tuple[Link, dict]:
    """Start ``nprocs`` processes on this machine, time their collectives, return the fitted
    :class:`~trainscale.plan.comm.Link` and the raw times (``{"sizes", "all_reduce", "all_gather"}``, s).

    Args:
        steps: also run a workload through the Trainer under ddp in every process at once: ``{"workload":
            Workload, "batch_sizes", "precision", "threads" (per process; None: torch's default), "root"
            (a directory for the runs), "strategy_options" (ddp's)}``; the raw times then hold ``"steps"``: per batch size the
            ``ComputeTime`` fields (seconds; ``comm_s`` the all-reduce's exposed part, ``hidden_comm_s``
            the part backward hid).

    Raises:
        ValueError: ``nprocs`` < 2.
    """
    if nprocs < 2:
        raise ValueError(f"probe needs at least 2 processes, got {nprocs}")
    from trainscale.runtime import spawn

    raw = spawn.run(_time_collectives, {"sizes": tuple(sizes), "reps": reps, "steps": steps}, nprocs)
    return fit_link(raw["sizes"], raw["all_reduce"], nprocs), raw
