"""Gradient clipping by total norm over gradients sharded on any device mesh (DTensor-aware).

Under model parallelism the gradients are a mix: DTensors on the tensor-parallel mesh, on the
data-parallel mesh (FSDP), on both (2-D), and plain tensors (replicated layers). The norm of the
whole gradient is computed per mesh with ``torch.nn.utils.get_total_norm`` (on DTensors it reduces
the shards' norms across that mesh: a replicated result), the per-mesh norms combined as a p-norm of
norms, then every gradient's local values are scaled by ``min(1, max_norm / (norm + 1e-6))``, the
coefficient of ``torch.nn.utils.clip_grad_norm_`` — torchtitan's
``clip_grad_norm_`` in ``distributed/utils.py`` (v0.1.0) does the same for its meshes.
"""

from __future__ import annotations

from typing import Iterable

import torch


def total_norm(grads: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of all ``grads`` together, as a plain 0-d tensor (no host sync).

    Collectives: one per distinct device mesh among the DTensor gradients; all ranks must call it.
    """
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for g in grads:
        key = g.device_mesh if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(norms, norm_type)


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so their total norm is at most ``max_norm``; return the
    norm before clipping (a plain 0-d tensor). Equal to ``torch.nn.utils.clip_grad_norm_`` on the
    unsharded model."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    norm = total_norm(grads, norm_type)
    # torch's clip_grads_with_norm_ refuses a mix of DTensor and plain gradients (one _foreach_mul_), so
    # each gradient's local values are scaled by the same coefficient, as clip_grad_norm_ computes it
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.device))
    return norm
