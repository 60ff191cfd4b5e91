"""Memory per device of one training configuration, computed without allocating the model.

Two parts:

- **Exact bytes** of parameters, gradients, optimizer state and buffers on each rank, from the
  parameters' shapes and dtypes (:func:`exact_bytes`). The optimizer's state layout (which tensors it
  keeps per parameter, their shapes and dtypes: AdamW keeps ``exp_avg`` and ``exp_avg_sq`` shaped like
  the parameter and a 0-d ``step``) is read from the optimizer itself after one ``step()`` on fake
  tensors (``torch._subclasses.FakeTensorMode``: tensors with shapes and dtypes but no storage).
  Sharding follows FSDP2 ``fully_shard`` (Zhao et al. 2023, "PyTorch FSDP"; the per-parameter dim-0
  sharding of ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``): each rank holds a shard padded to
  ``ceil(d0 / N)`` rows for parameters and gradients; the optimizer state is built on the unpadded
  local shard, ``min(ceil(d0/N), d0 - r·ceil(d0/N))`` rows on rank ``r``. DDP keeps a full replica
  and one flat gradient bucket copy (Li et al. 2020, VLDB; none with ``gradient_as_bucket_view``).
- **Activations and the peak** from two traced training steps (the second one is the steady state,
  with the optimizer state present) on fake tensors, counted by PyTorch's own trackers:
  ``torch.distributed._tools.mem_tracker.MemTracker`` (single device; DDP adds its bucket bytes) and
  ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (fsdp: the model really goes through
  ``fully_shard`` over a device mesh of a fake process group of N ranks, so the all-gathered
  parameters, reduce-scatter buffers and sharded states are those FSDP2 allocates). This is the
  method of torchtitan's former ``scripts/estimate/estimation.py``. Mixed precision (autocast, FSDP's
  ``MixedPrecisionPolicy``) and activation checkpointing are applied as the Runtime applies them
  (``trainscale.runtime.apply.prepare_module``).

All byte counts are per device (per rank), in bytes.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from trainscale.runtime.precision import TRUE_DTYPES, parameter_dtype

TRACED_STEPS = 2  # the first step creates the optimizer state; the second is the steady state


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted memory of one rank of one configuration (bytes).

    ``parameters``, ``gradients``, ``optimizer``, ``buffers``: exact, at the end of a step (before
    ``zero_grad``). ``comm_buffers``: DDP's gradient bucket copy. ``activations``: bytes alive at the end
    of forward that were not alive before it (tensors saved for backward, outputs, loss).
    ``peak``: the most bytes alive at once during a steady-state step (params, grads, states,
    activations, temporaries, communication buffers, the input batch). ``collectives``: the functional
    collectives of one traced step (tensor parallelism's; ``trainscale.plan.collectives``), else empty.
    """

    strategy: str
    devices: int
    rank: int
    batch_size: int
    precision: str
    parameters: int
    gradients: int
    optimizer: int
    buffers: int
    comm_buffers: int
    activations: int
    peak: int
    collectives: tuple = ()


# -- models without storage ------------------------------------------------------------------------
def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device (no storage).

    ``copy.deepcopy`` with a memo that maps each tensor to its meta twin, so the original data is
    never copied."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = b.detach().to("meta")
    return copy.deepcopy(module, memo)


def build_meta_model(model: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """``model`` as a meta-device module: a module is copied (:func:`meta_copy`); a zero-argument
    factory is called under ``torch.device("meta")`` so its parameters are never allocated.

    Raises:
        TypeError: neither an ``nn.Module`` nor a factory returning one.
    """
    if isinstance(model, nn.Module):
        return meta_copy(model)
    if callable(model):
        with torch.device("meta"):
            built = model()
        if isinstance(built, nn.Module):
            return meta_copy(built)  # buffers made by torch.tensor(...) outside the device context too
    raise TypeError(f"model must be an nn.Module or a function returning one, got {type(model).__name__}")


def _fake_copy(meta_model: nn.Module, precision: str) -> nn.Module:
    """Inside an active ``FakeTensorMode``: a copy of ``meta_model`` with fake CPU tensors, cast to
    bfloat16 for "bf16-true", float64 for "64-true" (as ``Precision.convert_module`` does; cast while still on
    the meta device, since ``Module.to`` cannot swap fake parameters)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # meta tensors are copied as they are, not as fake inputs
        model = meta_copy(meta_model)
        if precision in TRUE_DTYPES:
            model = model.to(parameter_dtype(precision))
    return model.to_empty(device="cpu")


def _fake_mode():
    """``FakeTensorMode`` that also takes the meta tensors of the model copies as inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _fake_batch(sample: tuple, batch_size: int) -> tuple:
    """Inside ``FakeTensorMode``: a batch of ``batch_size`` samples shaped like ``sample``'s tensors."""
    return tuple(torch.empty((batch_size, *t.shape), dtype=t.dtype) if isinstance(t, torch.Tensor)
                 else torch.empty((batch_size,), dtype=torch.int64) for t in sample)


# -- exact bytes -----------------------------------------------------------------------------------
def converted_dtype(p: torch.Tensor, precision: str) -> torch.dtype:
    """The dtype ``p`` (a parameter or a buffer) has after ``Precision.convert_module``: a "*-true" precision casts
    the floating ones (bfloat16, float64), others keep the model's."""
    return parameter_dtype(precision) if precision in TRUE_DTYPES and p.is_floating_point() else p.dtype


def optimizer_layout(meta_model: nn.Module, optimizer_fn: Callable, precision: str) -> list[list[tuple]]:
    """Per parameter (in ``parameters()`` order), the optimizer's state tensors as
    ``(name, shape, dtype)``, read from the optimizer after one ``step()`` on fake tensors.

    Raises:
        TypeError: ``optimizer_fn`` does not return a ``torch.optim.Optimizer``.
    """
    with _fake_mode():
        model = _fake_copy(meta_model, precision)
        params = list(model.parameters())
        optimizer = optimizer_fn(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a function params -> torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        for p in params:
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        optimizer.step()
        return [[(name, tuple(t.shape), t.dtype) for name, t in optimizer.state.get(p, {}).items()
                 if isinstance(t, torch.Tensor)] for p in params]


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _shard_rows(rows: int, devices: int, rank: int) -> tuple[int, int]:
    """``(padded rows, unpadded rows)`` of rank ``rank``'s dim-0 shard under FSDP2: ``torch.chunk``
    sizes, each rank's storage padded to the first chunk's size."""
    padded = -(-rows // devices)
    return padded, max(0, min(padded, rows - rank * padded))


def _stage_parameters(meta_model: nn.Module, stages: int, rank: int, split_points: list | None) -> set[int]:
    """Ids of the parameters pipeline stage ``rank`` holds (copies of tied weights included)."""
    from trainscale.runtime.strategies.pipeline import stage_units

    units = stage_units(meta_model, stages, split_points)[rank]
    return {id(p) for unit in units for p in meta_model.get_submodule(unit).parameters()}


def _chunk(size: int, parts: int, index: int) -> int:
    """Length of part ``index`` of ``size`` split by ``torch.chunk`` into ``parts``: ``ceil(size/parts)``
    each, the last ones shorter or empty (DTensor's ``Shard`` sizes, ``Shard._split_tensor``)."""
    return _shard_rows(size, parts, index)[1]


# -- tensor parallelism: the shard dim of each parameter, read from the plan -----------------------
def _styles():
    """``{ParallelStyle class: {module class: {parameter name: shard dim}}}`` for the styles that shard
    parameters, as ``torch/distributed/tensor/parallel/style.py`` (torch 2.13) distributes them:
    ColwiseParallel puts a Linear's weight and bias on ``Shard(0)`` and an Embedding's weight on
    ``Shard(1)``; RowwiseParallel a Linear's weight on ``Shard(1)`` (its bias ``Replicate``) and an
    Embedding's weight on ``Shard(0)``. Styles that only move inputs/outputs shard nothing."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   PrepareModuleOutput, RowwiseParallel, SequenceParallel)

    sharding = {ColwiseParallel: {nn.Linear: {"weight": 0, "bias": 0}, nn.Embedding: {"weight": 1}},
                RowwiseParallel: {nn.Linear: {"weight": 1}, nn.Embedding: {"weight": 0}}}
    return sharding, (PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput, SequenceParallel)


def _matching(module: nn.Module, key: str):
    """Submodules named by a plan key (dotted; each part an ``fnmatch`` pattern, as ``parallelize_module``
    reads it)."""
    import fnmatch

    head, _, rest = key.partition(".")
    for name, child in module.named_children():
        if fnmatch.fnmatch(name, head):
            yield from (_matching(child, rest) if rest else (child,))


def _style_dims(module: nn.Module, style: Any, key: str) -> dict[int, int]:
    """``{id(parameter): shard dim}`` that ``style`` gives ``module``'s own parameters.

    Raises:
        ValueError: a style or module type whose sharding the plan cannot read."""
    sharding, movers = _styles()
    for cls, by_module in sharding.items():
        if type(style) is cls:
            names = next((dims for kind, dims in by_module.items() if isinstance(module, kind)), None)
            if names is None:
                raise ValueError(f"tp_plan[{key!r}]: {cls.__name__} on a {type(module).__name__}: torch shards only "
                                 "nn.Linear and nn.Embedding with it; the plan cannot predict its bytes")
            return {id(p): names[n] for n, p in module.named_parameters(recurse=False) if n in names}
    if isinstance(style, movers):
        return {}
    raise ValueError(f"tp_plan[{key!r}]: the plan cannot read how {type(style).__name__} shards parameters (it reads "
                     "ColwiseParallel, RowwiseParallel, SequenceParallel and PrepareModule*); the memory of a custom "
                     "style or of parallelize=fn is not modelled")


def tp_shard_dims(meta_model: nn.Module, tp: int, tp_plan: dict | None = None) -> dict[int, int]:
    """``{id(parameter): dim}`` for the parameters tensor parallelism shards, read from the plan that
    ``trainscale.runtime.strategies.apply_tp.apply_tp`` applies: ``tp_plan`` (keys relative to the model),
    or the built-in plan of each ``trainscale.models.GPT`` inside it. Parameters absent from the result
    are replicated (whole on every tp rank).

    Raises:
        ValueError: no plan and no GPT; plan keys that match nothing; a GPT whose ``n_head`` ``tp`` does
            not divide; a style the plan cannot read (:func:`_style_dims`).
    """
    from trainscale.models.gpt import GPT
    from trainscale.runtime.strategies.apply_tp import gpt_plan, plan_target

    if tp_plan is not None:
        targets = [(plan_target(meta_model, tp_plan), tp_plan)]
    else:
        gpts = [m for m in meta_model.modules() if isinstance(m, GPT)]
        if not gpts:
            raise ValueError(f"tensor parallelism has a built-in plan for trainscale.models.GPT only, and the model "
                             f"({type(meta_model).__name__}) holds none; pass tp_plan={{'layer.name': ColwiseParallel(), "
                             "...}")
        bad = [g.config.n_head for g in gpts if g.config.n_head % tp]
        if bad:
            raise ValueError(f"tp={tp} must divide the GPT's n_head={bad[0]} (each rank computes whole heads)")
        targets = [(g, gpt_plan(g)) for g in gpts]
    dims: dict[int, int] = {}
    for target, plan in targets:
        for key, style in plan.items():
            for module in _matching(target, key):
                dims.update(_style_dims(module, style, key))
    return dims


def _mesh_dims(strategy: str, devices: int, parallel: dict | None):
    """The ``ParallelDims`` a "tp"/"hsdp" run on ``devices`` ranks uses (the Runtime's own resolution)."""
    from trainscale.runtime.strategies.parallel_dims import resolve_parallel

    return resolve_parallel(strategy, parallel, devices, 1)


def _stage_and_mesh(meta_model: nn.Module, strategy: str, devices: int, rank: int, split_points: list | None,
                    parallel: dict | None) -> tuple:
    """``(ids of the parameters rank ``rank`` holds, or None: all; the mesh sizes, or None: no mesh)``. Under
    "pp" the stage is the rank's pipeline coordinate, and a mesh with tp or data-parallel ranks splits each
    stage as "tp"/"hsdp" split a model (the Runtime's order: cut, tensor parallelism, FSDP)."""
    if strategy == "pp":
        dims = _mesh_dims("pp", devices, parallel)
        stage = _stage_parameters(meta_model, dims.pp, dims.pp_rank(rank), split_points)
        return stage, (dims if dims.world_size > dims.pp else None)
    return None, (_mesh_dims(strategy, devices, parallel) if strategy in ("hsdp", "tp") else None)


def _local_shapes(p: torch.Tensor, strategy: str, devices: int, rank: int, mesh: Any,
                  tp_dims: dict) -> tuple[tuple, tuple, tuple]:
    """``(parameter storage, gradient, unpadded local)`` shapes of parameter ``p`` on ``rank``.

    Tensor parallelism first: the shard dim split by ``torch.chunk`` over the tp ranks. The parameter is
    a view of a storage padded to the first chunk (``distribute_tensor`` scatters padded chunks and
    narrows them, ``Shard._split_tensor(with_padding=True)``); its gradient and optimizer states are
    built unpadded. Then FSDP2 (dim 0 of that local shard, parameter and gradient padded) over ``devices``
    ranks (fsdp) or the ``dp_shard`` ranks of the mesh (hsdp, tp with dp_shard > 1)."""
    shape = tuple(p.shape)
    stored = shape
    shards, index = devices, rank
    if mesh is not None:
        _, index, tp_index = mesh.coordinates(rank)
        shards = mesh.dp_shard if mesh.dp_size > 1 else 1
        if id(p) in tp_dims:
            dim = tp_dims[id(p)]
            stored = (*shape[:dim], _shard_rows(shape[dim], mesh.tp, tp_index)[0], *shape[dim + 1:])
            shape = (*shape[:dim], _chunk(shape[dim], mesh.tp, tp_index), *shape[dim + 1:])
    elif strategy != "fsdp":
        return shape, shape, shape
    if shards == 1 or not shape:
        return stored, shape, shape
    padded, rows = _shard_rows(shape[0], shards, index)
    return (padded, *shape[1:]), (padded, *shape[1:]), (rows, *shape[1:])


def exact_bytes(meta_model: nn.Module, layout: list[list[tuple]], strategy: str, devices: int, rank: int,
                precision: str, gradient_as_bucket_view: bool = False,
                split_points: list | None = None, parallel: dict | None = None,
                tp_plan: dict | None = None) -> dict[str, int]:
    """Bytes of ``parameters``, ``gradients``, ``optimizer``, ``buffers`` and ``comm_buffers`` on rank
    ``rank`` of ``devices`` under ``strategy`` ("single", "ddp", "fsdp", "pp", "hsdp", "tp").

    Args:
        meta_model: the model on the meta device (:func:`build_meta_model`).
        layout: :func:`optimizer_layout` of that model.
        gradient_as_bucket_view: DDP's option (gradients alias the buckets: no extra copy).
        split_points: under "pp": the ``pp_split_points``; None: the built-in split of a
            ``trainscale.models.GPT``. Buffers are counted whole on every stage.
        parallel: under "hsdp"/"tp"/"pp": the Runtime's ``parallel`` mesh sizes (``{"dp_replicate": R,
            "dp_shard": S, "tp": T, "pp": P}``, product ``devices``); None: the Runtime's one-node default
            ("tp": ``{"tp": devices}``; "pp": ``{"pp": devices}``, rank = stage; "hsdp" has none and needs
            it). Under "pp" the rank's stage is then split as under "tp"/"hsdp". Ranks are laid out as the Runtime's mesh
            (``ParallelDims.coordinates``). hsdp: FSDP2 shards over the ``dp_shard`` ranks, whole per
            replica; tp: each parameter the plan shards is split by ``torch.chunk`` along its dim
            (:func:`tp_shard_dims`; the parameter's storage padded to the first chunk, see
            :func:`_local_shapes`), then FSDP2-sharded over ``dp_shard`` if that is > 1.
        tp_plan: under "tp": the Runtime's ``tp_plan`` (None: the built-in GPT plan).

    Raises:
        ValueError: an unknown strategy; under "pp", no split for a model that is not a GPT; under
            "hsdp"/"tp", a mesh the Runtime would refuse or a plan that cannot be read.
    """
    if strategy not in ("single", "ddp", "fsdp", "pp", "hsdp", "tp"):
        raise ValueError(f"memory of strategy={strategy!r} is not modelled; choose single, ddp, fsdp, pp, hsdp or tp")
    out = dict(parameters=0, gradients=0, optimizer=0, comm_buffers=0,
               buffers=sum(_nbytes(tuple(b.shape), converted_dtype(b, precision)) for b in meta_model.buffers()))
    stage, mesh = _stage_and_mesh(meta_model, strategy, devices, rank, split_points, parallel)
    tp_dims = tp_shard_dims(meta_model, mesh.tp, tp_plan) if mesh is not None and mesh.tp > 1 else {}
    for p, states in zip(meta_model.parameters(), layout):
        if stage is not None and id(p) not in stage:
            continue
        dtype = converted_dtype(p, precision)
        stored, grad, local = _local_shapes(p, strategy, devices, rank, mesh, tp_dims)
        out["parameters"] += _nbytes(stored, dtype)
        if p.requires_grad:
            out["gradients"] += _nbytes(grad, dtype)
            if strategy == "ddp" and not gradient_as_bucket_view:
                out["comm_buffers"] += _nbytes(grad, dtype)
        for _, state_shape, state_dtype in states:  # states shaped like the parameter follow its shard
            out["optimizer"] += _nbytes(local if state_shape == tuple(p.shape) else state_shape, state_dtype)
    return out


# -- traced peak -----------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_process_group(devices: int, rank: int):
    """A process group of ``devices`` ranks that hallucinates its collectives (PyTorch's "fake"
    backend, ``torch.testing._internal.distributed.fake_pg``), as this process's rank ``rank``.

    Raises:
        RuntimeError: a process group already exists (plan outside a running distributed job).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("trainscale.plan traces FSDP on a fake process group and cannot run inside a "
                           "distributed job: call it from a plain process (e.g. `trainscale plan`)")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    dist.init_process_group("fake", rank=rank, world_size=devices, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _traced_steps(model, optimizer, batch, loss_fn, autocast, tracker) -> int:
    """Run ``TRACED_STEPS`` training steps inside ``tracker``; return the activation bytes of the
    last forward (tracker total after forward minus before it)."""
    activations = 0
    with tracker:
        for _ in range(TRACED_STEPS):
            before = tracker.get_tracker_snapshot("current")
            with autocast():
                loss = loss_fn(model(batch[0]), batch[1])
            after = tracker.get_tracker_snapshot("current")
            activations = sum(s["Total"] for s in after.values()) - sum(s["Total"] for s in before.values())
            loss.backward()
            optimizer.step()
            if TRACED_STEPS > 1:
                optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()  # MemTracker refuses a second iteration otherwise
    return activations


def traced_memory(meta_model: nn.Module, sample: tuple, batch_size: int, loss_fn: Callable,
                  optimizer_fn: Callable, strategy: str, devices: int, precision: str = "32-true",
                  activation_checkpointing: tuple = (), strategy_options: dict | None = None,
                  rank: int = 0, tp_plan: dict | None = None, sequence_parallel: bool | None = None) -> dict[str, Any]:
    """``{"peak", "activations"}`` in bytes of rank ``rank``, from :data:`TRACED_STEPS` steps on fake
    tensors (no storage is allocated), and ``"collectives"``: the functional collectives of one step
    (:class:`trainscale.plan.collectives.Collective`; tensor parallelism's, none otherwise). DDP's bucket copy
    is not included (see :func:`exact_bytes`).

    Args:
        sample: one training example ``(input, target)`` (tensors, or a target number).
        loss_fn: ``(outputs, targets) -> loss``.
        optimizer_fn: ``params -> Optimizer``.
        strategy: "single", "ddp" (traced as one replica), "fsdp" (traced through ``fully_shard``) or "tp"
            (``devices`` tensor-parallel ranks, one node: the model split by the Runtime's ``apply_tp`` with
            ``tp_plan``, None: the built-in GPT plan, before activation checkpointing, as the Runtime orders them;
            ``sequence_parallel`` as the strategy option, None: on with the built-in plan).
    """
    from trainscale.plan.collectives import CollectiveLog, per_step
    from trainscale.plan.trackers import PeakMemTracker
    from trainscale.runtime.apply import apply_activation_checkpointing
    from trainscale.runtime.precision import Precision
    from trainscale.runtime.strategies.apply_tp import apply_tp
    from trainscale.runtime.strategies.model_parallel import resolve_sequence_parallel

    prec = Precision(precision, "cpu")
    sharded = strategy in ("fsdp", "tp")
    group = fake_process_group(devices, rank) if sharded else contextlib.nullcontext()
    with group:
        mesh = _mesh(devices) if sharded else None
        with _fake_mode():
            model = _fake_copy(meta_model, precision)  # prepare_module's order: precision cast, TP, checkpointing
            if strategy == "tp":
                model = apply_tp(model, mesh, tp_plan, resolve_sequence_parallel(sequence_parallel, tp_plan is None))
            model = apply_activation_checkpointing(model, tuple(activation_checkpointing or ()))
            if strategy == "fsdp":
                model, tracker_of = _fake_fsdp(model, mesh, devices, precision, strategy_options)
            optimizer = optimizer_fn(model.parameters())
            batch = prec.convert_input(_fake_batch(sample, batch_size))
            if strategy == "fsdp":
                tracker = tracker_of(optimizer)
                tracker.track_inputs(batch)
            else:
                tracker = PeakMemTracker()
                tracker.track_external(model, optimizer, *batch)
            with CollectiveLog() as log:
                activations = _traced_steps(model, optimizer, batch, loss_fn, prec.autocast, tracker)
            peak = sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
    return {"peak": int(peak), "activations": int(activations),
            "collectives": per_step(log.collectives, TRACED_STEPS)}


def _mesh(devices: int):
    """A 1-D CPU device mesh of the fake group, built outside ``FakeTensorMode`` (its constructor reads
    its rank tensor's values, which fake tensors do not have)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (devices,))


def _fake_fsdp(model, mesh, devices: int, precision: str, strategy_options: dict | None):
    """Shard ``model`` exactly as the fsdp strategy does; return it and a tracker factory."""
    from trainscale.plan.trackers import PeakFSDPMemTracker
    from trainscale.runtime.precision import Precision
    from trainscale.runtime.strategies.fsdp import FSDPStrategy
    from trainscale.runtime.world import World

    strategy = FSDPStrategy(torch.device("cpu"), World(world_size=devices, local_world_size=devices),
                            precision=Precision(precision, "cpu"), **(strategy_options or {}))
    strategy.shard(model, strategy.units(model), mesh)
    return model, (lambda optimizer: PeakFSDPMemTracker(mod=model, optm=optimizer))
