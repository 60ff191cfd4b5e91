"""Pipeline parallelism: the model's layers split into stages, micro-batches flowing through them;
with data parallelism over the other mesh dimensions.

``strategy="pp"`` (or ``"model_parallel"`` with ``parallel={"pp": P, ...}``): the ranks of one
``(pp, dp_replicate, dp_shard, tp)`` mesh (``parallel_dims.py``) at pipeline coordinate ``s``
keep stage ``s`` of the model (``apply_pp.py``: the built-in split of ``trainscale.models.GPT`` or the
user's ``pp_split_points``), and each batch runs through torch's GPipe or 1F1B schedule in
``pp_microbatches`` micro-batches, forward and backward in one ``schedule.step`` (so a loop calls
``Runtime.forward_backward``, not forward then backward). The stages of one pipeline (ranks with the
same data-parallel coordinates) read the same batches (the first needs the inputs, the last the
targets); the loss is computed on the last stage and broadcast, so every rank logs its pipeline's loss.

With ``tp`` > 1, each stage's own layers are split over its tp ranks after the cut by the built-in plan
of ``trainscale.models.GPT``, by the entries of the user's ``tp_plan`` whose modules the stage keeps, or by the
user's ``parallelize(stage, mesh)`` (``apply_tp.py``; torchtitan's order, ``distributed/pipeline_parallel.py``:
``pipeline_module_split``, then ``parallelize_fn`` per stage, TP before FSDP). The activations crossing a
stage boundary are the residual stream as plain local tensors: ``(B, T, C)``, or ``(B, T/tp, C)`` under
sequence parallelism (its Shard(1) local part, which the next stage's first norm takes as it is): each
tp rank sends to and receives from the rank of the same tp coordinate in the neighbouring stage, under
sequence parallelism 1/tp of the activations; torch's ``PipelineStage`` infers those shapes with a first forward and backward. The
tied embedding's gradient is laid out as its parameter (rows split over tp) before it is summed across the
first and last stage (``apply_tp._grad_like_param``).

With ``dp_shard`` or ``dp_replicate`` > 1, each stage is sharded by FSDP2 over the data-parallel
dimensions of the mesh after the cut (and after TP): one unit per ``ModuleList``/``ModuleDict``
entry the stage keeps, then the stage itself (``apply_fsdp.py``); ``dp_replicate`` alone is FSDP2 on a
``(dp_replicate, dp_shard=1)`` mesh: every rank holds the whole stage, gradients are all-reduced (DDP's
arithmetic). torch's ``PipelineStage`` defers FSDP's gradient reduction to the end of each schedule step
(``perform_reduce_grad``), so gradients are averaged over the data-parallel ranks once per step.
Gradients are clipped by the norm over all stages and shards (``dtensor_clip``: per mesh, then summed
across the stage group); checkpoints are DCP directories keyed by the whole model's names
(``dcp_checkpoint.py``), so they load on another number of stages or in one process.

Under "16-mixed" the loss, which exists on the last stage only, is multiplied by the GradScaler's scale inside
the schedule's ``loss_fn`` (``apply_pp.PipelineRunner``), and the Runtime's scaler is torch's ``ShardedGradScaler``
(``precision.py``), whose inf/NaN check is all-reduced over every rank: all stages skip a step, or none.

Each rank idles while the pipeline fills and drains: the bubble, a fraction (P − 1)/(M + P − 1) of
the step for M micro-batches (Huang et al. 2019, "GPipe", §2.2; :func:`bubble_fraction`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from trainscale.runtime import meta_init
from trainscale.runtime.apply import apply_compile
from trainscale.runtime.precision import check_loss_scaling
from trainscale.runtime.strategies.base import ParallelStrategy
from trainscale.runtime.strategies.apply_fsdp import apply_fsdp, reshard
from trainscale.runtime.strategies.apply_pp import (PipelineRunner, gpt_split_points, keep_stage, shared_parameters,
                                                    stage_names, units as model_units)
from trainscale.runtime.strategies.apply_tp import (apply_tp, check_last_unit_output, check_plan_keys,
                                                    check_plan_styles, parallelize_keeping_ties, stage_plan)
from trainscale.runtime.strategies.dcp_checkpoint import DCPCheckpointer
from trainscale.runtime.strategies.dtensor_clip import clip_grad_norm
from trainscale.runtime.strategies.model_parallel import resolve_sequence_parallel
from trainscale.runtime.strategies.parallel_dims import ParallelDims
from trainscale.runtime.world import World


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of a GPipe or 1F1B step each stage idles while the pipeline fills and drains:
    (P − 1)/(M + P − 1) for P stages and M micro-batches of equal cost (Huang et al. 2019, §2.2; 1F1B
    has the same bubble, with fewer activations held: Narayanan et al. 2021, §2.2)."""
    return (stages - 1) / (microbatches + stages - 1)


def stage_units(model: nn.Module, stages: int, split_points: list | None = None) -> list[list[str]]:
    """Each stage's units (``apply_pp.stage_names``) from ``split_points``, or by the built-in split of a
    ``trainscale.models.GPT``, whose last stage also keeps the token embedding: its output projection
    (tied weights). Pure: ``trainscale.plan`` uses it on meta-device models.

    Raises:
        ValueError: no split points for a model that is not a GPT; bad split points.
    """
    from trainscale.models.gpt import GPT

    gpt = isinstance(model, GPT)
    if split_points is None and not gpt:
        raise ValueError(f"pipeline parallelism has a built-in split for trainscale.models.GPT only, and the model "
                         f"is a {type(model).__name__}; pass pp_split_points=[names where stages 2..P begin], e.g. "
                         "['layers.4'] (docs/strategies.md, 'Pipeline split')")
    points = list(split_points) if split_points is not None else gpt_split_points(model, stages)
    names = stage_names(model, points, stages)
    if gpt and "wte" not in names[-1]:
        names[-1].append("wte")
    return names


class PipelineModule(nn.Module):
    """What ``setup`` returns under pipeline parallelism: the module given (its model cut to this rank's
    stage, in place) and the stage's schedules.

    ``forward_backward`` trains on a batch; calling the module as the Trainer's evaluation does
    (``module(batch, batch_idx, stage="validation"|"test")``) evaluates it with the ``loss_fn`` of
    the module given (the Trainer's loop module), and ``stage="predict"`` returns the model's outputs on
    the batch's inputs, on every stage (``dataloader_idx``, the evaluation loader's index, changes nothing here: a
    plain model's steps take none). Plain ``forward`` is refused: under a pipeline no rank holds the
    whole forward.
    """

    def __init__(self, root: nn.Module, runner: PipelineRunner) -> None:
        super().__init__()
        self.root = root
        self.runner = runner  # not a module: its stages reference the model, already registered under root

    def forward(self, batch: Any, batch_idx: int = 0, stage: str = "train", dataloader_idx: int | None = None) -> Any:
        if stage == "predict":  # the inputs of an (inputs, targets) batch, or the batch itself
            return self.runner.predict(batch[0] if isinstance(batch, (tuple, list)) else batch)
        if stage not in ("validation", "test"):
            raise RuntimeError("under strategy='pp' forward and backward run together in the pipeline schedule: "
                               "call runtime.forward_backward(module, batch, loss_fn)")
        inputs, targets = batch
        return self.runner.evaluate(inputs, targets, self.root.loss_fn), int(targets.shape[0])

    def forward_backward(self, batch: Any, loss_fn: Callable, divisor: int = 1, sync: bool = True,
                         scale: Callable | None = None) -> torch.Tensor:
        """See ``Runtime.forward_backward``; ``scale``: the loss scaling of "16-mixed" (``Precision.scale``)."""
        inputs, targets = batch
        return self.runner.train_step(inputs, targets, loss_fn, divisor, sync, scale)


class PipelineStrategy(ParallelStrategy):
    """Pipeline stages on the ``pp`` mesh dimension, each sharded or replicated over the data-parallel ones.

    Args (the Runtime passes them from its own arguments, checked by the resolver):
        precision: the run's ``Precision``: "bf16-mixed" and "16-mixed" run each stage's forward and the loss under
            autocast (and, sharded, FSDP's ``MixedPrecisionPolicy``); "16-mixed" scales the loss inside the
            schedule step (``forward_backward``'s ``scale``); "bf16-true" and "32-true" need nothing here.
        parallel: a ``ParallelDims`` (or a dict of its fields) with ``pp`` > 1.
        pp_schedule: "gpipe" or "1f1b" (default; the same bubble as GPipe, activations of at most P
            micro-batches held instead of M).
        pp_microbatches: micro-batches per batch; None: 4·P (GPipe's advice, M ≥ 4·P, keeps the bubble
            under 20 %). A batch that it does not divide runs in the most micro-batches that divide it.
        pp_split_points: the unit names where stages 1..P−1 begin (``apply_pp.units``); None: the
            built-in split of a ``trainscale.models.GPT``.
        tp_plan: ``{submodule name: ParallelStyle}`` keyed against the whole model (every key must name a
            submodule of it); each stage applies the entries of the modules it keeps after the cut. None: the
            built-in plan of a ``trainscale.models.GPT`` (with tp > 1).
        parallelize: ``fn(stage, mesh)``, called on this rank's stage after the cut (the stage keeps the
            whole model's submodule names; the mesh has the dimensions "pp", "dp_replicate", "dp_shard", "tp");
            it must act in place and return the stage (or None). FSDP is still applied after it.
        sequence_parallel: with tp > 1, sequence parallelism in the built-in GPT plan (``apply_tp.py``);
            None: on where that plan is used.
        compile: ``torch.compile`` keyword arguments (the resolved ``compile`` flag), or None: each block the
            stage keeps (a unit inside a ``ModuleList``/``ModuleDict``, e.g. ``h.0``) is compiled in place.

    Raises:
        ValueError: a world size other than the mesh's; ``sequence_parallel`` not a bool, or True with tp = 1.
    """

    name = "pp"
    sharded_checkpoints = True  # checkpoints are DCP directories
    forward_communicates = True  # a forward sends activations between the stages
    materialises_meta = True
    pipelined = True
    uses_mesh = True
    applies_compile = True  # each block the stage keeps: the schedule calls the stage, never the loop module
    manual_optimization_refusal = "a pipeline schedule (which runs forward and backward by stages)"

    def __init__(self, device: Any, world: World, precision: Any = None, parallel: Any = None,
                 pp_schedule: str = "1f1b", pp_microbatches: int | None = None,
                 pp_split_points: list | None = None, sequence_parallel: bool | None = None,
                 compile: dict | None = None, tp_plan: dict | None = None,
                 parallelize: Callable | None = None) -> None:
        dims = parallel if isinstance(parallel, ParallelDims) else ParallelDims(**(parallel or {}))
        if dims.world_size != world.world_size:
            raise ValueError(f"parallel={dims.as_dict()} multiplies to {dims.world_size} ranks, but the world size is "
                             f"{world.world_size}")
        super().__init__(device, world, precision)
        self.dims = dims
        self.tp_plan, self.parallelize = tp_plan, parallelize
        self.sequence_parallel = resolve_sequence_parallel(sequence_parallel, dims.tp > 1 and tp_plan is None
                                                           and parallelize is None)
        self.schedule, self.split_points, self.compile = pp_schedule, pp_split_points, compile
        self.microbatches = pp_microbatches or 4 * dims.pp
        self.microbatches_given = pp_microbatches is not None  # the default 4·P adapts to a smaller batch
        self.mesh = None
        self._params: set = set()
        self._counted: set = set()  # ids of the parameters whose gradients this stage counts in the norm
        self._roots: list = []  # the FSDP-sharded stage, if any
        self._checkpointer = DCPCheckpointer(world.rank, self.name, before=lambda: reshard(self._roots))

    @classmethod
    def options_from(cls, options, config, flags) -> dict:
        """The user's options, with the mesh and the pipeline's flags (``pp_microbatches`` as the user gave it:
        None lets the pipeline fit its default 4·P to a smaller batch; ``compile`` resolved)."""
        return {**(options or {}), "parallel": config.parallel, "tp_plan": flags.tp_plan,
                "parallelize": flags.parallelize, "pp_schedule": config.pp_schedule,
                "pp_microbatches": flags.pp_microbatches, "pp_split_points": flags.pp_split_points,
                "compile": config.compile}

    @property
    def gradient_sync(self) -> str:
        """FSDP reduce-scatters in backward where there are data-parallel ranks."""
        return "backward" if self.dims.dp_size > 1 else "none"

    def data_world(self, world: World) -> World:
        """The stages of one pipeline read the same batches: the data-parallel rank and size."""
        return dataclasses.replace(world, rank=self.dims.dp_rank(world.rank), world_size=self.dims.dp_size)

    # -- model -------------------------------------------------------------------------------
    def setup_module(self, module):
        """Cut ``module`` (or its child ``model``, the Trainer's loop module's) to this rank's stage in
        place, split its layers over the tp ranks and shard it over the data-parallel ranks (if any);
        return a :class:`PipelineModule` around ``module``.

        Raises:
            ValueError: a model that computes its own loss (``training_step``), no split points for a
                model that is not a GPT, bad split points (``apply_pp.stage_names``); a ``tp_plan`` key that
                names no submodule of the whole model (``apply_tp.check_plan_keys``); with tp > 1 and neither
                ``tp_plan`` nor ``parallelize``, a model that is not a GPT and the GPT's own conditions
                (``apply_tp.apply_tp``); a ``parallelize`` that returns another module; a meta-device model
                that cannot be materialised (``meta_init.check_meta``: with tp > 1 on CPU, for one); under
                "16-mixed", a stage with both tensor-parallel and plain parameters (``precision.check_loss_scaling``).

        A model built on the meta device is cut, split and sharded on meta, then only this rank's part is
        allocated and initialised (its ``init_weights()``); the copies of a tied weight then get the first
        stage's values.
        """
        target = self._target(module)
        names = stage_units(target, self.dims.pp, self.split_points)
        if self.tp_plan is not None:  # against the whole model, before the cut: the same verdict on every rank
            check_plan_styles(self.tp_plan)
            check_plan_keys(target, self.tp_plan)
            check_last_unit_output(target, self.tp_plan, model_units(target)[-1])
        shared = shared_parameters(target, names)
        meta = meta_init.check_meta(module, self.dims.tp > 1, self.device.type)
        self.mesh = self.mesh or self.dims.build_mesh(self.device.type)
        stage = self.dims.pp_rank(self.world.rank)
        keep_stage(target, names[stage])
        # by name: FSDP replaces the parameters (their names stay)
        shared_names = {name: shared[id(p)] for name, p in target.named_parameters() if id(p) in shared}
        module = self._parallelize_stage(module, target, names[stage], meta)
        group = self.mesh.get_group("pp")
        by_name = dict(target.named_parameters())
        if self.precision_name == "16-mixed":
            check_loss_scaling(by_name, self.device, "pipeline stages")
        runner = PipelineRunner(target, stage, self.dims.pp, self.device, group, self.schedule, self.microbatches,
                                _shared_groups(shared_names, by_name, self.mesh), self._autocast(),
                                strict_microbatches=self.microbatches_given, units=names[stage],
                                loss_dtype=torch.float64 if self.precision_name == "64-true" else torch.float32)
        if meta:
            runner.broadcast_shared()  # the copies of a tied weight start equal: the first stage's values
        self._params = {id(p) for p in by_name.values()}
        self._counted = {id(p) for n, p in by_name.items() if n not in shared_names or min(shared_names[n]) == stage}
        return PipelineModule(module, runner)

    def _parallelize_stage(self, module, target: nn.Module, units: list[str], meta: bool):
        """The cut ``target`` (inside ``module``) split over its tp ranks, its blocks compiled (``compile``), then
        sharded over its data-parallel ranks (torchtitan's order), then, if built on the meta device, materialised:
        this rank's stage and shard only, each (stage, shard) seeded apart (``meta_init``). Returns ``module``."""
        if not meta:
            module = module.to(self.device)
        self._tensor_parallel(target)
        if self.compile is not None:  # each block the stage keeps, as torchtitan's apply_compile: the schedule
            for block in [n for n in units if "." in n]:  # calls the stage, never the loop module
                apply_compile(target.get_submodule(block), self.compile)
        if self.dims.dp_size > 1:
            apply_fsdp(target, [target.get_submodule(n) for n in units if "." in n], self._dp_mesh(),
                       precision=self.precision_name)
            self._roots = [target]
        if meta:
            stage, shard = self.dims.pp_rank(self.world.rank), self.dims.coordinates(self.world.rank)[1]
            meta_init.materialise(module, self.device, seed_offset=stage * self.dims.dp_shard + shard)
        return module

    def _tensor_parallel(self, stage: nn.Module) -> None:
        """The stage's own layers split over its tp ranks: by ``parallelize(stage, mesh)``, by the entries of
        ``tp_plan`` whose modules it keeps, or by the built-in GPT plan (``apply_tp.py``); in place.

        Raises:
            ValueError: ``parallelize`` returned another module than the stage.
        """
        if self.parallelize is not None:
            out = parallelize_keeping_ties(self.parallelize, stage, self.mesh)  # the weights it untied tied again
            if out is not None and out is not stage:
                raise ValueError(f"under strategy='pp' parallelize=fn must parallelise the stage it is given in place "
                                 f"(e.g. with parallelize_module) and return it, but it returned a "
                                 f"{type(out).__name__}; return the stage, or None")
        elif self.tp_plan is not None:
            plan = stage_plan(stage, self.tp_plan)
            if plan:  # a stage may hold no planned module
                apply_tp(stage, self.mesh["tp"], plan, whole_output=False)
        elif self.dims.tp > 1:
            apply_tp(stage, self.mesh["tp"], sequence_parallel=self.sequence_parallel)

    def _dp_mesh(self):
        """The data-parallel part of the mesh: ``dp_shard`` (FSDP), or ``(dp_replicate, dp_shard)`` (HSDP;
        with ``dp_shard`` = 1, replication)."""
        return self.mesh["dp_replicate", "dp_shard"] if self.dims.dp_replicate > 1 else self.mesh["dp_shard"]

    def _autocast(self) -> Callable | None:
        """What each stage's forward and the loss run under: the run's autocast ("bf16-mixed", "16-mixed") or
        float64 default dtype ("64-true"), else None."""
        entered = self.precision_name in ("bf16-mixed", "16-mixed", "64-true")
        return self.precision.autocast if entered else None

    def _target(self, module) -> nn.Module:
        """The model to cut: ``module``, or its child ``model`` (the Trainer wraps the user's model).

        Raises:
            ValueError: a model with its own ``training_step``, ``validation_step`` or ``predict_step``; with
                tp > 1 and neither ``tp_plan`` nor ``parallelize``, a model that is not a GPT.
        """
        target = module.model if isinstance(getattr(module, "model", None), nn.Module) else module
        if any(hasattr(target, step) for step in ("training_step", "validation_step", "predict_step")):
            raise ValueError("strategy='pp' computes the loss on the last stage with loss_fn(outputs, targets), but "
                             f"{type(target).__name__} defines training_step/validation_step/predict_step, which "
                             "need the whole model; pass a plain nn.Module and loss_fn (docs/strategies.md, "
                             "'Pipeline split')")
        from trainscale.models.gpt import GPT

        own_plan = self.tp_plan is not None or self.parallelize is not None
        if self.dims.tp > 1 and not own_plan and not isinstance(target, GPT):
            raise ValueError(f"pipeline stages with tp={self.dims.tp} and no tp_plan split each stage by the built-in "
                             f"tensor-parallel plan of trainscale.models.GPT, and the model is a "
                             f"{type(target).__name__}; pass tp_plan={{name: ColwiseParallel() | RowwiseParallel() "
                             "| ...}} or parallelize=fn(stage, mesh), or drop 'tp' (docs/strategies.md, "
                             "'Tensor parallelism inside your pipeline stages')")
        return target

    def setup_optimizer(self, optimizer):
        """Check that ``optimizer`` holds this stage's parameters only.

        Raises:
            ValueError: it was built before ``setup`` on the whole model.
        """
        if any(id(p) not in self._params for group in optimizer.param_groups for p in group["params"]):
            raise ValueError("under strategy='pp' the optimizer must be built after the model is cut into stages: "
                             "pass a factory, e.g. optimizer=lambda params: torch.optim.AdamW(params)")
        return optimizer

    def unwrap(self, module):
        return module.root if isinstance(module, PipelineModule) else module

    # no_backward_sync: the base's no-op. torch's PipelineStage defers FSDP's reduction to the end of each schedule
    # step itself; shared gradients are summed by forward_backward(sync=True).

    def clip_gradients_norm(self, module, max_norm: float, norm_type: float = 2.0):
        """Clip by the norm of the whole model's gradient: each stage's norm combined across the stages,
        a shared weight counted once (``dtensor_clip.clip_grad_norm``)."""
        params = list(module.parameters())
        return clip_grad_norm(params, max_norm, norm_type, across=self.mesh.get_group("pp"),
                              counted=[p for p in params if id(p) in self._counted])

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, path, state: dict, async_group=None):
        """A DCP directory (``dcp_checkpoint.DCPCheckpointer.save``): each stage writes its modules' entries
        under the whole model's names (a shared weight once); with ``async_group``, in the background
        (returns the ``AsyncSave`` that publishes it)."""
        return self._checkpointer.save(path, state, async_group)

    def load_checkpoint(self, path, state: dict, verify: bool = True, before_restore=None, strict: bool = True) -> dict:
        """Restore this stage's entries of ``state`` from a DCP directory; return the plain entries."""
        return self._checkpointer.load(path, state, verify, before_restore, strict)


def _shared_groups(shared: dict[str, list[int]], by_name: dict, mesh: Any) -> list:
    """``[(process group, [parameters])]``: this rank's shared parameters (``{name: [stages holding it]}``)
    grouped by the stages holding them, among the ranks of this rank's pipeline. ``new_group`` is collective:
    every rank makes every pipeline's groups, in the same order, and keeps its own."""
    import torch.distributed as dist

    pipelines = mesh.mesh.reshape(mesh.mesh.shape[0], -1).T.tolist()  # each pipeline's ranks, in stage order
    out = []
    for stages in sorted({tuple(s) for s in shared.values()}):
        sub = mesh.get_group("pp")
        if len(stages) < len(pipelines[0]):
            for ranks in pipelines:
                group = dist.new_group([ranks[s] for s in stages])
                sub = group if dist.get_rank() in ranks else sub
        params = [by_name[name] for name, holders in shared.items() if tuple(holders) == stages]
        if params:
            out.append((sub, params))
    return out
