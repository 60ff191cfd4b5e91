"""A step on a cluster of catalogue GPUs: per-GPU compute (:mod:`trainscale.plan.gpu_time`) composed with the
collectives of each strategy on each mesh axis and what overlaps them.

**Links per mesh axis.** The mesh is torchtitan's (and the Runtime's): ``[pp, dp_replicate, dp_shard, tp]``, tp
innermost, so a group of ``n`` ranks on an axis sits ``stride`` ranks apart (tp: 1; dp_shard: tp; pp: everything
inside it). A group inside one node runs over NVLink (one direction of the data sheet's per-GPU figure); a group
across nodes runs its ring through the NICs of the group's GPUs on each node (nccl-tests: one ring per NIC, so the
bus bandwidth across nodes is the group's GPUs per node × the per-GPU port rate), never faster than NVLink. Times
per collective are nccl-tests' (:mod:`trainscale.plan.comm`: all-reduce 2(n−1)/n, all-gather and reduce-scatter
(n−1)/n of the bytes over the bus bandwidth, plus a latency per ring step).

**Overlap per strategy.**

- ddp (Li et al. 2020): gradient buckets (25 MiB) all-reduced while backward runs: exposed is the last bucket's
  all-reduce, or all that backward cannot cover;
- fsdp (FSDP2, Zhao et al. 2023): per layer, the all-gather of the next layer prefetched under the current one's
  compute (forward: ``max(compute, all-gather)``; backward: ``max(compute, all-gather + reduce-scatter)``, the
  parameters gathered again after ``reshard_after_forward``), the first all-gather exposed; each gather's copy out
  of the all-gather buffer (read and written once, on the compute stream) added to the layer's compute;
- tp (Megatron-LM, Shoeybi et al. 2019, with sequence parallelism, Korthikanti et al. 2022): the activations'
  all-gathers and reduce-scatters (2 each per layer in forward, 2 each in backward, the forward's again when it is
  recomputed) block the next layer: all exposed;
- pp (1F1B, Narayanan et al. 2021; GPipe, Huang et al. 2019): (m + p − 1) slots of the slowest stage's micro-batch,
  the bubble (p − 1)/(m + p − 1), and a point-to-point transfer of the boundary activation per slot each way; under
  pp FSDP gathers once per step and reduces once (torchtitan keeps the parameters unsharded across micro-batches),
  hidden under the stage's compute where it fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainscale.plan import comm
from trainscale.plan import efficiency as eff
from trainscale.plan.gpu_time import Phases
from trainscale.plan.hardware import Cluster


@dataclass(frozen=True)
class Layout:
    """Mesh degrees (the Runtime's names) and the pipeline's micro-batches."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp


def axis_link(cluster: Cluster, size: int, stride: int, scenario: str) -> comm.Link:
    """The :class:`~trainscale.plan.comm.Link` of a group of ``size`` ranks ``stride`` apart (see the module's
    docstring), with the constants of ``scenario``."""
    per_node = cluster.gpus_per_node
    nvlink = cluster.gpu.link_per_direction() * eff.NVLINK.at(scenario)
    latency = eff.LATENCY.at(scenario)
    if size * stride <= per_node or cluster.interconnect is None:
        return comm.Link(nvlink, latency, "nvlink" if cluster.gpu.nvlink else "pcie")
    in_node = max(1, min(size, per_node // stride))
    network = in_node * cluster.interconnect.bandwidth * eff.NETWORK.at(scenario)
    return comm.Link(min(nvlink, network), latency, cluster.interconnect.name)


@dataclass(frozen=True)
class Transformer:
    """What :func:`transformer_step` composes, per GPU, for one micro-batch: ``layer`` and ``outer`` (embedding, final
    norm, output projection and loss) :class:`Phases` in one scenario (tp-sharded shapes when tp > 1),
    ``optimizer_s`` (the whole step's optimizer on this GPU's shard), ``layers`` (L), ``layer_params`` (parameters
    of one layer on one tp rank), ``activation_bytes`` (one micro-batch's (B, T, hidden) in the compute dtype: tp's
    all-reduce size and pp's transfer), ``recompute`` (None, "selective", "full": which tp collectives forward
    runs again), ``gather_bytes``/``reduce_bytes`` per parameter (2 and 4: bf16 all-gather, fp32 reduce-scatter; 1
    for torchao's float8 all-gather), ``tp_gather_fraction`` (see :func:`_tp_s`), ``outer_params`` (the embedding,
    final norm and output projection on one tp rank: the root FSDP unit, gathered in the compute dtype, 2 bytes,
    before the first layer and reduce-scattered after the last layer's backward, both exposed)."""

    layer: Phases
    outer: Phases
    optimizer_s: float
    layers: int
    layer_params: float
    activation_bytes: float
    recompute: str | None = None
    gather_bytes: float = 2.0
    reduce_bytes: float = 4.0
    tp_gather_fraction: float = 1.0
    outer_params: float = 0.0


def _tp_s(work: Transformer, layout: Layout, link: comm.Link) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's sequence-parallel collectives, all on the critical path: forward
    gathers the (B, T, hidden) activation before attention and before the feed-forward and reduce-scatters each
    one's output (torchtitan's plan: ``PrepareModuleInput`` Shard(1) → Replicate, ``RowwiseParallel(output_layouts=
    Shard(1))``); backward runs the reverse (the gradient of an all-gather is a reduce-scatter and vice versa), in
    the compute dtype; a full recompute runs the forward's again, a selective one its all-gathers (torchtitan's
    per-op policy saves ``reduce_scatter_tensor``'s output, not the all-gather's). Under float8 the forward gathers
    the fp8 cast (``tp_gather_fraction`` 0.5: torchao's ``Float8ColwiseParallel`` casts its input before the
    all-gather)."""
    if layout.tp < 2:
        return 0.0, 0.0
    scatter = comm.all_gather_s(work.activation_bytes, layout.tp, link)
    gather = comm.all_gather_s(work.activation_bytes * work.tp_gather_fraction, layout.tp, link)
    forward = 2 * (gather + scatter)
    again = {"full": forward, "selective": 2 * gather}.get(work.recompute, 0.0)
    return forward, 2 * 2 * scatter + again


def transformer_step(work: Transformer, layout: Layout, cluster: Cluster, scenario: str) -> dict:
    """Seconds of one optimizer step and its parts: ``step_s``, ``compute_s`` (forward, backward, optimizer),
    ``tp_s``, ``fsdp_exposed_s``, ``bubble_s``, ``p2p_s``."""
    tp_link = axis_link(cluster, layout.tp, 1, scenario)
    fs_link = axis_link(cluster, layout.dp_shard, layout.tp, scenario)
    tp_f, tp_b = _tp_s(work, layout, tp_link)
    gather = comm.all_gather_s(work.layer_params * work.gather_bytes, layout.dp_shard, fs_link)
    reduce = comm.all_gather_s(work.layer_params * work.reduce_bytes, layout.dp_shard, fs_link)
    # FSDP2 copies each gathered layer out of the all-gather buffer into its parameters on the compute stream
    # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_all_gather_copy_out, from wait_for_unshard)
    copy_out = 2 * work.layer_params * work.gather_bytes / (cluster.gpu.hbm_bandwidth * eff.HBM.at(scenario)) \
        if layout.dp_shard > 1 else 0.0
    f, b = work.layer.forward_s + tp_f + copy_out, work.layer.backward_s + tp_b
    if layout.pp == 1:
        b += copy_out  # gathered again for backward (reshard_after_forward); under pp once per step
    layers = work.layers / layout.pp
    if layout.pp == 1:
        per_layer = max(f, gather) + max(b, gather + reduce)
        # the root unit (embedding, norm, output projection): gathered before anything runs, reduced after
        root = comm.all_gather_s(work.outer_params * 2.0, layout.dp_shard, fs_link) + \
            comm.all_gather_s(work.outer_params * work.reduce_bytes, layout.dp_shard, fs_link)
        step = layers * per_layer + gather + root + work.outer.forward_s + work.outer.backward_s
        exposed = layers * (per_layer - f - b) + gather + root
        bubble = p2p = 0.0
    else:
        m, p = layout.microbatches, layout.pp
        slot = layers * (f + b) + work.outer.forward_s + work.outer.backward_s
        pp_link = axis_link(cluster, p, layout.world_size // p, scenario)
        transfer = comm.p2p_s(work.activation_bytes, pp_link)
        pipeline = comm.pipeline_s(slot, transfer, p, m)
        fsdp = layers * (gather + reduce)
        exposed = max(0.0, fsdp - m * slot)
        step, bubble, p2p = pipeline + exposed, (p - 1) * slot, 2 * (m + p - 1) * transfer
    step += work.optimizer_s
    m = layout.microbatches
    compute = m * (layers * (work.layer.forward_s + work.layer.backward_s) + work.outer.forward_s
                   + work.outer.backward_s) + work.optimizer_s
    return {"step_s": step, "compute_s": compute, "tp_s": m * layers * (tp_f + tp_b), "fsdp_exposed_s": exposed,
            "bubble_s": bubble, "p2p_s": p2p}


def ddp_step(phases: Phases, grad_bytes: float, devices: int, cluster: Cluster, scenario: str,
             bucket_bytes: float = comm.DDP_BUCKET_BYTES) -> dict:
    """Seconds of one DDP step on ``devices`` GPUs: compute plus the all-reduce that backward does not hide (the
    last bucket's, or all that exceeds backward)."""
    link = axis_link(cluster, devices, 1, scenario)
    buckets = comm.ddp_buckets(grad_bytes, bucket_bytes)
    total = sum(comm.all_reduce_s(b, devices, link) for b in buckets)
    last = comm.all_reduce_s(buckets[-1], devices, link) if buckets else 0.0
    exposed = max(last, total - phases.backward_s) if devices > 1 else 0.0
    compute = phases.forward_s + phases.backward_s + phases.optimizer_s
    return {"step_s": compute + exposed, "compute_s": compute, "comm_s": total, "exposed_s": exposed}
