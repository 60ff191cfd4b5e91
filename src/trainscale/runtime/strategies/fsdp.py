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

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

from trainscale.runtime import checkpoint_io
from trainscale.runtime.strategies import SYNC, clip_grad_norm
from trainscale.runtime.world import World

_EXTRA = "trainscale_extra.pt"  # the non-sharded entries (loop position, RNG, scheduler, scaler)


def _mixed_precision_policy(precision: str):
    """FSDP2's ``MixedPrecisionPolicy`` for a precision flag.

    "bf16-mixed"/"16-mixed": parameters all-gathered and computed in bf16/fp16, gradients
    reduce-scattered in fp32 (torchtitan's default: low-precision reductions lose accuracy
    with many ranks). Sharded parameters and optimizer states stay fp32. Other precisions:
    no casting ("bf16-true" parameters are already bf16).
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


class _ModelState:
    """DCP ``Stateful`` view of a (sharded) module: its keys are the module's own FQNs."""

    def __init__(self, module) -> None:
        self.module = module

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_state_dict(self, state_dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, state_dict)


class _OptimizerState:
    """DCP ``Stateful`` view of an optimizer, keyed by parameter FQNs of ``module`` (not ids)."""

    def __init__(self, module, optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state_dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, state_dict)


class FSDPStrategy:
    """Shard parameters, gradients and optimizer states across all ranks with FSDP2.

    Options (``strategy_options={...}`` of ``Runtime``/``Trainer``):
        auto_wrap_policy: module classes that become FSDP units, e.g. ``{TransformerBlock}``.
            Each instance is sharded separately (bottom-up), then the root module; a unit's
            parameters are all-gathered only while it runs, so peak memory holds the shards plus
            one unit. Default: none, the whole model is one unit (one all-gather and one
            reduce-scatter per step; no memory saving on the all-gathered parameters).
        reshard_after_forward: free the all-gathered parameters after each unit's forward and
            gather them again in backward (True: less memory, one more all-gather per unit;
            False: ZeRO-2-like). An int ``k`` reshards to a smaller group of ``k`` ranks.
            Default None: FSDP2's default, True for the units and False for the root (whose
            parameters backward needs first).
        cpu_offload: keep sharded parameters, gradients and optimizer states in host memory
            (``CPUOffloadPolicy``); the optimizer step then runs on the CPU. Slower; for models
            whose shards do not fit in accelerator memory.

    The ``MixedPrecisionPolicy`` follows the precision flag (see :func:`_mixed_precision_policy`).
    Checkpoints are directories (DCP) on a file system that all ranks share.

    Raises:
        ValueError: a bad option value, or a world of one process.
    """

    name = "fsdp"
    checkpoint_suffix = ""  # checkpoints are directories
    forward_communicates = True  # forward all-gathers: evaluation goes through the root, same count on every rank

    def __init__(self, device: Any, world: World, precision: str = "32-true",
                 auto_wrap_policy: Iterable[type] | None = None, reshard_after_forward: bool | int | None = None,
                 cpu_offload: bool = False) -> None:
        import torch

        if world.world_size < 2:
            raise ValueError("strategy='fsdp' shards the model across processes and needs a world size >= 2; "
                             "with one device pass strategy='single'")
        policy = () if isinstance(auto_wrap_policy, (str, type)) else tuple(auto_wrap_policy or ())
        bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, torch.nn.Module))]
        if bad or isinstance(auto_wrap_policy, (str, type)):
            raise ValueError(f"auto_wrap_policy={auto_wrap_policy!r} must be a set of nn.Module classes, "
                             "e.g. {nn.TransformerEncoderLayer}")
        if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
            pass
        elif not isinstance(reshard_after_forward, int) or not 1 < reshard_after_forward < world.world_size:
            raise ValueError(f"reshard_after_forward={reshard_after_forward!r} must be None, True, False, or an int "
                             f"k with 1 < k < world size ({world.world_size}) that divides it")
        elif world.world_size % reshard_after_forward:
            raise ValueError(f"reshard_after_forward={reshard_after_forward} must divide the world size "
                             f"{world.world_size}")
        if not isinstance(cpu_offload, bool):
            raise ValueError(f"cpu_offload={cpu_offload!r} must be True or False")
        self.device = device
        self.world = world
        self.precision = precision
        self.auto_wrap_policy = policy
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self._roots: list = []  # modules given to setup_module, to reshard before checkpoints

    # -- model -------------------------------------------------------------------------------
    def setup_module(self, module):
        """Apply ``fully_shard`` to every module of an ``auto_wrap_policy`` class (innermost
        first), then to ``module`` itself; return ``module`` (sharded in place).

        Raises:
            ValueError: the module has no parameters, or a policy class does not occur in it
                (raised identically on every rank, before any communication).
        """
        from torch.distributed.device_mesh import init_device_mesh

        if next(iter(module.parameters()), None) is None:
            raise ValueError(f"strategy='fsdp' got a model with no parameters ({type(module).__name__}); "
                             "there is nothing to shard: check the model, or use strategy='ddp'")
        units = self.units(module)
        if not self.cpu_offload:
            module = module.to(self.device)
        self.shard(module, units, init_device_mesh(self.device.type, (self.world.world_size,)))
        self._roots.append(module)
        return module

    def shard(self, module, units: list, mesh) -> None:
        """``fully_shard`` each of ``units`` (innermost first), then ``module``, over ``mesh`` with this
        strategy's options. Separate from :meth:`setup_module` so that ``trainscale.plan`` can shard a
        model of fake tensors over a mesh built outside ``FakeTensorMode``."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        kwargs = dict(mesh=mesh, reshard_after_forward=self.reshard_after_forward,
                      mp_policy=_mixed_precision_policy(self.precision),
                      offload_policy=CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
                      if self.cpu_offload else OffloadPolicy())
        for unit in reversed(units):  # modules() is pre-order: reversed, every child precedes its parent
            fully_shard(unit, **kwargs)
        fully_shard(module, **kwargs)

    def units(self, module) -> list:
        """The submodules of ``module`` that become FSDP units (instances of ``auto_wrap_policy``), in
        ``modules()`` order.

        Raises:
            ValueError: a policy class does not occur in ``module``.
        """
        units = [m for m in module.modules() if m is not module and isinstance(m, self.auto_wrap_policy)]
        missing = [c.__name__ for c in self.auto_wrap_policy if not any(isinstance(m, c) for m in units)]
        if missing:
            present = sorted({type(m).__name__ for m in module.modules()})
            raise ValueError(f"auto_wrap_policy class(es) {', '.join(missing)} do not occur in the model; "
                             f"its module classes are: {', '.join(present)}")
        return units

    def _reshard(self) -> None:
        """Register the sharded parameters again. A root keeps its gathered parameters after a
        forward without backward (evaluation; FSDP2 does not reshard the root after forward), and
        state dicts and optimizers must see the sharded ones."""
        from torch.distributed.fsdp import FSDPModule

        for root in self._roots:
            for m in root.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

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

    def unwrap(self, module):
        return module  # fully_shard changes the module in place; there is no wrapper

    def no_backward_sync(self, module, enabled: bool):
        """FSDP2's ``set_requires_gradient_sync(False)`` while ``enabled``: gradients accumulate
        unsharded on each rank, with no reduce-scatter, until the boundary micro-batch."""
        if not enabled:
            return SYNC
        if not callable(getattr(module, "set_requires_gradient_sync", None)):
            raise TypeError("no_backward_sync needs the module returned by Runtime.setup (an FSDP module)")
        return self._no_sync(module)

    @staticmethod
    @contextlib.contextmanager
    def _no_sync(module):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def clip_gradients_norm(self, module, max_norm: float, norm_type: float = 2.0):
        """``clip_grad_norm_`` on DTensor gradients: the norm of the full (all shards) gradient.

        ``torch.nn.utils.clip_grad_norm_`` reduces the per-shard norms across the mesh when the
        gradients are DTensors; its result is a replicated DTensor, returned as a plain 0-d tensor.
        """
        norm = clip_grad_norm(module, max_norm, norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def time_allreduce(self, module, clock, record) -> bool:
        return False  # gradients are reduce-scattered inside FSDP's backward hooks, which offer no timing hook

    # -- checkpoints -------------------------------------------------------------------------
    def _split(self, state: dict):
        """DCP ``Stateful``s for modules and optimizers; everything else goes to the extra file."""
        import torch

        modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
        sharded, extra = {}, {}
        for key, value in state.items():
            if isinstance(value, torch.nn.Module):
                sharded[key] = _ModelState(value)
            elif isinstance(value, torch.optim.Optimizer):
                sharded[key] = _OptimizerState(_owner(key, value, modules), value)
            else:
                extra[key] = value
        return sharded, extra

    def save_checkpoint(self, path, state: dict) -> None:
        """Write ``path/`` as a DCP directory: each rank its shards of the modules and optimizers,
        rank zero the other entries (``trainscale_extra.pt`` with its SHA-256).

        Written to ``.<name>.tmp`` first and renamed by rank zero when every rank has finished,
        so a crash leaves no half checkpoint under the final name. A failed write (a full disk:
        "no space left on device") raises on every rank and removes the temporary directory.

        Raises:
            CheckpointError: rank zero could not write the extra file (raised on every rank).
        """
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        tmp = path.parent / f".{path.name}.tmp"
        self._reshard()
        sharded, extra = self._split(state)
        if self.world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        try:
            dcp.save(sharded, checkpoint_id=str(tmp))  # raises on every rank when one rank's write fails
            self._save_extra(extra, tmp / _EXTRA)
        except BaseException:
            if self.world.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.world.rank == 0:
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
            checkpoint_io._fsync_dir(path.parent)

    def _save_extra(self, extra: dict, path: Path) -> None:
        """Rank zero writes ``extra``; its error, if any, is raised on every rank (in place of a barrier,
        which would leave the others waiting for a rank that has raised)."""
        import torch.distributed as dist

        error = [None]
        if self.world.rank == 0:
            try:
                checkpoint_io.save_file({k: (v.state_dict() if checkpoint_io._is_stateful(v) else v)
                                         for k, v in extra.items()}, path)
            except Exception as err:  # noqa: BLE001 - sent to the other ranks, raised below
                error = [f"{type(err).__name__}: {err}"]
                dist.broadcast_object_list(error, src=0)
                raise
        dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise checkpoint_io.CheckpointError(f"rank 0 failed to write the checkpoint: {error[0]}")

    def load_checkpoint(self, path, state: dict, verify: bool = True) -> dict:
        """Restore the modules and optimizers of ``state`` from the DCP directory ``path`` (any
        world size), the other stateful objects from its extra file; return the plain entries.
        ``verify``: check the extra file's SHA-256 and refuse it without one (the shard files
        have no checksum of their own).

        Raises:
            FileNotFoundError: ``path`` does not exist.
            CheckpointError: ``path`` is not a DCP checkpoint directory, the extra file has no
                checksum or does not match it (``verify=True``), or it does not fit.
        """
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
        if path.is_dir() and not (path / ".metadata").is_file():
            raise checkpoint_io.CheckpointError(
                f"checkpoint {str(path)!r} is a directory but not a sharded checkpoint (no .metadata in it); pass "
                "a checkpoint directory <run>/checkpoints/epoch=E-step=S written by strategy='fsdp', or "
                "ckpt_path='last'")
        if not (path / ".metadata").is_file() or not (path / _EXTRA).is_file():
            raise checkpoint_io.CheckpointError(
                f"checkpoint {str(path)!r} is not a sharded (DCP) checkpoint directory written by strategy='fsdp'; "
                "resume a 'single'/'ddp' checkpoint file with that strategy")
        extra = checkpoint_io.load_file(path / _EXTRA, verify)
        self._reshard()
        sharded, others = self._split(state)
        try:
            dcp.load(sharded, checkpoint_id=str(path))
        except Exception as err:  # DCP raises CheckpointException / RuntimeError / KeyError
            raise checkpoint_io.CheckpointError(f"checkpoint {str(path)!r} does not fit the model or optimizer: "
                                                f"{str(err).strip().splitlines()[0][:300]}") from err
        for key, value in others.items():
            if checkpoint_io._is_stateful(value):
                if key not in extra:
                    raise checkpoint_io.CheckpointError(f"checkpoint {str(path)!r} has no entry {key!r}")
                value.load_state_dict(extra[key])
        return {k: v for k, v in extra.items() if not (k in state and checkpoint_io._is_stateful(state[k]))}

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

    def teardown(self) -> None:
        pass


def _owner(key: str, optimizer, modules: dict):
    """The module of ``modules`` that holds all parameters of ``optimizer`` (DCP keys optimizer
    state by that module's parameter names)."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules.values():
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    raise ValueError(f"cannot checkpoint optimizer {key!r} under strategy='fsdp': no module in the same "
                     f"state dict ({', '.join(modules) or 'none'}) holds all its parameters; pass the model too")
