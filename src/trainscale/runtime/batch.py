"""Moving nested batches (tensors in tuples, lists, dicts) between devices and dtypes.

These run once or twice per micro-batch, so they avoid per-call work that costs microseconds in
Python: torch is imported once at module level (only modules that already import torch import this
one), and no closure is built per call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def apply_to_tensors(batch: Any, fn: Callable) -> Any:
    """Apply ``fn`` to every tensor in a nested tuple/list/dict, keeping the structure (named tuples too)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (list, tuple)):
        out = [apply_to_tensors(b, fn) for b in batch]
        return type(batch)(*out) if hasattr(batch, "_fields") else type(batch)(out)
    if isinstance(batch, dict):
        return {k: apply_to_tensors(v, fn) for k, v in batch.items()}
    return batch


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor of ``batch`` to ``device``; a no-op for tensors already there.

    A plain list or tuple of tensors, the DataLoader's usual ``(inputs, targets)``, takes a direct
    path (~1.5 µs instead of ~6 µs for the recursive one, measured with ``timeit`` on CPU).
    """
    kind = type(batch)
    if kind is list or kind is tuple:
        for item in batch:
            if type(item) is not torch.Tensor:
                break
        else:  # no keyword unless needed: Tensor.to parses keywords on a slower path
            return kind([t.to(device, non_blocking=True) for t in batch] if non_blocking else [t.to(device) for t in batch])
    return apply_to_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (tensor, tuple/list or dict)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        return batch_size(next(iter(batch.values())))
    return batch_size(batch[0])


def count_tokens(batch: Any) -> int | None:
    """Tokens in a batch: the element count of ``batch["input_ids"]`` for dict batches, or of the inputs
    of an ``(inputs, targets)`` batch whose inputs are token ids (an int32/int64 tensor of shape (B, T));
    else None."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        return int(batch["input_ids"].numel())
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        inputs = batch[0]
        if inputs.ndim == 2 and inputs.dtype in (torch.int32, torch.int64):
            return int(inputs.numel())
    return None


def batch_counts(batch: Any) -> tuple[int, int | None]:
    """``(batch_size(batch), count_tokens(batch))``: samples, and tokens or None."""
    return batch_size(batch), count_tokens(batch)
