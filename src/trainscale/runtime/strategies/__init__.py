"""Strategies: how a model is replicated or sharded across processes. One file each.

Every strategy follows the small :class:`Strategy` protocol below; they share helpers by
composition (``trainscale.runtime.checkpoint_io``), never by inheriting from one another.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any, ContextManager, Protocol

# name -> "module:Class"; "auto" is resolved by trainscale.runtime.connector.
_IMPLEMENTATIONS = {
    "single": "trainscale.runtime.strategies.single:SingleDeviceStrategy",
    "ddp": "trainscale.runtime.strategies.ddp:DDPStrategy",
    "fsdp": "trainscale.runtime.strategies.fsdp:FSDPStrategy",
    "ddp_spawn": "trainscale.runtime.strategies.ddp_spawn:DDPSpawnStrategy",
    "dp": "trainscale.runtime.strategies.dp:DataParallelStrategy",
}
STRATEGIES = ("auto", *_IMPLEMENTATIONS)
# What ``no_backward_sync`` returns when there is nothing to skip: one stateless, reentrant instance
# for every micro-batch (no object built per step).
SYNC = contextlib.nullcontext()


class Strategy(Protocol):
    """What the Runtime asks of a strategy."""

    name: str
    # Optional: ``checkpoint_suffix`` ("" when checkpoints are directories; ".pt" when absent);
    # ``forward_communicates = True`` when forward runs collectives (fsdp all-gathers), so evaluation
    # must call the wrapped module the same number of times on every rank; and
    # ``clip_gradients_norm(module, max_norm, norm_type) -> Tensor`` when gradients are sharded.

    def setup_module(self, module: Any) -> Any:
        """Move ``module`` to the device and wrap it (DDP, FSDP, ...); return the module to call."""

    def setup_optimizer(self, optimizer: Any) -> Any:
        """Adapt an optimizer built on the wrapped module's parameters (identity for most)."""

    def unwrap(self, module: Any) -> Any:
        """The user's module inside the wrapper."""

    def no_backward_sync(self, module: Any, enabled: bool) -> ContextManager:
        """Skip the gradient all-reduce in backward while ``enabled`` (gradient accumulation)."""

    def save_checkpoint(self, path: Any, state: dict) -> None:
        """Write ``state`` (modules, optimizers, plain values) to ``path`` without corrupting it."""

    def load_checkpoint(self, path: Any, state: dict, verify: bool = True) -> dict:
        """Restore objects of ``state`` in place from ``path``; return the entries not in ``state``.
        ``verify``: check the recorded SHA-256 and refuse a checkpoint without one
        (``checkpoint_io.load_file``)."""

    def teardown(self) -> None:
        """Release what the strategy holds."""


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
