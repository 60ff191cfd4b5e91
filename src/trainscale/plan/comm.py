"""The communication model: seconds of one step's collectives over a link, and the predicted step.
Pure arithmetic, no torch.

A link is a *bus bandwidth* B (bytes/s) and a latency α (s) per ring step, in the sense of NCCL's
tests (nccl-tests ``doc/PERFORMANCE.md``): for a collective on N ranks over S bytes,

- all-reduce:      t = 2(N−1)·α + S · 2(N−1)/N / B    (a ring reduce-scatter then all-gather)
- all-gather:      t = (N−1)·α + S · (N−1)/N / B      (S: the gathered, full size)
- broadcast:       t = (N−1)·α + S / B                (pipelined ring: busbw = algbw)
- reduce-scatter:  t = (N−1)·α + S · (N−1)/N / B      (S: the full input size)

so that the bus bandwidth nccl-tests prints for a fabric is the B to use here. Per training step:

- ddp (Li et al. 2020, "PyTorch Distributed", VLDB): one all-reduce of the gradients per bucket
  (``bucket_cap_mb``, 25 MiB by default), overlapped with backward, and a broadcast of the buffers
  (BatchNorm statistics) from rank 0 before each forward (``broadcast_buffers=True``);
- fsdp (Zhao et al. 2023, "PyTorch FSDP", VLDB; FSDP2 ``fully_shard``): the parameters are all-gathered
  in forward and, for the units resharded after forward, again in backward; the gradients are
  reduce-scattered; the optimizer steps 1/N of the parameters.

- hsdp (FSDP2 ``fully_shard`` on a 2-D mesh; Zhao et al. 2023, section 3.2.2, "hybrid sharding"): FSDP's
  collectives within each group of S shard ranks, then an all-reduce of each rank's 1/S of the
  reduce-scattered gradients across the R replicas;
- tp (Megatron-LM, Shoeybi et al. 2019): the collectives DTensor issues for the plan's styles (an all-reduce
  of each row-parallel layer's output in forward and of each column-parallel layer's input gradient in
  backward, all-gathers where an output is made whole), read from one traced step
  (``trainscale.plan.collectives``). They sit between a layer and the next, on the critical path: no
  overlap with backward is assumed for them.

- pp (GPipe, Huang et al. 2019, §2.2; 1F1B, Narayanan et al. 2021, §2.2): P stages run M micro-batches in
  M + P − 1 slots of the slowest stage's micro-batch (forward and backward), idle in P − 1 of them while the
  pipeline fills and drains (the bubble, (P − 1)/(M + P − 1) of the step); each slot waits for a point-to-point
  transfer of a micro-batch's boundary activation in forward and of its gradient in backward
  (t = α + S / B: nccl-tests' sendrecv, whose bus bandwidth is its algorithm bandwidth), none hidden.

Step time: ``forward + backward + optimizer + max(0, comm − overlap · backward)``: ``overlap`` is the
share of backward that can hide communication (0: none, an upper bound; 1: all of backward).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb=25

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bytes(text: str | int | float) -> int:
    """``"80GB"`` → 80e9, ``"80GiB"`` → 80·2³⁰, a number → itself (bytes).

    Raises:
        ValueError: not a number with a unit among B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size; write e.g. 80GB, 80GiB or 1e9 (bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class Link:
    """A fabric between devices: bus bandwidth (bytes/s) and latency per ring step (s)."""

    bus_bandwidth: float
    latency: float = 10e-6
    source: str = "given"

    def __str__(self) -> str:
        return f"{self.bus_bandwidth / 1e9:.3g} GB/s bus bandwidth, latency {self.latency * 1e6:.3g} µs ({self.source})"


def parse_link(text: str) -> Link:
    """``"400GB/s,latency=10us"`` (latency optional, default 10 µs) → :class:`Link`.

    Raises:
        ValueError: a malformed bandwidth or latency (the message shows the form).
    """
    form = "write e.g. --bandwidth 400GB/s,latency=10us"
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts or not parts[0].lower().endswith("/s"):
        raise ValueError(f"bandwidth {text!r} must be bytes per second; {form}")
    try:
        bandwidth = parse_bytes(parts[0][:-2])
    except ValueError:
        raise ValueError(f"bandwidth {text!r}: {parts[0]!r} is not bytes per second; {form}") from None
    latency = 10e-6
    for part in parts[1:]:
        key, _, value = part.partition("=")
        match = re.fullmatch(r"([0-9.]+)\s*(s|ms|us|µs|ns)", value.strip())
        if key.strip() != "latency" or not match:
            raise ValueError(f"bandwidth {text!r}: cannot read {part!r}; {form}")
        latency = float(match.group(1)) * _TIME[match.group(2)]
    if bandwidth <= 0:
        raise ValueError(f"bandwidth {text!r} must be positive; {form}")
    return Link(float(bandwidth), latency)


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` on ``n`` ranks (0 for one rank)."""
    if n < 2 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.latency + nbytes * 2 * (n - 1) / n / link.bus_bandwidth


def all_gather_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of an all-gather (or reduce-scatter) whose full size is ``nbytes``, on ``n`` ranks."""
    if n < 2 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.latency + nbytes * (n - 1) / n / link.bus_bandwidth


def broadcast_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a pipelined ring broadcast of ``nbytes`` from one rank to ``n`` ranks: nccl-tests'
    bus bandwidth of broadcast equals its algorithm bandwidth (every byte crosses each link once)."""
    if n < 2 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.latency + nbytes / link.bus_bandwidth


def ddp_buckets(grad_bytes: float, bucket_bytes: float = DDP_BUCKET_BYTES) -> list[float]:
    """Byte sizes of DDP's gradient buckets: full buckets of ``bucket_bytes`` and one partial bucket."""
    full, rest = divmod(grad_bytes, bucket_bytes)
    return [float(bucket_bytes)] * int(full) + ([rest] if rest > 0 else [])


def ddp_comm_s(grad_bytes: float, n: int, link: Link, bucket_bytes: float = DDP_BUCKET_BYTES,
               buffer_bytes: float = 0.0) -> float:
    """Seconds of one DDP step's collectives: an all-reduce per gradient bucket and, when the model has
    buffers (BatchNorm statistics), their broadcast from rank 0 before each forward (DDP's default
    ``broadcast_buffers=True``; Li et al. 2020, section 3.2)."""
    return sum(all_reduce_s(b, n, link) for b in ddp_buckets(grad_bytes, bucket_bytes)) + \
        broadcast_s(buffer_bytes, n, link)


def fsdp_comm_s(gather_bytes: float, regather_bytes: float, reduce_bytes: float, n: int, link: Link) -> float:
    """Seconds of one FSDP step: all-gather ``gather_bytes`` (parameters in their compute dtype) in
    forward, ``regather_bytes`` again in backward (units resharded after forward), reduce-scatter
    ``reduce_bytes`` (gradients in the reduce dtype)."""
    return all_gather_s(gather_bytes, n, link) + all_gather_s(regather_bytes, n, link) + \
        all_gather_s(reduce_bytes, n, link)


def hsdp_comm_s(gather_bytes: float, regather_bytes: float, reduce_bytes: float, shard: int, replicate: int,
                link: Link) -> float:
    """Seconds of one HSDP step: :func:`fsdp_comm_s` within a group of ``shard`` ranks, then the all-reduce
    of each rank's ``reduce_bytes / shard`` across the ``replicate`` groups (one link for both)."""
    return fsdp_comm_s(gather_bytes, regather_bytes, reduce_bytes, shard, link) + \
        all_reduce_s(reduce_bytes / shard, replicate, link)


def collectives_s(collectives: list, n: int, link: Link) -> float:
    """Seconds of traced collectives (``trainscale.plan.collectives.Collective``: ``kind`` and the bytes of
    one rank's input) on groups of ``n`` ranks. An all-gather's full size is ``n`` times its input; an
    all-to-all moves (n−1)/n of its input over each rank's link (nccl-tests' alltoall bus bandwidth).

    Raises:
        ValueError: a kind this model has no formula for.
    """
    total = 0.0
    for c in collectives:
        if c.kind == "all_reduce":
            total += all_reduce_s(c.nbytes, n, link)
        elif c.kind == "all_gather":
            total += all_gather_s(c.nbytes * n, n, link)
        elif c.kind in ("reduce_scatter", "all_to_all"):
            total += all_gather_s(c.nbytes, n, link)
        else:
            raise ValueError(f"no time model for a {c.kind!r} collective")
    return total


def p2p_s(nbytes: float, link: Link) -> float:
    """Seconds of one point-to-point transfer of ``nbytes`` (a send and its receive; nccl-tests' sendrecv: bus
    bandwidth = algorithm bandwidth)."""
    return link.latency + nbytes / link.bus_bandwidth if nbytes > 0 else 0.0


def pipeline_s(slot_s: float, transfer_s: float, stages: int, microbatches: int) -> float:
    """Seconds of a pipeline's forward and backward over ``stages`` stages and ``microbatches`` micro-batches:
    (M + P − 1) slots of the slowest stage's micro-batch compute ``slot_s`` (forward and backward), each with a
    forward and a backward transfer ``transfer_s`` (Huang et al. 2019, "GPipe", §2.2: the bubble is
    (P − 1)/(M + P − 1) of the step)."""
    return (microbatches + stages - 1) * (slot_s + 2 * transfer_s)


def step_s(forward_s: float, backward_s: float, optimizer_s: float, comm_s: float, overlap: float = 0.0) -> float:
    """Predicted step seconds: compute plus the communication backward does not hide.

    Raises:
        ValueError: ``overlap`` outside [0, 1].
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap={overlap} must be within [0, 1] (the share of backward that hides communication)")
    return forward_s + backward_s + optimizer_s + max(0.0, comm_s - overlap * backward_s)


def steps_per_epoch(samples: int, batch_size: int, n: int) -> int:
    """Optimizer steps per epoch on each of ``n`` ranks: ``DistributedSampler`` gives each rank
    ``ceil(samples / n)`` samples (padding by repetition), in batches of ``batch_size`` (last one partial)."""
    return math.ceil(math.ceil(samples / n) / batch_size)
