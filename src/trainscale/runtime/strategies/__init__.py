"""Strategies: how a model is replicated or sharded across processes. One file each.

Every strategy follows the small :class:`Strategy` protocol below; they share helpers by
composition (``trainscale.runtime.checkpoint_io``), never by inheriting from one another.
"""

from __future__ import annotations

import importlib
from typing import Any, ContextManager, Protocol

# name -> "module:Class"; "auto" is resolved by trainscale.runtime.connector.
_IMPLEMENTATIONS = {
    "single": "trainscale.runtime.strategies.single:SingleDeviceStrategy",
    "ddp": "trainscale.runtime.strategies.ddp:DDPStrategy",
    "ddp_spawn": "trainscale.runtime.strategies.ddp_spawn:DDPSpawnStrategy",
    "dp": "trainscale.runtime.strategies.dp:DataParallelStrategy",
}
STRATEGIES = ("auto", *_IMPLEMENTATIONS)


class Strategy(Protocol):
    """What the Runtime asks of a strategy."""

    name: str

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

    def load_checkpoint(self, path: Any, state: dict) -> dict:
        """Restore objects of ``state`` in place from ``path``; return the entries not in ``state``."""

    def teardown(self) -> None:
        """Release what the strategy holds."""


def create_strategy(name: str, **kwargs: Any) -> Strategy:
    """Instantiate strategy ``name`` with ``kwargs`` (device, world and the strategy's options).

    Raises:
        ValueError: unknown name (lists the valid ones), or an option the strategy does not take.
    """
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown strategy={name!r}; choose one of {', '.join(map(repr, STRATEGIES))}")
    module_name, cls_name = _IMPLEMENTATIONS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"strategy={name!r} does not accept these options: {err}") from None
