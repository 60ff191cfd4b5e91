"""The training loader's own position, for loaders that keep one (torchdata's ``StatefulDataLoader``).

A loader with ``state_dict()``/``load_state_dict()`` — torchdata's ``StatefulDataLoader`` over an
``IterableDataset``, or over a map-style set with a sampler of its own — is saved in every mid-epoch
checkpoint, one state per rank, and put back before the resumed epoch's iterator is made, so the epoch
continues with the next unseen batch instead of re-reading the consumed ones to skip them. A loader whose
sampler is trainscale's (``ResumableDistributedSampler``: any map-style set with a sequential or random
sampler) is positioned by its sample count instead, which also works on another world size.

The loop reads ahead of training (an iterable's epoch end is found by reading one batch ahead, and on CUDA
the next batch is copied while the current one trains), so the loader's state at save time would count
batches no step has trained on. :class:`LoaderPositions` therefore records the state after every batch
the iterator yields and the checkpoint takes the one after the batches actually trained on
(torchdata: ``state_dict()`` reflects the batches its iterator has yielded;
https://meta-pytorch.org/data/main/stateful_dataloader_tutorial.html).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator

# batches the loop may read beyond the last one trained on: one (an iterable's epoch end) + one (CUDA prefetch),
# and one more to spare
_READ_AHEAD = 3


def resumes_itself(loader: Any) -> bool:
    """True for a loader that keeps its own position (``state_dict``/``load_state_dict``, e.g. torchdata's
    ``StatefulDataLoader``) and whose sampler is not trainscale's (that one resumes by sample count)."""
    return (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
            and not hasattr(getattr(loader, "sampler", None), "consumed_after"))


class LoaderPositions:
    """An epoch's batches from ``loader`` (its iterator is made here), with the loader's state after each.

    Iterate it as the loader's iterator; :meth:`state_after` gives the state after ``n`` batches were trained
    on, for the last few ``n`` (the loop never reads more than two batches ahead). ``skipped``: batches the
    loop skips by iterating before it trains (a resume without a saved loader state), not counted in ``n``.
    """

    def __init__(self, loader: Any, skipped: int = 0) -> None:
        self._loader, self._skipped = loader, skipped
        self._iterator = iter(loader)
        self._yielded = 0
        self._states: deque = deque([(0, loader.state_dict())], maxlen=_READ_AHEAD + 1)

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._iterator)
        self._yielded += 1
        self._states.append((self._yielded, self._loader.state_dict()))
        return batch

    def state_after(self, batches: int) -> dict:
        """The loader's state once ``batches`` batches of this iterator have been trained on.

        Raises:
            RuntimeError: ``batches`` is not among the last positions kept (a loop that read further ahead).
        """
        for n, state in self._states:
            if n == batches + self._skipped:
                return state
        raise RuntimeError(f"the training loader's state after {batches} batches is not kept (kept: "
                           f"{[n for n, _ in self._states]}); the loop read further ahead than {_READ_AHEAD} batches")


def check_same_world_size(saved_world_size: int, world_size: int) -> None:
    """Refuse to continue an epoch from per-rank loader states saved on another number of ranks.

    Raises:
        ValueError: ``world_size`` differs from ``saved_world_size``, naming the two fixes.
    """
    if world_size != saved_world_size:
        raise ValueError(
            f"the checkpoint continues an epoch from the training DataLoader's own state (a StatefulDataLoader), "
            f"saved for each of its {saved_world_size} ranks; a loader's position cannot be split over "
            f"{world_size} ranks. Resume on {saved_world_size} ranks, or use a map-style data set with a sequential "
            "or random sampler: trainscale's sampler resumes it on any world size (docs/strategies.md, "
            "'Resuming streaming data')")
