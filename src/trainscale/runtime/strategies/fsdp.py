"""Fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``).

Each rank keeps 1/N of every parameter, gradient and optimizer state (ZeRO-3; Rajbhandari et
al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"; Zhao et al.
2023, "PyTorch FSDP"). Before a unit's forward and backward its parameters are all-gathered;
after backward its gradients are reduce-scattered, so each rank receives the averaged gradient
of its own shard. Parameters become ``DTensor``s sharded on dim 0 over a 1-D device mesh of all
ranks (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).

Checkpoints are directories written with ``torch.distributed.checkpoint`` (DCP): every rank
writes its own shards, so no rank ever holds the full model; they can be loaded on another
world size. ``save_full_state_dict`` additionally exports plain, unsharded weights on rank zero
for use without trainscale (``nn.Module.load_state_dict``).
"""

from __future__ import annotations

from typing import Any, Iterable

from trainscale.runtime import checkpoint_io, hf, meta_init
from trainscale.runtime.strategies.base import SYNC, ParallelStrategy
from trainscale.runtime.strategies.apply_fsdp import apply_fsdp, fsdp_units, no_gradient_sync, reshard
from trainscale.runtime.strategies.apply_fsdp import mixed_precision_policy as _mixed_precision_policy  # noqa: F401
from trainscale.runtime.strategies.dcp_checkpoint import DCPCheckpointer
from trainscale.runtime.strategies.dtensor_clip import clip_grad_norm
from trainscale.runtime.world import World


class FSDPStrategy(ParallelStrategy):
    """Shard parameters, gradients and optimizer states across all ranks with FSDP2.

    Options (``strategy_options={...}`` of ``Runtime``/``Trainer``):
        auto_wrap_policy: module classes, or class names, that become FSDP units, e.g.
            ``{TransformerBlock}`` or ``{"LlamaDecoderLayer"}``. Each instance is sharded separately
            (bottom-up), then the root module; a unit's parameters are all-gathered only while it runs,
            so peak memory holds the shards plus one unit. Default: a Hugging Face model's
            ``_no_split_modules`` (its decoder layers, as Accelerate's ``TRANSFORMER_BASED_WRAP``);
            for any other model none, the whole model is one unit (one all-gather and one
            reduce-scatter per step; no memory saving on the all-gathered parameters).
        reshard_after_forward: free the all-gathered parameters after each unit's forward and
            gather them again in backward (True: less memory, one more all-gather per unit;
            False: ZeRO-2-like). An int ``k`` reshards to a smaller group of ``k`` ranks.
            Default None: FSDP2's default, True for the units and False for the root (whose
            parameters backward needs first).
        cpu_offload: keep sharded parameters, gradients and optimizer states in host memory
            (``CPUOffloadPolicy``); the optimizer step then runs on the CPU. Slower; for models
            whose shards do not fit in accelerator memory.

    The ``MixedPrecisionPolicy`` follows the run's ``Precision`` (see :func:`_mixed_precision_policy`).
    Checkpoints are directories (DCP) on a file system that all ranks share.

    Raises:
        ValueError: a bad option value, or a world of one process.
    """

    name = "fsdp"
    sharded_checkpoints = True  # checkpoints are DCP directories
    forward_communicates = True  # forward all-gathers: evaluation goes through the root, same count on every rank
    materialises_meta = True  # setup_module takes a model built on the meta device
    gradient_sync = "backward"  # reduce-scattered in backward (a manual optimizer's units: gradient_sync_for)

    def __init__(self, device: Any = None, world: World | None = None, precision: Any = None,
                 auto_wrap_policy: Iterable[type | str] | None = None,
                 reshard_after_forward: bool | int | None = None,
                 cpu_offload: bool = False, **lightning: Any) -> None:
        if world is not None and world.world_size < 2:
            raise ValueError("strategy='fsdp' shards the model across processes and needs a world size >= 2; "
                             "with one device pass strategy='single'")
        policy = _wrap_policy(auto_wrap_policy)
        if world is not None:  # without one (Lightning's FSDPStrategy(...)), checked when the Runtime builds its own
            _check_reshard(reshard_after_forward, world.world_size)
        if not isinstance(cpu_offload, bool):
            raise ValueError(f"cpu_offload={cpu_offload!r} must be True or False")
        super().__init__(device, world, precision, **lightning)
        self.auto_wrap_policy = policy
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self._roots: list = []  # modules given to setup_module, to reshard before checkpoints
        self._checkpointer = DCPCheckpointer(0 if world is None else world.rank, self.name, before=self._reshard)

    # -- model -------------------------------------------------------------------------------
    def setup_module(self, module):
        """Apply ``fully_shard`` to every module of an ``auto_wrap_policy`` class (innermost
        first), then to ``module`` itself; return ``module`` (sharded in place).

        A ``module`` built under ``torch.device("meta")`` is sharded first, then only this rank's
        shards are allocated (``to_empty``) and filled by its ``init_weights()`` or each submodule's
        ``reset_parameters()`` (``trainscale.runtime.meta_init``): per-rank memory ~1/N of the model.
        Seed every rank alike first (the Trainer does): the shards are drawn from the same seed.

        Raises:
            ValueError: the module has no parameters, a policy class does not occur in it, or a meta
                module that could not be initialised (raised identically on every rank, before any
                communication).
        """
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        units = self.units(module)
        meta = meta_init.on_meta(module)
        if meta:  # shard first, then allocate only this rank's shards: the model never exists whole
            meta_init.check_initialisable(module)
        elif not self.cpu_offload:
            module = module.to(self.device)
        self.shard(module, units, init_device_mesh(self.device.type, (self.world.world_size,)))
        if meta:  # every parameter is Shard(0) over all ranks: this rank's shard index is its rank
            meta_init.materialise(module, torch.device("cpu") if self.cpu_offload else self.device,
                                  seed_offset=self.world.rank if self.device.type == "cpu" else None)
        self._roots.append(module)
        return module

    def shard(self, module, units: list, mesh) -> None:
        """``fully_shard`` each of ``units`` (innermost first), then ``module``, over ``mesh`` with this
        strategy's options (``apply_fsdp.apply_fsdp``). Separate from :meth:`setup_module` so that
        ``trainscale.plan`` can shard a model of fake tensors over a mesh built outside ``FakeTensorMode``."""
        apply_fsdp(module, units, mesh, precision=self.precision_name,
                   reshard_after_forward=self.reshard_after_forward, cpu_offload=self.cpu_offload)

    def units(self, module) -> list:
        """The submodules of ``module`` that become FSDP units (``apply_fsdp.fsdp_units``: instances of
        ``auto_wrap_policy``, and the module's ``shard_units`` under manual optimization).

        Raises:
            ValueError: ``module`` has no parameters, or a policy class does not occur in it.
        """
        return fsdp_units(module, self.auto_wrap_policy, self.name)

    def _reshard(self) -> None:
        reshard(self._roots)

    def setup_optimizer(self, optimizer):
        """Check that ``optimizer`` holds the sharded parameters (DTensors).

        Raises:
            ValueError: it was built before sharding (``fully_shard`` replaces the parameters, so
                such an optimizer would update tensors the model no longer uses).
        """
        from torch.distributed.tensor import DTensor

        if any(not isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]):
            raise ValueError("under strategy='fsdp' the optimizer must be built after sharding: pass a factory, "
                             "e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), not an optimizer "
                             "built on model.parameters() before setup")
        return optimizer

    def no_backward_sync(self, module, enabled: bool):
        """FSDP2's ``set_requires_gradient_sync(False)`` while ``enabled``: gradients accumulate
        unsharded on each rank, with no reduce-scatter, until the boundary micro-batch."""
        if not enabled:
            return SYNC
        return no_gradient_sync(module)

    def clip_gradients_norm(self, module, max_norm: float, norm_type: float = 2.0):
        """Clip by the norm of the full (all shards) gradient (``dtensor_clip.clip_grad_norm``: the
        per-shard norms reduced across the mesh); returned as a plain 0-d tensor."""
        return clip_grad_norm(module.parameters(), max_norm, norm_type)

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, path, state: dict, async_group=None):
        """Write ``path/`` as a DCP directory (``dcp_checkpoint.DCPCheckpointer.save``: a full disk raises
        on every rank and leaves no temporary directory); with ``async_group``, in the background (returns
        the ``AsyncSave`` that publishes it)."""
        return self._checkpointer.save(path, state, async_group)

    def load_checkpoint(self, path, state: dict, verify: bool = True, before_restore=None, strict: bool = True) -> dict:
        """Restore ``state`` from the DCP directory ``path`` written on any world size; return the plain
        entries. ``verify``: check the extra file's SHA-256 and refuse it without one
        (``dcp_checkpoint.DCPCheckpointer.load``; raises FileNotFoundError, CheckpointError)."""
        return self._checkpointer.load(path, state, verify, before_restore, strict)

    def save_full_state_dict(self, path, module) -> None:
        """Export ``module``'s full, unsharded weights as one plain ``state_dict`` file on rank
        zero (with SHA-256); load it anywhere with ``model.load_state_dict(torch.load(path))``.
        All ranks must call it (parameters are all-gathered one by one to rank zero's CPU)."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self._reshard()
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.world.rank == 0:
            checkpoint_io.save_file(full, path)
        dist.barrier()

    def load_full_state_dict(self, path, module, verify: bool = True) -> None:
        """Load a plain ``state_dict`` file (e.g. from :meth:`save_full_state_dict` or a
        single-device run) into the sharded ``module``: rank zero reads it and broadcasts each
        tensor, every rank keeps its shard (``broadcast_from_rank0=True``; without it the import
        deadlocks in torch 2.13). All ranks must call it. ``verify``: as in ``checkpoint_io.load_file``
        (a plain ``torch.save`` file has no ``.sha256``: pass ``verify=False`` for one you trust)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = checkpoint_io.load_file(path, verify) if self.world.rank == 0 else {}
        self._reshard()
        set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _wrap_policy(auto_wrap_policy) -> tuple:
    """``auto_wrap_policy`` as a tuple of ``nn.Module`` classes and class names (strings).

    Raises:
        ValueError: anything else (a class or a string alone, a non-module class).
    """
    if auto_wrap_policy is None:
        return ()
    classes, names = hf.split_policy(auto_wrap_policy, "auto_wrap_policy")
    return (*classes, *sorted(names))


def _check_reshard(reshard_after_forward, world_size: int) -> None:
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return
    if not isinstance(reshard_after_forward, int) or not 1 < reshard_after_forward < world_size:
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r} must be None, True, False, or an int "
                         f"k with 1 < k < world size ({world_size}) that divides it")
    if world_size % reshard_after_forward:
        raise ValueError(f"reshard_after_forward={reshard_after_forward} must divide the world size {world_size}")
