"""``trainscale.plan.plan(...)``: memory per device and time per step/epoch for each strategy, device count
and batch size, before any cluster is booked. Memory: :mod:`trainscale.plan.memory` (no allocation);
time: one measured single-device run (:mod:`trainscale.plan.measure`) plus the communication model
(:mod:`trainscale.plan.comm`) over a given or probed link (:mod:`trainscale.plan.probe`). Pipeline stages (pp):
:mod:`trainscale.plan.pipeline` (each stage's peak composed from one traced micro-batch and torch's schedule; the
step (M + P − 1) slots of the slowest stage, so the bubble (P − 1)/(M + P − 1) of GPipe, Huang et al. 2019).
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from trainscale.plan import comm, memory
from trainscale.plan.memory import MemoryEstimate
from trainscale.runtime import hf
from trainscale.runtime.precision import parameter_dtype

STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "pp")  # what plan() models; its default is DEFAULT_STRATEGIES
DEFAULT_STRATEGIES = ("ddp", "fsdp")
# strategies with a time model (tp: on one node, where its step is traced; pp: (M + P − 1) slots, GPipe's bubble)
TIMED = ("ddp", "fsdp", "hsdp", "tp", "pp")
PP_OPTIONS = ("pp_schedule", "pp_microbatches", "pp_split_points")  # the Runtime's pipeline flags, as plan options
DDP_OPTIONS = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb")  # the probe's run


@dataclass
class Workload:
    """What is planned: a model (an ``nn.Module``, possibly on the meta device, or a zero-argument
    factory), one example ``(input, target)`` (its shapes and dtypes matter; it may be on the meta
    device), the loss ``(outputs, targets) -> loss``, the optimizer factory ``params -> Optimizer``, the
    training samples per epoch (None: no epoch time), the training ``dataset`` and its DataLoader
    arguments (to time the data loader; None: not timed), and ``build``: a zero-argument function
    returning bench's workload dict (a real model and data for the timed runs; None: a copy of
    ``model`` or ``model()``, with ``sample`` and ``dataset``)."""

    model: Any
    sample: tuple
    loss_fn: Callable
    optimizer_fn: Callable
    dataset_size: int | None = None
    build: Callable | None = None
    dataset: Any = None
    loader_kwargs: dict | None = None

    def real(self) -> tuple:
        """``(model, sample, dataset)`` with storage, for the timed runs."""
        if self.build is not None:
            work = self.build()
            return work["model"], tuple(work["train"][0]), work["train"]
        from torch import nn

        model = copy.deepcopy(self.model) if isinstance(self.model, nn.Module) else self.model()
        return model, self.sample, self.dataset


@dataclass
class PlanRow:
    """One configuration's prediction. Bytes per device (the largest rank), seconds."""

    strategy: str
    devices: int
    batch_size: int
    precision: str
    memory: MemoryEstimate | None
    fits: bool | None
    note: str = ""
    parallel: dict | None = None  # hsdp/tp: the Runtime's mesh sizes ({"dp_replicate": R, "dp_shard": S, "tp": T})
    pipeline: dict | None = None  # pp: stages, micro-batches, schedule, bubble, shares, peaks (plan.pipeline.estimate)
    step_s: float | None = None
    step_interval: tuple | None = None  # (fast, slow) step seconds of a catalogue GPU's time model (plan.efficiency)
    comm_s: float | None = None
    epoch_s: float | None = None
    gain: float | None = None
    efficiency: float | None = None

    def as_dict(self) -> dict:
        out = asdict(self)
        out.pop("memory")
        out.update({f"{k}_bytes": v for k, v in (asdict(self.memory) if self.memory else {}).items()
                    if k not in out and k != "collectives"})
        return out


@dataclass
class PlanResult:
    """Rows (one per strategy × devices × batch size), the device memory they were held against
    (bytes), the link (None: no time prediction), the single-device compute times measured and, with
    ``probe=True``, the steps of the probe's DDP run (batch size → ``ComputeTime``); ``overlap``: the
    share of backward that hides communication in the modelled rows (batch size → 0..1) and
    ``overlap_source``, where it came from."""

    rows: list[PlanRow]
    device_memory: int
    link: comm.Link | None
    compute: dict = field(default_factory=dict)
    probed: dict = field(default_factory=dict)
    overlap: dict = field(default_factory=dict)
    overlap_source: str = ""
    hardware: str = ""  # the catalogue cluster the times are modelled for ("" : measured or --device-flops)
    constants: tuple = ()  # the time model's named constants with their intervals and sources (printed)

    def smallest(self) -> PlanRow | None:
        """The configuration that fits with the least peak memory per device."""
        fit = [r for r in self.rows if r.fits]
        return min(fit, key=lambda r: (r.memory.peak, r.devices), default=None)

    def fastest(self) -> PlanRow | None:
        """The configuration that fits with the shortest predicted epoch (or step)."""
        fit = [r for r in self.rows if r.fits and (r.epoch_s or r.step_s) is not None]
        return min(fit, key=lambda r: (r.epoch_s or r.step_s, r.devices), default=None)

    def table(self) -> str:
        from trainscale.plan.report import format_plan

        return format_plan(self)


def default_device_memory() -> int:
    """Bytes of the visible device: the first CUDA GPU's total memory, else this machine's RAM."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def workload_from_entry(entry: str | None) -> Workload:
    """bench's ``--entry`` contract (:mod:`trainscale.jobs.workload`) as a :class:`Workload`; the entry
    is called under ``torch.device("meta")``, so its model is not allocated (its data is loaded)."""
    import torch
    from torch.nn import functional as F

    from trainscale.jobs.workload import DEFAULT_ENTRY, load_workload

    name = entry or DEFAULT_ENTRY
    with torch.device("meta"):  # the model is not allocated (nor is data the entry makes with torch)
        work = load_workload(name)
    return Workload(model=work["model"], sample=tuple(work["train"][0]), loss_fn=work["loss_fn"] or F.cross_entropy,
                    optimizer_fn=work["optimizer"] or (lambda p: torch.optim.AdamW(p, lr=1e-3)),
                    dataset_size=len(work["train"]), build=lambda: load_workload(name),
                    loader_kwargs=work["dataloader"])


def _check(devices, batch_sizes, strategies, overlap) -> None:
    if not devices or any(not isinstance(d, int) or d < 1 for d in devices):
        raise ValueError(f"devices={devices!r} must be positive ints, e.g. [1, 2, 8]")
    if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes={batch_sizes!r} must be positive ints, e.g. [32, 64]")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"strategies={strategies!r}: plan models {', '.join(STRATEGIES)}")
    if overlap is not None and not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap={overlap} must be within [0, 1] (or None: measured by the probe's DDP run)")


def mesh_layout(strategy: str, n: int, devices_per_node: int) -> dict:
    """The Runtime's ``parallel`` mesh sizes of an hsdp or tp row on ``n`` devices, nodes of
    ``devices_per_node`` (the Runtime's shorthands, ``parallel_dims.resolve_parallel``): hsdp shards
    within a node and replicates across nodes; tp splits layers within a node (at most ``n``) and
    FSDP-shards across nodes.

    Raises:
        ValueError: a layout the Runtime refuses (tp on 1 device; hsdp on fewer than 2 whole nodes).
    """
    from trainscale.runtime.strategies.parallel_dims import resolve_parallel

    node = min(n, devices_per_node)
    if n % node:
        raise ValueError(f"{n} devices are not whole nodes of {devices_per_node}")
    return resolve_parallel(strategy, None, node, n // node).as_dict()


def _memory(meta, layout, work: Workload, strategy: str, n: int, bs: int, precision: str, ac: tuple,
            options: dict, parallel: dict | None = None, traces: dict | None = None) -> MemoryEstimate:
    """Rank 0's estimate (under fsdp, hsdp and tp rank 0 holds the largest shards: ``torch.chunk`` gives
    the first ranks the longer parts, so it is the per-device maximum). hsdp's activations and peak are
    those of FSDP traced over its ``dp_shard`` ranks (what each replica runs; the all-reduce across
    replicas works in place on the reduce-scattered gradients); tp's are traced on one node's ``tp`` ranks
    (the Runtime's ``apply_tp`` on a fake process group) and not across nodes (tp × fsdp: None); ddp's are
    traced as one replica, the same for every device count. ``traces``: the traces of one plan, kept there
    by strategy, traced device count (None for ddp) and batch size, and reused for the rows that share them."""
    from trainscale.plan import memory

    exact = memory.exact_bytes(meta, layout, strategy, n, 0, precision,
                               gradient_as_bucket_view=bool(options.get("gradient_as_bucket_view")),
                               parallel=parallel, tp_plan=options.get("tp_plan"))
    if strategy == "tp" and parallel["tp"] != n:
        return MemoryEstimate(strategy, n, 0, bs, precision, exact["parameters"], exact["gradients"],
                              exact["optimizer"], exact["buffers"], exact["comm_buffers"], None, None)
    traced_as, traced_n = ("fsdp", parallel["dp_shard"]) if strategy == "hsdp" else (strategy, n)
    traces = {} if traces is None else traces
    key = (strategy, None if strategy == "ddp" else traced_n, bs)
    if key not in traces:
        traces[key] = memory.traced_memory(meta, work.sample, bs, work.loss_fn, work.optimizer_fn, traced_as, traced_n,
                                           precision, activation_checkpointing=ac,
                                           strategy_options=_traced_options(strategy, options),
                                           tp_plan=options.get("tp_plan"),
                                           sequence_parallel=options.get("sequence_parallel"))
    traced = traces[key]
    return MemoryEstimate(strategy, n, 0, bs, precision, exact["parameters"], exact["gradients"],
                          exact["optimizer"], exact["buffers"], exact["comm_buffers"], traced["activations"],
                          traced["peak"] + exact["comm_buffers"], tuple(traced["collectives"]))


def _traced_options(strategy: str, options: dict) -> dict | None:
    """The options the traced fsdp strategy gets: all under fsdp, those it takes under hsdp, none otherwise."""
    if strategy == "hsdp":
        return {k: v for k, v in options.items() if k in ("auto_wrap_policy", "reshard_after_forward", "cpu_offload")}
    kept = {k: v for k, v in options.items() if k not in ("tp_plan", "sequence_parallel", *PP_OPTIONS)}
    return kept if strategy == "fsdp" else None


def _row(meta, layout, work: Workload, strategy: str, n: int, bs: int, precision: str, ac: tuple, options: dict,
         capacity: int, devices_per_node: int, traces: dict) -> PlanRow:
    """The memory row of one configuration; a layout the Runtime refuses (hsdp/tp/pp) gives a row with its reason."""
    if strategy == "pp":
        return _pp_row(meta, layout, work, n, bs, precision, ac, options, capacity)
    parallel = None
    if strategy in ("hsdp", "tp"):
        try:
            parallel = mesh_layout(strategy, n, devices_per_node)
        except ValueError:
            need = "2+ devices" if strategy == "tp" else f"2+ whole nodes of devices_per_node={devices_per_node}"
            return PlanRow(strategy, n, bs, precision, None, None, f"{strategy} needs {need}")
    kept = options if strategy in ("fsdp", "hsdp") else {k: v for k, v in options.items() if k != "auto_wrap_policy"}
    est = _memory(meta, layout, work, strategy, n, bs, precision, ac, kept, parallel, traces)
    fits = None if est.peak is None else est.peak <= capacity
    note = " × ".join(f"{k} {v}" for k, v in (parallel or {}).items() if v > 1)
    if est.peak is None:
        note += "; peak not traced across nodes"
    return PlanRow(strategy, n, bs, precision, est, fits, note, parallel)


def _pp_row(meta, layout, work: Workload, n: int, bs: int, precision: str, ac: tuple, options: dict,
            capacity: int) -> PlanRow:
    """The row of ``n`` pipeline stages (one per device; :func:`trainscale.plan.pipeline.estimate`): the stage with
    the largest peak; a model the pp strategy cannot split into ``n`` stages gives a row with the reason."""
    from trainscale.plan import pipeline

    if n < 2:
        return PlanRow("pp", n, bs, precision, None, None, "pp needs 2+ devices")
    try:
        est, schedule = pipeline.estimate(meta, layout, work.sample, work.loss_fn, work.optimizer_fn, n, bs, precision,
                                          ac, {k: v for k, v in options.items() if k in PP_OPTIONS})
    except ValueError as err:  # no split for this model on n stages: the strategy's own message, up to its advice
        return PlanRow("pp", n, bs, precision, None, None, "pp: " + str(err).split(";")[0])
    note = (f"{schedule['schedule']}, {schedule['microbatches']} micro-batches, bubble {schedule['bubble']:.0%}; "
            f"stage {est.rank} the largest")
    return PlanRow("pp", n, bs, precision, est, est.peak <= capacity, note, pipeline=schedule)


def _comm_s(row: PlanRow, meta, precision: str, options: dict, link: comm.Link) -> float:
    """Seconds of one step's collectives for ``row`` (see :mod:`trainscale.plan.comm`)."""
    itemsize = parameter_dtype(precision).itemsize  # bf16-true 2, 64-true 8, else (mixed too: fp32 weights) 4
    grad_bytes = sum(p.numel() * itemsize for p in meta.parameters() if p.requires_grad)
    if row.strategy == "ddp":
        bucket = float(options.get("bucket_cap_mb", 25)) * 2**20
        broadcast = options.get("broadcast_buffers", True)
        buffer_bytes = sum(b.numel() * memory.converted_dtype(b, precision).itemsize
                           for b in meta.buffers()) if broadcast else 0  # cast as the parameters
        return comm.ddp_comm_s(grad_bytes, row.devices, link, bucket, buffer_bytes)
    compute_bytes = grad_bytes // 2 if precision in ("bf16-mixed", "16-mixed") else grad_bytes
    # fully_shard's default: units reshard after forward (gathered again in backward), the root does not
    units = options.get("auto_wrap_policy") or ()
    classes, names = tuple(u for u in units if isinstance(u, type)), frozenset(u for u in units if isinstance(u, str))
    unit_params = {id(p) for m in meta.modules() if units and hf.class_matches(m, classes, names)
                   for p in m.parameters()}
    unit_share = sum(p.numel() for p in meta.parameters() if id(p) in unit_params) / \
        max(1, sum(p.numel() for p in meta.parameters()))
    regather = 0.0 if options.get("reshard_after_forward") is False else compute_bytes * unit_share
    if row.strategy == "hsdp":
        return comm.hsdp_comm_s(compute_bytes, regather, grad_bytes, row.parallel["dp_shard"],
                                row.parallel["dp_replicate"], link)
    return comm.fsdp_comm_s(compute_bytes, regather, grad_bytes, row.devices, link)


def _compute_share(row: PlanRow, meta) -> float:
    """The share of one device's compute a rank of ``row`` does: under tp its share of the parameters (a
    transformer's matmul FLOPs are 2 per parameter per token, Kaplan et al. 2020, and the attention scores
    split with the heads), else 1."""
    if row.strategy != "tp":
        return 1.0
    total = sum(p.numel() * p.element_size() for p in meta.parameters())
    return row.memory.parameters / total if total else 1.0


def _sharded_optimizer(row: PlanRow) -> int:
    """Ranks the optimizer's work is split over: fsdp's devices, hsdp's shard ranks, else 1."""
    return row.devices if row.strategy == "fsdp" else row.parallel["dp_shard"] if row.strategy == "hsdp" else 1


def _row_time(row: PlanRow, t, probed: dict, meta, precision: str, options: dict, link: comm.Link,
              overlap: float) -> None:
    """Step seconds of ``row``: the data loader's wait, the loop's own work, compute and the communication
    backward does not hide (``overlap``). Compute: one device's run (``t``), or for several devices on a
    probed machine the probe's DDP run (N processes on this host slow each other), under tp scaled by the
    rank's share (:func:`_compute_share`); communication: the modelled collectives, or when the row is ddp on
    the probe's own process count the exposed all-reduce that run measured (its step taken whole). tp's
    collectives (traced) sit between layers, on the critical path: none of them is taken as hidden. pp: (M + P − 1)
    slots of the slowest stage's micro-batch and its transfers (:func:`trainscale.plan.pipeline.step_s`)."""
    measured = probed.get(row.batch_size) if row.devices > 1 else None
    base = measured or t
    if measured is not None and row.strategy == "ddp" and row.devices == probed["devices"]:
        row.comm_s, row.note = measured.comm_s, f"step of a {row.devices}-process DDP run (probe)"
        row.step_s = measured.step_s
        return
    if row.strategy == "pp":
        from trainscale.plan import pipeline

        row.step_s, row.comm_s = pipeline.step_s(base, row.pipeline, link)
        return
    share = _compute_share(row, meta)
    optimizer_s = base.optimizer_s * share / _sharded_optimizer(row)
    if row.strategy == "tp":
        row.comm_s = comm.collectives_s(row.memory.collectives, row.parallel["tp"], link)
        work_s = comm.step_s(base.forward_s * share, base.backward_s * share, optimizer_s, 0.0) + row.comm_s
    else:
        row.comm_s = _comm_s(row, meta, precision, options, link) if row.devices > 1 else 0.0
        work_s = comm.step_s(base.forward_s, base.backward_s, optimizer_s, row.comm_s, overlap)
    row.step_s = base.data_s + base.other_s + work_s


def _timed(row: PlanRow) -> bool:
    """Whether ``row`` gets a time: a strategy with a time model, memory predicted, and under tp a traced step
    (tp across nodes is not traced)."""
    return row.memory is not None and row.strategy in TIMED and not (row.strategy == "tp" and row.memory.peak is None)


def _add_time(rows: list[PlanRow], compute: dict, probed: dict, meta, precision: str, options: dict,
              link: comm.Link, overlap: dict, dataset_size: int | None) -> None:
    """Fill step, epoch, gain and efficiency of each row from the measured compute times; ``overlap``: per
    batch size (missing: 0)."""
    for row in rows:
        t = compute.get(row.batch_size)
        if t is None or not _timed(row):
            continue
        row_link = link(row.devices) if callable(link) else link  # a cluster's link depends on the group's span
        _row_time(row, t, probed, meta, precision, options, row_link, overlap.get(row.batch_size, 0.0))
        if dataset_size:  # the epoch is split over the ranks that read different batches
            row.epoch_s = row.step_s * comm.steps_per_epoch(dataset_size, row.batch_size, _data_parallel(row))
        if row.epoch_s:  # gain over one device running the same epoch alone (no communication)
            one = t.step_s * comm.steps_per_epoch(dataset_size, row.batch_size, 1)
            row.gain = one / row.epoch_s
            row.efficiency = row.gain / row.devices


def _data_parallel(row: PlanRow) -> int:
    """Ranks that read different batches: tp's groups and a pipeline's stages read the same ones."""
    if row.strategy == "tp":
        return row.devices // row.parallel["tp"]
    return row.devices // row.pipeline["stages"] if row.strategy == "pp" else row.devices


def _measure(work: Workload, batch_sizes: list, precision: str, threads: int | None) -> dict:
    """One device's step per batch size: a short run of the real Trainer in this process."""
    import tempfile

    from trainscale.plan.measure import trainer_steps

    model, sample, dataset = work.real()
    with tempfile.TemporaryDirectory(prefix="trainscale-plan-") as root:
        return trainer_steps(model, dataset, sample, batch_sizes, work.loss_fn, work.optimizer_fn, precision, root,
                             threads=threads, loader_kwargs=work.loader_kwargs)


def _probe(work: Workload, batch_sizes: list, precision: str, threads: int | None, options: dict,
           nprocs: int = 2) -> tuple[comm.Link, dict]:
    """The probed link and, per batch size, the step of the probe's DDP run."""
    import tempfile
    from dataclasses import replace

    from trainscale.plan.measure import ComputeTime
    from trainscale.plan.probe import probe as run_probe

    shipped = replace(work, dataset=None, model=None if work.build is not None else work.model,
                      sample=tuple(work.sample) if work.build is None else ())
    with tempfile.TemporaryDirectory(prefix="trainscale-probe-") as root:
        ddp_options = {k: v for k, v in options.items() if k in DDP_OPTIONS}
        spec = {"workload": shipped, "batch_sizes": list(batch_sizes), "precision": precision, "threads": threads,
                "root": root, "strategy_options": ddp_options}
        link, raw = run_probe(nprocs, steps=spec)
    return link, {"devices": nprocs, **{bs: ComputeTime(**t) for bs, t in raw["steps"].items()}}


def _threads(devices: list[int]) -> int | None:
    """Threads per process on a CPU, as bench gives each process of a grid with these device counts."""
    import torch

    if torch.cuda.is_available():
        return None
    from trainscale.jobs.launcher import threads_per_process

    return threads_per_process(max(devices))


def plan(model: Any = None, *, entry: str | None = None, sample: tuple | None = None,
         dataset_size: int | None = None, devices: Sequence[int] = (1, 2, 4, 8), batch_sizes: Sequence[int] = (32,),
         strategies: Sequence[str] = DEFAULT_STRATEGIES,
         precision: str = "32-true", optimizer: Callable | None = None, loss_fn: Callable | None = None,
         activation_checkpointing: Any = None, strategy_options: dict | None = None,
         device_memory: int | str | None = None, link: comm.Link | str | None = None, probe: bool = False,
         overlap: float | None = None, measure: bool = True, device_flops: float | None = None,
         devices_per_node: int = 8, gpu: str | None = None, nodes: int = 1,
         interconnect: str | None = None) -> PlanResult:
    """Predict memory per device and, with a link, time per step and epoch, for each strategy,
    device count and per-device batch size.

    Args:
        model: an ``nn.Module`` (copied to the meta device, never moved) or a zero-argument factory
            (called under ``torch.device("meta")``). Or give ``entry`` instead.
        entry: bench's workload contract, ``"package.module:function"`` (:mod:`trainscale.jobs.workload`);
            supplies model, sample, dataset size, loss and optimizer. None with no ``model``: the ConvNet on MNIST-5k.
        sample: one training example ``(input, target)``, e.g. ``dataset[0]`` (with ``model``).
        dataset_size: training samples per epoch (for epoch times).
        devices: device counts.
        batch_sizes: per-device micro-batch sizes.
        strategies: among "ddp", "fsdp", "hsdp", "tp", "pp" (default ddp and fsdp; fsdp and pp need 2+ devices,
            their 1-device rows say so). pp: one stage per device, the batch in micro-batches
            (``trainscale.plan.pipeline``: each stage's peak composed from one traced micro-batch and torch's
            schedule; time (M + P − 1) slots of the slowest stage, the bubble (P − 1)/(M + P − 1) of GPipe).
            hsdp and tp rows: the mesh is the Runtime's shorthand on nodes of
            ``devices_per_node`` (:func:`mesh_layout`); tp is traced (peak, collectives, time) on one node,
            and across nodes gives exact bytes only (peak None, "—"; ``fits`` None; no time).
        precision: "32-true", "16-mixed", "bf16-mixed", "bf16-true" or "64-true".
        optimizer: ``params -> Optimizer`` (default AdamW, lr 1e-3).
        loss_fn: ``loss_fn(outputs, targets)`` (default cross-entropy).
        activation_checkpointing: module classes whose forward is recomputed in backward.
        strategy_options: as for the Runtime (ddp: ``bucket_cap_mb``, ``gradient_as_bucket_view``;
            fsdp: ``auto_wrap_policy``, ``reshard_after_forward``; tp: ``tp_plan``, default the GPT's; pp:
            ``pp_schedule``, ``pp_microbatches``, ``pp_split_points``, default 1F1B, 4·P and the GPT's split).
        device_memory: bytes or "80GB" to hold each peak against (default: the visible device's).
        link: a :class:`~trainscale.plan.comm.Link` or "400GB/s,latency=10us"; ``probe=True`` measures
            this machine's instead (2 processes: the link, then a short DDP run of the workload through
            the Trainer in both, whose step the 2-device ddp rows take whole and whose compute and overlap
            the other rows use). Without either, no time is predicted.
        overlap: share of backward that hides communication in the modelled rows (0: none, an upper bound
            of the step; 1: all of backward). None: measured by the probe's DDP run with ``probe=True``
            (per batch size), else 0. ``result.overlap_source`` says which.
        measure: time one device's step per batch size (a short run of the real Trainer; needed for time predictions).
        devices_per_node: devices of one node, for the hsdp and tp meshes.
        device_flops: FLOP/s of a device you are not on (e.g. 989e12): forward and backward time from the
            step's counted FLOPs instead of a measured run (:func:`~trainscale.plan.measure.counted_compute`).
        gpu: a GPU of the catalogue (:mod:`trainscale.plan.hardware`, e.g. "h100-sxm") you are not on: each
            operator of the traced step costed on it (:mod:`trainscale.plan.gpu_time`), the links from the catalogue
            (NVLink within a node of ``devices_per_node``, ``interconnect`` across ``nodes``), the device memory its
            HBM unless given; each row's step gets an interval (``step_interval``) from the constants' ranges, and
            ``result.constants`` lists them with their sources.
        nodes: the machines of ``gpu``'s cluster (e.g. 16).
        interconnect: the link between those machines, a name of ``plan.hardware`` (e.g. "ib-400").

    Returns:
        A :class:`PlanResult`; ``result.table()`` is the text table.

    Raises:
        ValueError: bad devices, batch sizes, strategies, precision, memory size (or none), device FLOP/s, link or
            overlap.
        RuntimeError: called inside a distributed job (fsdp is traced on a fake process group).
    """
    import torch
    from torch.nn import functional as F

    from trainscale.plan import memory
    from trainscale.runtime.precision import PRECISIONS

    devices, batch_sizes, strategies = list(devices), list(batch_sizes), list(strategies)
    _check(devices, batch_sizes, strategies, overlap)
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision={precision!r}; choose one of {', '.join(PRECISIONS)}")
    cluster = None
    if gpu is not None:
        from trainscale.plan import hardware

        cluster = hardware.cluster(gpu, nodes, devices_per_node, interconnect)
        device_memory = device_memory if device_memory is not None else cluster.gpu.hbm_bytes
        _check_modelled_dtype(cluster.gpu, precision)
    capacity = comm.parse_bytes(device_memory) if device_memory is not None else default_device_memory()
    if capacity <= 0:
        raise ValueError(f"device_memory={device_memory!r} is no memory; give the device's, e.g. 80GB")
    if device_flops is not None and not device_flops > 0:  # also NaN
        raise ValueError(f"device_flops={device_flops!r} must be a positive FLOP/s, e.g. 989e12 (H100 SXM, dense bf16)")
    link = comm.parse_link(link) if isinstance(link, str) else link
    if model is None:
        work = workload_from_entry(entry)
    elif sample is None:
        raise ValueError("plan(model=...) needs sample=(input, target), one training example, e.g. dataset[0]")
    else:
        work = Workload(model, tuple(sample), F.cross_entropy, lambda p: torch.optim.AdamW(p, lr=1e-3), dataset_size)
    work.loss_fn = loss_fn or work.loss_fn
    work.optimizer_fn = optimizer or work.optimizer_fn
    work.dataset_size = dataset_size or work.dataset_size
    ac = tuple(activation_checkpointing or ())
    options = dict(strategy_options or {})
    meta = memory.build_meta_model(work.model)
    layout = memory.optimizer_layout(meta, work.optimizer_fn, precision)
    rows, traces = [], {}
    for strategy in strategies:
        for n in devices:
            for bs in batch_sizes:
                if strategy == "fsdp" and n < 2:
                    rows.append(PlanRow(strategy, n, bs, precision, None, None, "fsdp needs 2+ devices"))
                    continue
                rows.append(_row(meta, layout, work, strategy, n, bs, precision, ac, options, capacity,
                                 devices_per_node, traces))
    compute, probed, threads = {}, {}, _threads(devices)
    if probe:
        link, probed = _probe(work, batch_sizes, precision, threads, options)
    overlaps, source = _overlap(overlap, probed, batch_sizes)
    if cluster is not None:
        if overlap is None:  # on a GPU, DDP's buckets and FSDP2's prefetched collectives run on their own streams
            overlaps = {bs: 1.0 for bs in batch_sizes}
            source = "modelled: DDP's buckets and FSDP2's collectives run beside backward (--overlap sets it)"
        compute = _gpu_time(rows, cluster, meta, work, batch_sizes, precision, options, overlaps, link)
        return PlanResult(rows, capacity, link or _cluster_link(cluster, "mid")(max(devices)), compute, probed,
                          overlaps, source, _describe(cluster), _constants(cluster))
    if link is not None and device_flops:
        from trainscale.plan.measure import counted_compute

        compute = {bs: counted_compute(meta, work.sample, bs, work.loss_fn, precision, device_flops)
                   for bs in batch_sizes}
        _add_time(rows, compute, probed, meta, precision, options, link, overlaps, work.dataset_size)
    elif link is not None and measure:
        compute = _measure(work, batch_sizes, precision, threads)
        _add_time(rows, compute, probed, meta, precision, options, link, overlaps, work.dataset_size)
    return PlanResult(rows, capacity, link, compute, probed, overlaps, source)


def _overlap(given: float | None, probed: dict, batch_sizes: list) -> tuple[dict, str]:
    """Per batch size the share of backward that hides communication, and where it comes from: the
    value given; else the probe's DDP run (hidden all-reduce seconds over backward's, per batch size);
    else 0 (none, an upper bound of the step)."""
    if given is not None:
        return {bs: given for bs in batch_sizes}, "given"
    if probed:
        return ({bs: probed[bs].overlap for bs in batch_sizes},
                f"measured in the probe's {probed['devices']}-process DDP run")
    return {bs: 0.0 for bs in batch_sizes}, "assumed none: --probe measures it in a DDP run, --overlap sets it"


def _check_modelled_dtype(gpu, precision: str) -> None:
    """The GPU time model (:mod:`trainscale.plan.gpu_time`) has data-sheet rates and measured GEMM fractions for
    fp32, tf32, bf16, fp16 and fp8 kernels only; a float64 step would be a guess.

    Raises:
        ValueError: precision "64-true" on a catalogue GPU."""
    if precision == "64-true" and "fp64" not in gpu.flops:
        raise ValueError(f"plan(gpu={gpu.name!r}) models fp32, tf32, bf16 and fp16 kernels, not the float64 ones of "
                         "precision='64-true'; plan without gpu= (memory is exact in float64, and the step is timed on "
                         "this machine), or give device_flops= (--device-flops: the device's float64 FLOP/s) "
                         "and a link")


def _cluster_link(cluster, scenario: str) -> Callable:
    """``devices -> Link`` of a data-parallel group of that many ranks on ``cluster`` (:func:`plan.cluster.axis_link`)."""
    from trainscale.plan.cluster import axis_link

    return lambda n: axis_link(cluster, n, 1, scenario)


def _gpu_time(rows: list[PlanRow], cluster, meta, work: Workload, batch_sizes: list, precision: str, options: dict,
              overlaps: dict, link: comm.Link | None) -> dict:
    """Fill the rows' times on a catalogue GPU (``step_s`` the middle scenario, ``step_interval`` the fast and slow
    ones); returns the middle's compute per batch size. A given ``link`` replaces the catalogue's."""
    from trainscale.plan import gpu_time
    from trainscale.plan.measure import ComputeTime

    ops = {bs: gpu_time.trace_step(meta, work.sample, bs, work.loss_fn, work.optimizer_fn, precision)
           for bs in batch_sizes}
    ends = {}
    for scenario in ("fast", "slow", "mid"):
        compute = {}
        for bs in batch_sizes:
            ph = gpu_time.phases(ops[bs], cluster.gpu, scenario)
            compute[bs] = ComputeTime(bs, ph.forward_s, ph.backward_s, ph.optimizer_s,
                                      f"{cluster.gpu.name} (modelled, {scenario})")
        target = rows if scenario == "mid" else [copy.copy(r) for r in rows]
        _add_time(target, compute, {}, meta, precision, options, link or _cluster_link(cluster, scenario), overlaps,
                  work.dataset_size)
        ends[scenario] = [r.step_s for r in target]
    for row, fast, slow in zip(rows, ends["fast"], ends["slow"]):
        row.step_interval = (fast, slow) if fast is not None else None
    return compute


def _describe(cluster) -> str:
    across = f", {cluster.interconnect.name} across nodes" if cluster.interconnect else ""
    return f"{cluster.nodes} × {cluster.gpus_per_node} {cluster.gpu.name} (NVLink within a node{across}; modelled)"


def _constants(cluster) -> tuple:
    from trainscale.plan import efficiency

    used = [efficiency.gemm(cluster.gpu.arch, "bf16"), efficiency.attention(cluster.gpu.arch), efficiency.HBM,
            efficiency.LAUNCH, efficiency.NVLINK, efficiency.LATENCY]
    used += [efficiency.NETWORK] if cluster.interconnect else []
    return tuple(str(c) for c in used)
