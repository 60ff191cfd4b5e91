"""Giving each rank its share of a data set.

Training uses :class:`ResumableDistributedSampler`, which gives exactly the order of
``torch.utils.data.DistributedSampler`` (a permutation seeded by ``seed + epoch``, padded by
repeating samples so each rank gets the same count; rank ``r`` takes positions ``r, r + W, ...``)
and can also start part-way through an epoch. So micro-batch ``i`` of all ranks together holds
exactly the samples a single process with a ``W`` times larger batch would take at step ``i`` — the
basis of DDP/single-process parity — and a resumed run continues with the next unseen sample.

Evaluation uses :class:`UnpaddedDistributedSampler`: no padding, so metrics reduced as sums and
counts never count a sample twice.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from trainscale.runtime.iterable_shard import ShardedIterableLoader
from trainscale.runtime.world import World


class ResumableDistributedSampler(Sampler[int]):
    """``DistributedSampler``'s order, startable at a position counted in samples of the epoch.

    The epoch's sequence is ``randperm(N, seed + epoch)`` (or ``range(N)`` without shuffling).
    ``set_epoch(epoch, consumed)`` makes the next iteration skip the first ``consumed`` positions of
    that sequence — the samples all ranks together took before a checkpoint, a number that does not
    depend on the world size — and split the rest across the *current* world: rank ``r`` of ``W``
    takes positions ``consumed + r, consumed + r + W, ...``. The rest is padded (by repeating the
    epoch's first samples, as ``DistributedSampler`` does) only up to a multiple of ``W``, so every
    rank runs the same number of steps; with ``consumed=0`` the order equals
    ``DistributedSampler(drop_last=False)``'s, element for element. Resuming on another world size
    (2 → 1, 1 → 2) therefore neither loses nor repeats a sample, apart from that end-of-epoch padding.

    Args:
        dataset: a map-style data set (``len`` and integer indexing).
        num_replicas: world size ``W``.
        rank: this rank, ``0 <= rank < W``.
        shuffle: shuffle each epoch with ``seed + epoch``.
        seed: the same on every rank.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must lie in [0, num_replicas={num_replicas})")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.consumed = 0

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """Iterate epoch ``epoch`` from position ``consumed`` (samples of all ranks already trained on)."""
        n = len(self.dataset)
        if not 0 <= consumed <= n:
            raise ValueError(f"consumed={consumed} must lie in [0, len(dataset)={n}]: the checkpoint resumes this "
                             f"epoch after {consumed} samples but the data set now holds {n} (it shrank); resume "
                             "with the data set the checkpoint was written with, or start fresh (ckpt_path=None)")
        self.epoch, self.consumed = epoch, consumed

    def epoch_indices(self) -> list[int]:
        """The epoch's whole sequence of data set indices, before any split (length N)."""
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _remaining(self) -> list[int]:
        indices = self.epoch_indices()
        rest = indices[self.consumed:]
        padding = -len(rest) % self.num_replicas
        while padding > 0 and indices:  # DistributedSampler's padding: repeat from the epoch's start
            rest += indices[:padding]
            padding = -len(rest) % self.num_replicas
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return math.ceil((len(self.dataset) - self.consumed) / self.num_replicas)

    def consumed_after(self, batches: int, batch_size: int) -> int:
        """Position in the epoch (samples of all ranks) after ``batches`` micro-batches of
        ``batch_size`` per rank since the last :meth:`set_epoch`; at most ``len(dataset)``."""
        return min(len(self.dataset), self.consumed + batches * batch_size * self.num_replicas)


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


def _loader_kwargs(loader: DataLoader) -> dict:
    """The arguments that rebuild ``loader`` (without its dataset and sampler)."""
    kwargs = {name: getattr(loader, name) for name in _LOADER_ARGS if hasattr(loader, name)}
    if kwargs.get("num_workers", 0) == 0:  # DataLoader refuses these without workers
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    return kwargs


def with_batch_size(loader: DataLoader, batch_size: int) -> DataLoader:
    """``loader`` rebuilt with another ``batch_size``: the same dataset, sampler, ``collate_fn``,
    workers and other arguments (what ``Trainer(batch_size="max")`` does with the size it found).

    Raises:
        ValueError: a loader without ``batch_size`` (a ``batch_sampler`` of its own decides the batches).
    """
    if loader.batch_size is None:
        raise ValueError("this DataLoader has a batch_sampler of its own, so its batch size cannot be changed; "
                         "give it batch_size=... and a sampler, or choose the batch size yourself")
    return DataLoader(loader.dataset, sampler=loader.sampler, **{**_loader_kwargs(loader), "batch_size": batch_size})


def in_order(loader: DataLoader) -> DataLoader:
    """``loader`` rebuilt with a ``SequentialSampler`` over its dataset (its other arguments kept): what
    ``overfit_batches`` reads, the same first batches every epoch (Lightning's ``_resolve_overfit_batches``)."""
    return DataLoader(loader.dataset, sampler=SequentialSampler(loader.dataset), **_loader_kwargs(loader))


def with_pinned_memory(loader: DataLoader) -> DataLoader:
    """``loader`` rebuilt with ``pin_memory=True``: the same dataset, sampler (or batch sampler) and other arguments,
    so that its batches come in page-locked memory, which a ``non_blocking`` copy to a CUDA device needs to be
    asynchronous. A loader that pins already, or of a DataLoader subclass (whose ``__init__`` may take other
    arguments), is returned as given."""
    if loader.pin_memory or type(loader) is not DataLoader:
        return loader
    kwargs = {**_loader_kwargs(loader), "pin_memory": True}
    if isinstance(loader.dataset, IterableDataset):  # no sampler: the data set yields the samples itself
        return DataLoader(loader.dataset, **kwargs)
    if loader.batch_size is None and loader.batch_sampler is not None:  # the user's own batch_sampler
        return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler,
                          **{**kwargs, "batch_size": 1, "drop_last": False})  # DataLoader's defaults: required
    return DataLoader(loader.dataset, sampler=loader.sampler, **kwargs)


class IndexRecordingBatchSampler:
    """A loader's batch sampler that notes the sample indices of every batch it yields, in ``seen`` (batches x
    indices; emptied in place when an iteration starts), as Lightning's ``_IndexBatchSamplerWrapper``: what
    ``BasePredictionWriter`` gets as ``batch_indices``."""

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.seen: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        self.seen.clear()
        for batch in self.batch_sampler:
            self.seen.append(list(batch))
            yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)


def with_index_recording(loader: Any) -> tuple[Any, list[list[int]]]:
    """``(loader rebuilt with an :class:`IndexRecordingBatchSampler`, its ``seen`` list)`` for a map-style
    ``DataLoader``; ``(loader, [])`` for one whose batches have no indices (an ``IterableDataset``, a loader of another
    class), where Lightning gives no indices either."""
    if type(loader) is not DataLoader or isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is None:
        return loader, []
    recorder = IndexRecordingBatchSampler(loader.batch_sampler)
    rebuilt = DataLoader(loader.dataset, batch_sampler=recorder,
                         **{**_loader_kwargs(loader), "batch_size": 1, "drop_last": False})  # DataLoader's defaults
    return rebuilt, recorder.seen


def _unsplittable(loader: DataLoader, world: World, even: bool) -> Any:
    """``loader`` unchanged at world size 1 or for an ``IterableDataset`` with ``shards_by_rank = True``; an
    ``IterableDataset``'s loader shared by batches (``iterable_shard.ShardedIterableLoader``, said once on rank 0);
    else a ``ValueError`` naming the fix."""
    iterable = isinstance(loader.dataset, IterableDataset)
    if world.world_size == 1 or (iterable and getattr(loader.dataset, "shards_by_rank", False) is True):
        return loader
    if iterable:
        if world.rank == 0:
            dropped = ("the last round of fewer than that is dropped, so every rank runs the same number of steps"
                       if even else "none is dropped")
            warnings.warn(f"trainscale: {type(loader.dataset).__name__} is an IterableDataset: every rank reads it "
                          f"whole and rank r of {world.world_size} keeps batches r, r + {world.world_size}, ... "
                          f"({dropped}); a data set that yields only its rank's share sets shards_by_rank = True",
                          stacklevel=4)
        return ShardedIterableLoader(loader, world.rank, world.world_size, even)
    raise ValueError("this DataLoader cannot be split across ranks (a custom sampler or a batch_sampler); "
                     "give it a torch.utils.data.DistributedSampler yourself")


def _is_random(sampler: Sampler) -> bool:
    """torch's ``RandomSampler``, or torchdata's (a ``StatefulDataLoader(shuffle=True)`` makes one; not a subclass
    of torch's), which trainscale's sampler replaces alike: it resumes by sample count on any world size."""
    stateful = sys.modules.get("torchdata.stateful_dataloader.sampler")  # imported when torchdata's loader was
    return isinstance(sampler, RandomSampler) or (stateful is not None and isinstance(sampler, stateful.RandomSampler))


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on ``loader.sampler`` and on ``loader.batch_sampler.sampler``, each object once, where it
    has one, as Lightning's ``_set_sampler_epoch`` (lightning/fabric/utilities/data.py): a loader built with a
    ``batch_sampler`` keeps its sampler there (its ``loader.sampler`` is DataLoader's default), and a
    ``DistributedSampler`` or any epoch-seeded sampler inside it reshuffles only when told the epoch."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    told: list = []
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)) and not any(sampler is s for s in told):
            told.append(sampler)
            sampler.set_epoch(epoch)


def distribute_dataloader(loader: DataLoader, world: World, *, shuffle: bool | None = None, seed: int = 0,
                          even: bool = True) -> DataLoader:
    """Rebuild ``loader`` with a sampler for this rank (see the module docstring).

    A loader that already has a ``DistributedSampler`` is returned unchanged, and so are an evaluation loader
    (``even=False``) with a ``SequentialSampler`` on one rank (nothing to split or reorder) and one over an
    ``IterableDataset`` that declares ``shards_by_rank = True`` (it yields only this rank's share
    itself: docs/strategies.md, "Iterable datasets"); any other ``IterableDataset``'s loader is shared by
    batches, rank r keeping batches r, r + W, ... (``iterable_shard.ShardedIterableLoader``; with ``even``, the
    last incomplete round dropped), which rank 0 says once in a warning. A torchdata ``StatefulDataLoader`` over an
    iterable keeps its own position (``checkpointing/loader_state.py``). A map-style loader with a sequential or
    random sampler (torch's or torchdata's) is rebuilt as a ``DataLoader`` with trainscale's sampler.

    Raises:
        ValueError: under world size > 1, a map-style loader with a custom sampler or ``batch_sampler`` (naming
            ``DistributedSampler``).
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"expected a torch.utils.data.DataLoader, got {type(loader).__name__}")
    sampler = loader.sampler
    if isinstance(sampler, (DistributedSampler, ResumableDistributedSampler, UnpaddedDistributedSampler)):
        return loader
    if not even and world.world_size == 1 and isinstance(sampler, SequentialSampler) and not shuffle:
        return loader
    splittable = (not isinstance(loader.dataset, IterableDataset) and loader.batch_size is not None
                  and (isinstance(sampler, SequentialSampler) or _is_random(sampler)))
    if not splittable:
        return _unsplittable(loader, world, even)
    if shuffle is None:
        shuffle = _is_random(sampler)
    if even:
        new_sampler = ResumableDistributedSampler(loader.dataset, world.world_size, world.rank, shuffle, seed)
    else:
        new_sampler = UnpaddedDistributedSampler(loader.dataset, world.world_size, world.rank, shuffle, seed)
    return DataLoader(loader.dataset, sampler=new_sampler, **_loader_kwargs(loader))


def check_equal_lengths(loader: DataLoader, world: World, device: torch.device | str = "cpu") -> None:
    """Under world size > 1, check that every rank's ``loader`` has the same number of batches.

    Ranks that run different numbers of steps call different collectives at the end of the shorter
    epoch (gloo: "collective mismatch"; NCCL: a hang until the timeout), so this names the cause
    before the first step. One all-reduce of two integers (the largest length and minus the smallest),
    so its cost per rank does not grow with the world size; only when the lengths differ are they
    gathered (``all_gather_object``) to name each rank's. Call it on every rank. A loader without
    ``len`` (an IterableDataset without ``__len__``) is not checked.

    Args:
        device: where the all-reduce's tensor lives: the rank's device (NCCL reduces CUDA tensors only).

    Raises:
        ValueError: on every rank, naming each rank's number of batches and the fix.
    """
    if world.world_size == 1 or not dist.is_available() or not dist.is_initialized():
        return
    try:
        mine = len(loader)
    except TypeError:
        mine = None
    code = -1 if mine is None else mine  # a loader without len: -1, so that a mix of both counts as uneven
    extremes = torch.tensor([code, -code], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    if int(extremes[0]) == -int(extremes[1]):
        return
    lengths: list = [None] * world.world_size
    dist.all_gather_object(lengths, mine)
    per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
    raise ValueError(
        f"the training DataLoader gives the ranks different numbers of batches per epoch ({per_rank}); every rank "
        f"must run the same number of steps, or the ranks' collectives stop matching mid-epoch. Use "
        f"torch.utils.data.DistributedSampler (it pads every rank to the same length; drop_last=True drops the "
        f"remainder instead), or let trainscale add one (a sequential or random sampler); a dataset with "
        f"shards_by_rank = True must yield the same number of samples on every rank")
