"""Strategies: how a model is replicated or sharded across processes. One file each.

Every strategy follows the small :class:`Strategy` protocol below; they share helpers by
composition (``trainscale.runtime.checkpoint_io``), never by inheriting from one another.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any, Callable, ContextManager, Protocol

# name -> "module:Class"; "auto" is resolved by trainscale.runtime.connector, and so are "ddp_spawn" and
# "ddp_notebook": ddp with the processes started by torch.multiprocessing (a start method, runtime/spawn.py).
_IMPLEMENTATIONS = {
    "single": "trainscale.runtime.strategies.single:SingleDeviceStrategy",
    "ddp": "trainscale.runtime.strategies.ddp:DDPStrategy",
    "fsdp": "trainscale.runtime.strategies.fsdp:FSDPStrategy",
    "dp": "trainscale.runtime.strategies.dp:DataParallelStrategy",
    # one strategy on one device mesh; "hsdp" and "tp" are layouts of it (runtime/connector.py)
    "model_parallel": "trainscale.runtime.strategies.model_parallel:ModelParallelStrategy",
    "hsdp": "trainscale.runtime.strategies.model_parallel:ModelParallelStrategy",
    "tp": "trainscale.runtime.strategies.model_parallel:ModelParallelStrategy",
    # pipeline stages (parallel={"pp": P}); the resolver also maps "model_parallel" with pp > 1 here
    "pp": "trainscale.runtime.strategies.pipeline:PipelineStrategy",
}
MODEL_PARALLEL = ("model_parallel", "hsdp", "tp", "pp")
# strategies whose checkpoints are DCP directories, each rank writing its shards: they can also write in the background
SHARDED_CHECKPOINTS = ("fsdp", *MODEL_PARALLEL)
STRATEGIES = ("auto", *_IMPLEMENTATIONS)
# What ``no_backward_sync`` returns when there is nothing to skip: one stateless, reentrant instance
# for every micro-batch (no object built per step).
SYNC = contextlib.nullcontext()


class Strategy(Protocol):
    """What the Runtime, the Trainer and telemetry ask of a strategy: every member they use is declared
    here, and every implementation defines each one itself (tests/test_strategy_protocol.py), so callers
    never probe with ``getattr``/``hasattr``.

    Attributes:
        name: the strategy's flag ("single", "ddp", "fsdp", "dp", "model_parallel", "hsdp", "tp", "pp").
        checkpoint_suffix: the suffix of a checkpoint path: ".pt" for one file, "" for a directory
            (fsdp's sharded DCP checkpoints).
        forward_communicates: True when forward runs collectives (fsdp all-gathers parameters), so
            evaluation must call the wrapped module equally often on every rank.
        materialises_meta: True when ``setup_module`` accepts a model built on the meta device (it shards,
            then allocates and initialises only this rank's shards: ``runtime/meta_init.py``).
        pipelined: True when forward and backward run together in a pipeline schedule: a loop calls
            ``Runtime.forward_backward`` instead of calling the module and then ``backward`` ("pp").
    """

    name: str
    checkpoint_suffix: str
    forward_communicates: bool
    materialises_meta: bool
    pipelined: bool

    def setup_module(self, module: Any) -> Any:
        """Move ``module`` to the device and wrap it (DDP, FSDP, ...); return the module to call."""

    def setup_optimizer(self, optimizer: Any) -> Any:
        """Adapt an optimizer built on the wrapped module's parameters (identity for most)."""

    def unwrap(self, module: Any) -> Any:
        """The user's module inside the wrapper."""

    def no_backward_sync(self, module: Any, enabled: bool) -> ContextManager:
        """Skip the gradient all-reduce in backward while ``enabled`` (gradient accumulation)."""

    def clip_gradients_norm(self, module: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        """Scale the gradients of ``module`` so that their total ``norm_type``-norm over all ranks' shards is
        at most ``max_norm``; return that norm before clipping (a 0-d tensor, not synced to the host)."""

    def time_allreduce(self, module: Any, clock: Callable[[], Any], record: Callable[[Any, Any], None]) -> bool:
        """Have ``record(start, end)`` called with ``clock()`` readings around each gradient all-reduce of
        ``module`` (the wrapped module; call once, before the first backward). Returns False when nothing
        will be timed (no all-reduce of its own, or a communication hook registered outside trainscale)."""

    def save_checkpoint(self, path: Any, state: dict, async_group: Any = None) -> Any:
        """Write ``state`` (modules, optimizers, plain values) to ``path`` without corrupting it. With
        ``async_group`` (a gloo process group of all ranks; strategies of :data:`SHARDED_CHECKPOINTS` only,
        the others raise :func:`check_async_save`'s error) return once the state is staged and let a thread
        write it: returns the ``dcp_checkpoint.AsyncSave`` whose ``wait()`` publishes it (otherwise None)."""

    def load_checkpoint(self, path: Any, state: dict, verify: bool = True) -> dict:
        """Restore objects of ``state`` in place from ``path``; return the entries not in ``state``.
        ``verify``: check the recorded SHA-256 and refuse a checkpoint without one
        (``checkpoint_io.load_file``)."""

    def data_world(self, world: Any) -> Any:
        """The rank and world size (a ``World``) the data loader's sampler must use: ``world`` itself when
        every rank reads different data; the data-parallel ranks when some share their batches (tensor
        parallelism)."""

    def teardown(self) -> None:
        """Release what the strategy holds."""


def clip_grad_norm(module: Any, max_norm: float, norm_type: float = 2.0) -> Any:
    """``torch.nn.utils.clip_grad_norm_`` over the parameters of ``module`` that have a gradient: the
    ``clip_gradients_norm`` of strategies whose gradients are whole tensors (all-reduced, or one process).
    With DTensor gradients (fsdp) torch reduces the per-shard norms across the mesh itself."""
    import torch

    params = [p for p in module.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)


def check_async_save(strategy: str) -> None:
    """Raise unless ``strategy`` can write checkpoints in the background (``checkpoint_async=True``).

    Raises:
        ValueError: a strategy whose checkpoints are one file written by rank zero (single, ddp, dp).
    """
    if strategy not in SHARDED_CHECKPOINTS:
        raise ValueError(f"checkpoint_async=True writes sharded (DCP) checkpoints in the background, but "
                         f"strategy={strategy!r} writes one file from rank zero; use a sharded strategy "
                         f"({', '.join(map(repr, SHARDED_CHECKPOINTS))}) or checkpoint_async=False")


_COMMON = ("device", "world", "precision")


def create_strategy(name: str, *, device: Any, world: Any, precision: str = "32-true", **options: Any) -> Strategy:
    """Instantiate strategy ``name`` on ``device``/``world`` with the strategy's ``options``.

    ``precision`` (the flag's name) is passed only to strategies whose constructor takes it
    (fsdp derives its ``MixedPrecisionPolicy`` from it).

    Raises:
        ValueError: unknown name (lists the valid ones), or an option the strategy does not
            take (lists the ones it takes).
    """
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown strategy={name!r}; choose one of {', '.join(map(repr, STRATEGIES))}")
    module_name, cls_name = _IMPLEMENTATIONS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    accepted = inspect.signature(cls).parameters
    valid = [p for p in accepted if p not in _COMMON]
    unknown = [k for k in options if k not in valid]
    if unknown:
        raise ValueError(f"strategy={name!r} does not accept option(s) {', '.join(map(repr, unknown))}; "
                         f"its options are: {', '.join(valid) or 'none'}")
    common = {"device": device, "world": world, **({"precision": precision} if "precision" in accepted else {})}
    return cls(**common, **options)
