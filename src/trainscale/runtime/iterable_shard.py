"""An ``IterableDataset``'s loader shared by the ranks: rank ``r`` of ``W`` keeps batches ``r, r + W, r + 2W, ...``.

A sampler cannot split an iterable (it has no indices), so every rank iterates the whole loader, in the same
order, and keeps its own batches of each round of ``W`` (Accelerate's ``IterableDatasetShard`` does the same with
samples; https://huggingface.co/docs/accelerate/package_reference/torch_wrappers). The data set must yield the
same samples in the same order on every rank (seed its randomness alike); a data set that yields only its rank's
share itself declares ``shards_by_rank = True`` and is left alone (``sampling.distribute_dataloader``).

Training (``even=True``): a batch is yielded only once its whole round has been read, so the last, incomplete
round of an epoch (fewer than ``W`` batches) is dropped on every rank alike: every rank runs the same number of
steps without any communication. The loader's position is then always a round boundary, so a loader that keeps its
own state (torchdata's ``StatefulDataLoader``) resumes exactly from its ``state_dict()``, and one that does not is
resumed by skipping the rank's batches already trained (rounds). Evaluation (``even=False``): the incomplete round
is kept (each batch on one rank, none dropped; ranks may differ by one batch).
"""

from __future__ import annotations

from typing import Any, Iterator


class ShardedIterableLoader:
    """``loader`` (a DataLoader over an ``IterableDataset``) of which this rank keeps every ``world_size``-th batch,
    starting at ``rank``. Other attributes (``dataset``, ``batch_size``, ``state_dict``, ...) are ``loader``'s;
    it has no ``len`` (an iterable's epoch ends when its iterator does).

    Args:
        loader: the DataLoader every rank iterates whole.
        rank, world_size: this rank and the number of ranks that read different data.
        even: drop the last incomplete round (training: the same number of batches on every rank).
    """

    def __init__(self, loader: Any, rank: int, world_size: int, even: bool = True) -> None:
        self.loader, self.rank, self.world_size, self.even = loader, rank, world_size, even

    def __iter__(self) -> Iterator[Any]:
        mine, read = None, 0
        for batch in self.loader:
            if read == self.rank:
                mine = batch
            read += 1
            if read == self.world_size:  # a whole round read: every rank has its batch of it
                yield mine
                mine, read = None, 0
        if read > self.rank and not self.even:
            yield mine

    @property
    def pin_memory(self) -> bool:
        return self.loader.pin_memory

    @pin_memory.setter
    def pin_memory(self, value: bool) -> None:
        """Pinned batches from a pinning copy of the loader (``sampling.with_pinned_memory``); never unpins."""
        if value:
            from trainscale.runtime.sampling import with_pinned_memory

            self.loader = with_pinned_memory(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)
