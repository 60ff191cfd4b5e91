"""Gradient clipping by total norm over gradients sharded on any device mesh (DTensor-aware).

Under model parallelism the gradients are a mix: DTensors on the tensor-parallel mesh, on the
data-parallel mesh (FSDP), on both (2-D), and plain tensors (replicated layers). The norm of the
whole gradient is computed per mesh with ``torch.nn.utils.get_total_norm`` (on DTensors it reduces
the shards' norms across that mesh: a replicated result), the per-mesh norms combined as a p-norm of
norms, then every gradient's local values are scaled by ``min(1, max_norm / (norm + 1e-6))``, the
coefficient of ``torch.nn.utils.clip_grad_norm_`` — torchtitan's
``clip_grad_norm_`` in ``distributed/utils.py`` (v0.1.0) does the same for its meshes.

Under pipeline parallelism each rank holds other layers: the norms of the stages are combined across
the stage group (``across``) the same way, by an all-reduce of ``norm ** p`` (of the maximum for the
inf-norm), torchtitan's ``pp_mesh`` step; a weight that two stages hold (tied embeddings) is counted
by one of them only (``counted``).
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


def _across(norm: torch.Tensor, norm_type: float, group) -> torch.Tensor:
    """The ``norm_type``-norm of the norms of every rank of ``group`` (collective over ``group``)."""
    import torch.distributed as dist

    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.double() ** norm_type
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / norm_type)).to(norm.dtype)


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *,
                   across=None, counted: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so their total norm is at most ``max_norm``; return the
    norm before clipping (a plain 0-d tensor). Equal to ``torch.nn.utils.clip_grad_norm_`` on the
    unsharded model.

    Args:
        across: None, or a process group whose ranks hold the model's other parts (pipeline stages):
            the norm is that of all their gradients together (a collective over it).
        counted: the parameters whose gradients enter the norm (default: all of ``parameters``); all of
            ``parameters`` are scaled.
    """
    from torch.distributed.tensor import DTensor

    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = total_norm([p.grad for p in (parameters if counted is None else counted) if p.grad is not None], norm_type)
    if across is not None:
        norm = _across(norm, norm_type, across)
    # torch's clip_grads_with_norm_ refuses a mix of DTensor and plain gradients (one _foreach_mul_), so
    # each gradient's local values are scaled by the same coefficient, as clip_grad_norm_ computes it
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.device))
    return norm
