"""Transformations applied to the user's module before the strategy wraps it, in one known order.

``prepare_module`` follows torchtitan's ``parallelize`` order (``apply_ac`` → ``apply_compile`` →
``apply_fsdp``/``apply_ddp``, torchtitan v0.1.0 ``models/llama3/infra/parallelize.py``):

1. precision: cast parameters for "bf16-true" (``Precision.convert_module``);
2. ``sync_batchnorm``: BatchNorm → ``torch.nn.SyncBatchNorm`` (ddp on CUDA only, checked by the resolver);
3. activation checkpointing: chosen submodules recompute their forward in backward;
4. compile: ``nn.Module.compile`` (in place) — before the strategy wraps, because
   ``torch.compile(DDP(model))`` silently runs eager while ``DDP(compiled model)`` compiles;
5. the strategy wraps (DDP, DataParallel, ...), in ``Strategy.setup_module``.

Every step keeps the module object and its ``state_dict`` keys, so checkpoints do not depend on the flags.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from trainscale.runtime import hf


def apply_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every ``BatchNorm*d`` by ``SyncBatchNorm`` (statistics all-reduced across ranks).

    Method: ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``. Its forward refuses CPU tensors in
    training under an initialized process group (torch 2.13), hence the resolver allows it on CUDA only.
    """
    return nn.SyncBatchNorm.convert_sync_batchnorm(module)


class _Checkpointed:
    """Replaces a module instance's ``forward``: run the original under non-reentrant
    ``torch.utils.checkpoint.checkpoint``, so its activations are recomputed in backward
    instead of kept (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost")."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(module: nn.Module, classes: tuple) -> nn.Module:
    """Checkpoint every outermost submodule (or ``module`` itself) that is an instance of ``classes`` or whose
    class ``classes`` names (a string, e.g. ``"LlamaDecoderLayer"``).

    The instance's ``forward`` is replaced in place (no wrapper module), so parameter names and
    ``state_dict`` keys stay unchanged. Idempotent.

    Raises:
        ValueError: no submodule is an instance of ``classes`` (the message lists the classes present).
    """
    if not classes:
        return module
    types, names = tuple(c for c in classes if isinstance(c, type)), frozenset(c for c in classes if isinstance(c, str))
    found = 0
    stack = [module]
    while stack:
        sub = stack.pop()
        if hf.class_matches(sub, types, names):
            found += 1
            if not isinstance(sub.__dict__.get("forward"), _Checkpointed):
                sub.forward = _Checkpointed(sub.forward)
            continue  # nested matches are inside a checkpointed region already
        stack.extend(sub.children())
    if not found:
        present = sorted({type(m).__name__ for m in module.modules()})
        raise ValueError(f"activation_checkpointing={{{', '.join(getattr(c, '__name__', c) for c in classes)}}} "
                         "matches no module "
                         f"of the model; its module classes are: {', '.join(present)}")
    return module


def apply_compile(module: nn.Module, options: dict) -> nn.Module:
    """``module.compile(**options)``: compile the module's ``__call__`` in place with ``torch.compile``
    (https://pytorch.org/docs/stable/generated/torch.compile.html). The object and its
    ``state_dict`` keys stay the same (no ``_orig_mod.`` prefix)."""
    module.compile(**options)
    return module


def prepare_module(module: nn.Module, *, precision: Any, sync_batchnorm: bool = False,
                   activation_checkpointing: tuple = (), compile: dict | None = None) -> nn.Module:
    """Apply, in order, precision → sync BatchNorm → activation checkpointing → compile.

    Args:
        module: the user's module (not yet wrapped by a strategy).
        precision: a ``trainscale.runtime.precision.Precision``.
        sync_batchnorm, activation_checkpointing, compile: resolved flags (``RunConfig``).

    Returns:
        The module to hand to ``Strategy.setup_module``.
    """
    module = precision.convert_module(module)
    if sync_batchnorm:
        module = apply_sync_batchnorm(module)
    module = apply_activation_checkpointing(module, activation_checkpointing)
    if compile is not None:
        module = apply_compile(module, compile)
    return module


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was applied (``nn.Module._compiled_call_impl`` is set)."""
    return getattr(module, "_compiled_call_impl", None) is not None
