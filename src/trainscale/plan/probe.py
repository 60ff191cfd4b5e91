"""``trainscale plan --probe``: measure this machine's link between processes, and the workload's step
as N synchronised processes run it.

Two processes (``trainscale.runtime.spawn``, gloo on CPU, nccl on GPUs) time ``all_reduce`` and
``all_gather_into_tensor`` at several message sizes (median of repetitions after a warm-up). A straight
line ``t = a + b·S`` fitted to the all-reduce times by least squares gives, with nccl-tests'
definitions (``doc/PERFORMANCE.md``; see :mod:`trainscale.plan.comm`), the bus bandwidth
``B = 2(N−1)/N / b`` and the latency per ring step ``α = a / (2(N−1))``.

Given a workload, the same processes then time its single-device step at each batch size, all of them
at once (so the compute is measured under the contention N processes on one host cause) and with the
collectives of a DDP step issued where DDP issues them (:class:`DDPCollectives`: the buffers broadcast
before forward, each gradient bucket all-reduced after backward). A collective issued after compute
waits for the slowest rank and, on a busy host, for a descheduled peer to wake: the idle link fit
misses both, this measurement holds them. Each rank times its own steps; the slowest rank's means
are returned (a synchronous step waits for it).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

from trainscale.plan import comm
from trainscale.plan.comm import Link

SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)  # bytes: 4 KiB … 16 MiB
REPS = 5


class DDPCollectives:
    """The collectives of one DDP step on buffers of the model's sizes: ``before_forward`` broadcasts the
    buffers' bytes from rank 0 (``broadcast_buffers=True``), ``after_backward`` all-reduces one buffer per
    gradient bucket (:func:`trainscale.plan.comm.ddp_buckets`)."""

    def __init__(self, model, bucket_bytes: float, device) -> None:
        import torch

        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        self.buckets = [torch.zeros(max(1, int(b) // 4), device=device)
                        for b in comm.ddp_buckets(grad_bytes, bucket_bytes)]
        self.buffers = torch.zeros(max(1, buffer_bytes // 4), device=device) if buffer_bytes else None

    def before_forward(self) -> None:
        import torch.distributed as dist

        if self.buffers is not None:
            dist.broadcast(self.buffers, 0)

    def after_backward(self) -> None:
        import torch.distributed as dist

        for bucket in self.buckets:
            dist.all_reduce(bucket)


def _time_steps(rt, spec: dict) -> dict:
    """Each batch size's step (forward, backward, DDP's collectives, optimizer) timed on every rank at
    once; per batch size the slowest rank's means (``ComputeTime`` fields, s)."""
    from trainscale.plan.measure import measure_compute

    work = spec["workload"]
    model, sample, _ = work.real()
    collectives = DDPCollectives(model, spec["bucket_bytes"], rt.device)
    mine = {bs: asdict(measure_compute(model, sample, bs, work.loss_fn, work.optimizer_fn, spec["precision"],
                                       rt.device, threads=spec["threads"], collectives=collectives))
            for bs in spec["batch_sizes"]}
    ranks = rt.all_gather_object(mine)
    return {bs: max((r[bs] for r in ranks), key=lambda t: t["forward_s"] + t["backward_s"] + t["comm_s"]
                    + t["optimizer_s"]) for bs in spec["batch_sizes"]}


def _time_collectives(sizes: tuple[int, ...], reps: int, steps: dict | None = None) -> dict:
    """Body of each probe process: median seconds per size of all_reduce and all_gather (rank 0's), and
    with ``steps`` (workload, batch_sizes, precision, threads, bucket_bytes) the timed steps."""
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
            out["steps"] = _time_steps(rt, steps)
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
        steps: also time a workload's step in every process at once: ``{"workload": Workload,
            "batch_sizes", "precision", "threads" (per process; None: torch's default),
            "bucket_bytes"}``; the raw times then hold ``"steps"``: per batch size the slowest rank's
            ``ComputeTime`` fields (seconds), ``comm_s`` being DDP's collectives timed in place.

    Raises:
        ValueError: ``nprocs`` < 2.
    """
    if nprocs < 2:
        raise ValueError(f"probe needs at least 2 processes, got {nprocs}")
    from trainscale.runtime import spawn

    raw = spawn.run(_time_collectives, {"sizes": tuple(sizes), "reps": reps, "steps": steps}, nprocs)
    return fit_link(raw["sizes"], raw["all_reduce"], nprocs), raw
