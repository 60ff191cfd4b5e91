"""Giving each rank its share of a data set.

Training uses ``torch.utils.data.DistributedSampler``: a permutation seeded by ``seed + epoch``,
padded by repeating samples so each rank gets ``ceil(N / world_size)``; rank ``r`` takes
positions ``r, r + W, r + 2W, ...``. So micro-batch ``i`` of all ranks together holds exactly
the samples a single process with a ``W`` times larger batch would take at step ``i`` — the
basis of DDP/single-process parity.

Evaluation uses :class:`UnpaddedDistributedSampler`: no padding, so metrics reduced as sums and
counts never count a sample twice.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from trainscale.runtime.world import World


class UnpaddedDistributedSampler(Sampler[int]):
    """Rank ``r`` of ``W`` takes positions ``r, r + W, ...`` of the (optionally shuffled) indices,
    without padding: ranks hold ``floor(N/W)`` or ``ceil(N/W)`` samples, and every sample once."""

    def __init__(self, dataset, num_replicas: int, rank: int, shuffle: bool = False, seed: int = 0) -> None:
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        return iter(indices[self.rank::self.num_replicas])

    def __len__(self) -> int:
        n = len(self.dataset)
        return max(0, math.ceil((n - self.rank) / self.num_replicas))


_LOADER_ARGS = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout",
                "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor",
                "persistent_workers", "pin_memory_device")


def distribute_dataloader(loader: DataLoader, world: World, *, shuffle: bool | None = None, seed: int = 0,
                          even: bool = True) -> DataLoader:
    """Rebuild ``loader`` with a sampler for this rank (see the module docstring).

    A loader that already has a ``DistributedSampler`` is returned unchanged.

    Raises:
        ValueError: under world size > 1, a loader over an ``IterableDataset`` or with a custom
            sampler or ``batch_sampler`` (it cannot be split safely: shard it yourself and pass
            ``DistributedSampler``).
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"expected a torch.utils.data.DataLoader, got {type(loader).__name__}")
    sampler = loader.sampler
    if isinstance(sampler, (DistributedSampler, UnpaddedDistributedSampler)):
        return loader
    splittable = (not isinstance(loader.dataset, IterableDataset) and loader.batch_size is not None
                  and isinstance(sampler, (SequentialSampler, RandomSampler)))
    if not splittable:
        if world.world_size == 1:
            return loader
        raise ValueError("this DataLoader cannot be split across ranks (an IterableDataset, a custom sampler or "
                         "a batch_sampler); give it a torch.utils.data.DistributedSampler yourself")
    if shuffle is None:
        shuffle = isinstance(sampler, RandomSampler)
    if even:
        new_sampler = DistributedSampler(loader.dataset, num_replicas=world.world_size, rank=world.rank,
                                         shuffle=shuffle, seed=seed, drop_last=False)
    else:
        new_sampler = UnpaddedDistributedSampler(loader.dataset, world.world_size, world.rank, shuffle, seed)
    kwargs = {name: getattr(loader, name) for name in _LOADER_ARGS if hasattr(loader, name)}
    if kwargs.get("num_workers", 0) == 0:  # DataLoader refuses these without workers
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    return DataLoader(loader.dataset, sampler=new_sampler, **kwargs)
