"""Copying the next batch to a CUDA device while the current one trains.

The pattern of NVIDIA's data prefetchers (apex ``data_prefetcher``): the next batch's host-to-device
copy is issued on a side CUDA stream before the current batch is handed to the loop, the loop's stream
waits for that copy only when it takes the batch, and ``Tensor.record_stream`` tells the caching
allocator that the copied tensors are used on the loop's stream. The copy overlaps the current step
only from pinned host memory (``Runtime.setup_dataloader`` pins by default on CUDA).
https://pytorch.org/docs/stable/notes/cuda.html#cuda-streams
https://pytorch.org/docs/stable/generated/torch.Tensor.record_stream.html

GPU-only: not run on a machine without CUDA (``Runtime.prefetch`` returns the batches as they are
on other devices); its test is marked ``gpu``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from trainscale.runtime.batch import tensors

_END = object()


def prefetch_to_cuda(batches: Iterable, move: Callable[[Any], Any], device: torch.device) -> Iterator:
    """Yield ``move(batch)`` for each batch of ``batches``, each copy issued one batch ahead on a side stream.

    Args:
        batches: any iterable of (nested) batches, e.g. a DataLoader or its iterator.
        move: puts one batch on ``device`` (``Runtime.to_device``: non-blocking copies, dtype casts).
        device: a CUDA device.
    """
    stream = torch.cuda.Stream(device=device)
    source = iter(batches)

    def load() -> Any:
        batch = next(source, _END)
        if batch is _END:
            return _END
        with torch.cuda.stream(stream):
            return move(batch)

    upcoming = load()
    while upcoming is not _END:
        current = torch.cuda.current_stream(device)
        current.wait_stream(stream)  # the loop's kernels start after this batch's copy ends
        batch = upcoming
        for tensor in tensors(batch):  # the same walk as to_device's, into objects moved by their own .to
            if tensor.device.type == device.type:  # some stay on the host (a PackedSequence's batch_sizes)
                tensor.record_stream(current)
        upcoming = load()  # the next copy runs while the loop trains on this batch
        yield batch
