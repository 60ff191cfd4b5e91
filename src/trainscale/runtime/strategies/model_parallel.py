"""Model parallelism on one named device mesh: tensor parallel, FSDP and HSDP composed (torchtitan's way).

``strategy="model_parallel", parallel={"dp_replicate": R, "dp_shard": S, "tp": T}`` (R·S·T = world
size) builds one ``DeviceMesh`` of shape ``(R, S, T)`` (``parallel_dims.py``) and applies parallelism
to the model from outside, by small functions in torchtitan's order (v0.1.0
``models/llama3/infra/parallelize.py``):

1. tensor parallelism over ``tp`` (``apply_tp.py``: the built-in plan for ``trainscale.models.GPT``,
   the user's ``tp_plan``, or the user's ``parallelize(model, mesh)``);
2. activation checkpointing and compile (``runtime/apply.py``, applied by ``Runtime.setup`` before this
   strategy; both act in place and lazily, on what step 1 produced);
3. FSDP over ``dp_shard``, or HSDP over ``(dp_replicate, dp_shard)`` (``apply_fsdp.py``).

Shorthands: ``strategy="hsdp"`` (replicate across nodes, shard within a node) and ``strategy="tp"``
(tensor parallel within a node, FSDP across nodes). The ``tp`` ranks of a group read the same batch:
``Runtime.setup_dataloader`` shards data over the ``dp_replicate · dp_shard`` data-parallel ranks only.
Gradient clipping computes the norm across every mesh (``dtensor_clip.py``); checkpoints are DCP
directories that load on another mesh shape (``dcp_checkpoint.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

from trainscale.runtime import meta_init
from trainscale.runtime.precision import check_loss_scaling
from trainscale.runtime.strategies.base import SYNC, ParallelStrategy
from trainscale.runtime.strategies.apply_fsdp import apply_fsdp, fsdp_units, no_gradient_sync, reshard
from trainscale.runtime.strategies.apply_tp import apply_tp, parallelize_keeping_ties
from trainscale.runtime.strategies.dcp_checkpoint import DCPCheckpointer
from trainscale.runtime.strategies.dtensor_clip import clip_grad_norm
from trainscale.runtime.strategies.parallel_dims import ParallelDims
from trainscale.runtime.world import World


class ModelParallelStrategy(ParallelStrategy):
    """Tensor parallel × FSDP × replication on one device mesh.

    Args (the Runtime passes them from its own arguments; ``parallel`` is already resolved):
        parallel: a ``ParallelDims`` (or a dict of its fields) whose world size is the job's.
        tp_plan: ``{submodule name: ParallelStyle}`` for ``torch.distributed.tensor.parallel.parallelize_module``,
            names relative to your model (``fnmatch`` patterns allowed per name part); None: the built-in
            plan of ``trainscale.models.GPT``.
        parallelize: ``fn(model, mesh) -> model`` replacing step 1 (the mesh has dimensions named
            "dp_replicate", "dp_shard", "tp"; take ``mesh["tp"]``). FSDP/HSDP is still applied after it.
        auto_wrap_policy: module classes that become FSDP units (as for ``strategy="fsdp"``).
        reshard_after_forward: as for ``strategy="fsdp"``.
        sequence_parallel: sequence parallelism in the built-in GPT plan (``apply_tp.py``); None (the
            default) means on wherever that plan is used (tp ≥ 2, no ``tp_plan``/``parallelize``), as in
            torchtitan. A user's plan says it itself, with ``SequenceParallel()`` entries.
        lightning: as for :class:`~trainscale.runtime.strategies.base.Strategy` (``Trainer(strategy=
            ModelParallelStrategy(...))`` takes the last three; ``parallel``, ``tp_plan`` and ``parallelize`` are
            the Trainer's flags).

    The flags are checked by the resolver (``connector._resolve_model_parallel``) before this exists.

    Raises:
        ValueError: a world size other than the mesh's; ``sequence_parallel`` not a bool, or True where the
            built-in GPT plan is not used.
    """

    name = "model_parallel"
    sharded_checkpoints = True  # checkpoints are DCP directories
    forward_communicates = True  # tensor-parallel and FSDP forwards run collectives
    materialises_meta = True
    uses_mesh = True
    needs_process_group = True  # init_device_mesh would start one from env://, unset outside a launcher

    def __init__(self, device: Any = None, world: World | None = None, precision: Any = None, parallel: Any = None,
                 tp_plan: dict | None = None, parallelize: Callable | None = None,
                 auto_wrap_policy: Iterable[type] | None = None, reshard_after_forward: bool | None = None,
                 sequence_parallel: bool | None = None, **lightning: Any) -> None:
        dims = parallel if isinstance(parallel, ParallelDims) else ParallelDims(**(parallel or {}))
        if world is not None and dims.world_size != world.world_size:
            raise ValueError(f"parallel={dims.as_dict()} multiplies to {dims.world_size} ranks, but the world size is "
                             f"{world.world_size}")
        super().__init__(device, world, precision, **lightning)
        self.dims = dims
        self.tp_plan, self.parallelize = tp_plan, parallelize
        builtin_plan = dims.tp > 1 and tp_plan is None and parallelize is None
        self.sequence_parallel = resolve_sequence_parallel(sequence_parallel, builtin_plan)
        if self.precision_name == "16-mixed" and builtin_plan and dims.dp_size == 1 and not self.sequence_parallel:
            raise ValueError("precision='16-mixed' under tp with strategy_options={'sequence_parallel': False}: the "
                             "built-in GPT plan then leaves the norms plain beside DTensors, which torch's GradScaler "
                             "cannot unscale together; keep sequence parallelism on (the default), shard over "
                             "dp_shard (FSDP), or pass precision='bf16-mixed'")
        self.auto_wrap_policy = tuple(auto_wrap_policy or ())
        self.reshard_after_forward = reshard_after_forward
        self.mesh = None
        self._roots: list = []
        self._checkpointer = DCPCheckpointer(0 if world is None else world.rank, self.name,
                                             before=lambda: reshard(self._roots))

    @classmethod
    def options_from(cls, options, config, flags) -> dict:
        """The user's options, with the resolved mesh sizes (``parallel``), ``tp_plan`` and ``parallelize``."""
        return {**(options or {}), "parallel": config.parallel, "tp_plan": flags.tp_plan,
                "parallelize": flags.parallelize}

    @property
    def gradient_sync(self) -> str:
        """FSDP reduce-scatters in backward where there are data-parallel ranks; tp alone has nothing to sync."""
        return "backward" if self.dims.dp_size > 1 else "none"

    def data_world(self, world: World) -> World:
        """``world`` as the data loader must see it: the data-parallel rank and size (tp ranks share data)."""
        return dataclasses.replace(world, rank=self.dims.dp_rank(world.rank), world_size=self.dims.dp_size)

    # -- model -------------------------------------------------------------------------------
    def setup_module(self, module):
        """Tensor-parallelise, then shard ``module`` in place over the mesh; return it.

        A module built on the meta device is materialised after sharding (``meta_init``); on a CPU
        mesh only without tensor parallelism (DTensor's RNG keeps tensor-parallel shards distinct on
        CUDA only).

        Raises:
            ValueError: see :func:`apply_tp` and :func:`fsdp_units`; a meta model with tp > 1 on CPU.
        """
        units = fsdp_units(module, self.auto_wrap_policy, self.name) if self.dims.dp_size > 1 else []
        meta = meta_init.check_meta(module, self.dims.tp > 1, self.device.type)
        if not meta:
            module = module.to(self.device)
        self.mesh = self.mesh or self.dims.build_mesh(self.device.type)
        module = self._parallelize(module, units)
        if meta:  # tp = 1 on CPU: a rank's shard index is its dp_shard coordinate (replicas draw alike)
            offset = self.dims.coordinates(self.world.rank)[1] if self.device.type == "cpu" else None
            meta_init.materialise(module, self.device, seed_offset=offset)
        self._roots.append(module)
        self._params = {id(p) for root in self._roots for p in root.parameters()}
        return module

    def _parallelize(self, module, units: list):
        """The user's ``parallelize(module, mesh)`` or tensor parallelism, then FSDP over the data-parallel
        ranks; without FSDP under "16-mixed", the GradScaler's one-kind check (``check_loss_scaling``)."""
        if self.parallelize is not None:  # then the weights it untied tied again
            out = parallelize_keeping_ties(self.parallelize, module, self.mesh)
            module = module if out is None else out
        elif self.dims.tp > 1:
            apply_tp(module, self.mesh["tp"], self.tp_plan, self.sequence_parallel)
        if self.dims.dp_size > 1:
            dp_mesh = self.mesh["dp_replicate", "dp_shard"] if self.dims.dp_replicate > 1 else self.mesh["dp_shard"]
            apply_fsdp(module, units, dp_mesh, precision=self.precision_name,
                       reshard_after_forward=self.reshard_after_forward)
        elif self.precision_name == "16-mixed":  # tp alone: no FSDP makes every parameter a DTensor
            check_loss_scaling(dict(module.named_parameters()), self.device, "tensor parallelism")
        return module

    def setup_optimizer(self, optimizer):
        """Check that ``optimizer`` holds the parallelised parameters.

        Raises:
            ValueError: it was built before ``setup`` (sharding replaces the parameters).
        """
        if any(id(p) not in self._params for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(f"under strategy={self.name!r} the optimizer must be built after the model is "
                             "parallelised: pass a factory, e.g. optimizer=lambda params: torch.optim.AdamW(params)")
        return optimizer

    def no_backward_sync(self, module, enabled: bool):
        """Under FSDP/HSDP, ``set_requires_gradient_sync(False)`` while ``enabled``; with tensor
        parallelism alone gradients are never synchronised across data-parallel ranks (there are none)."""
        if not enabled or self.dims.dp_size == 1:
            return SYNC
        return no_gradient_sync(module)

    def clip_gradients_norm(self, module, max_norm: float, norm_type: float = 2.0):
        """Clip by the norm of the whole gradient across every mesh dimension (``dtensor_clip``)."""
        return clip_grad_norm(module.parameters(), max_norm, norm_type)

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, path, state: dict, async_group=None):
        """A DCP directory (``dcp_checkpoint.DCPCheckpointer.save``); loads on another mesh shape or in one
        process. With ``async_group``, written in the background (returns the ``AsyncSave`` that publishes it)."""
        return self._checkpointer.save(path, state, async_group)

    def load_checkpoint(self, path, state: dict, verify: bool = True, before_restore=None, strict: bool = True) -> dict:
        """Restore ``state`` from a DCP directory; return the plain entries. ``verify``: check the extra
        file's SHA-256 and refuse it without one (raises FileNotFoundError, CheckpointError)."""
        return self._checkpointer.load(path, state, verify, before_restore, strict)


def resolve_sequence_parallel(flag: bool | None, builtin_plan: bool) -> bool:
    """Whether the built-in GPT plan is applied with sequence parallelism: ``flag``, default on.

    Raises:
        ValueError: ``flag`` not None or a bool; True where the built-in plan is not applied.
    """
    if flag is not None and not isinstance(flag, bool):
        raise ValueError(f"sequence_parallel={flag!r} must be True, False or None (the default: on with the "
                         "built-in GPT plan)")
    if flag and not builtin_plan:
        raise ValueError("sequence_parallel=True applies to the built-in GPT tensor-parallel plan (tp ≥ 2, no "
                         "tp_plan, no parallelize); in your own plan put SequenceParallel() on the norms "
                         "(docs/strategies.md, 'Writing a TP plan')")
    return builtin_plan if flag is None else flag
