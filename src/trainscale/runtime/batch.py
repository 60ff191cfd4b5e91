"""Moving nested batches (tensors in tuples, lists, dicts) between devices and dtypes."""

from __future__ import annotations

from typing import Any, Callable


def apply_to_tensors(batch: Any, fn: Callable) -> Any:
    """Apply ``fn`` to every tensor in a nested tuple/list/dict, keeping the structure."""
    import torch

    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (list, tuple)):
        out = [apply_to_tensors(b, fn) for b in batch]
        return type(batch)(*out) if hasattr(batch, "_fields") else type(batch)(out)
    if isinstance(batch, dict):
        return {k: apply_to_tensors(v, fn) for k, v in batch.items()}
    return batch


def to_device(batch: Any, device, non_blocking: bool = False) -> Any:
    """Move every tensor of ``batch`` to ``device``; a no-op for tensors already there."""
    return apply_to_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (tensor, tuple/list or dict)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        return batch_size(next(iter(batch.values())))
    return batch_size(batch[0])
