"""Training progress as values: where the loop stands, where a resume starts, micro-batch grouping.

- :class:`TrainState` — the one stateful value of the loop's progress (torchtitan's ``TrainState``):
  optimizer steps, the epoch, micro-batches done in it, the epoch records. Saved in every checkpoint.
- :class:`ResumePoint` — what a checkpoint says about where to continue (frozen, returned by the load).
- :func:`micro_batches` — the micro-batches of an epoch, each knowing whether it ends an optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, NamedTuple

import torch


@dataclass
class TrainState:
    """Where training stands.

    Attributes:
        global_step: optimizer steps taken since the start of the run.
        epoch: the current (0-based) epoch.
        batches: micro-batches of ``epoch`` consumed since its sampler started (a resumed epoch counts the
            batches before the resume too).
        history: one record per completed epoch (``kind`` "epoch" metrics, without ``kind``/``time``).
    """

    global_step: int = 0
    epoch: int = 0
    batches: int = 0
    history: list[dict] = field(default_factory=list)

    def state_dict(self) -> dict:
        return {"global_step": self.global_step, "epoch": self.epoch, "batches": self.batches,
                "history": list(self.history)}


@dataclass(frozen=True)
class ResumePoint:
    """Where a checkpoint leaves off.

    Attributes:
        epoch: the epoch the checkpoint was written in.
        complete: True when that epoch had ended; training continues with ``epoch + 1``.
        consumed: samples of all ranks consumed in ``epoch`` (mid-epoch, with trainscale's sampler), else None.
        batches: micro-batches of ``epoch`` done (for other samplers, on the same world size).
        totals: (loss × samples summed, samples, tokens, seconds) of the part of ``epoch`` done, so that its
            record after the resume covers the whole epoch (older checkpoints: without tokens).
        rng: this rank's RNG states, restored when the resumed epoch's loader iterator is made.
        world_size: the world size that wrote it.
    """

    epoch: int
    complete: bool
    consumed: int | None
    batches: int
    totals: tuple
    rng: dict | None
    world_size: int

    @property
    def next_epoch(self) -> int:
        return self.epoch + 1 if self.complete else self.epoch

    def position(self) -> dict:
        """The form ``trainscale.train.checkpoint.start_epoch`` reads."""
        return {"epoch": self.epoch, "complete": self.complete, "consumed": self.consumed, "batches": self.batches}

    def resumes(self, epoch: int) -> bool:
        """True when ``epoch`` is the one this point continues mid-way."""
        return not self.complete and epoch == self.epoch


class MicroBatch(NamedTuple):
    batch: Any
    index: int  # position in the epoch (Lightning's batch_idx)
    is_last: bool  # the last micro-batch of its optimizer step: gradients are synchronised and stepped
    group_size: int  # micro-batches in its optimizer step (the epoch's last step may have fewer than k)


def micro_batches(batches: Iterable, k: int, total: int, start: int = 0) -> Iterator[MicroBatch]:
    """Number ``batches`` (``total`` of them, the first at index ``start``) and group them by ``k``.

    >>> [(m.index, m.is_last, m.group_size) for m in micro_batches("abcde", 2, 5)]
    [(0, False, 2), (1, True, 2), (2, False, 2), (3, True, 2), (4, True, 1)]
    """
    for i, batch in enumerate(batches):
        first = (i // k) * k
        group_size = min(k, total - first)
        yield MicroBatch(batch, start + i, i - first == group_size - 1, group_size)


class EpochLoss:
    """The epoch's training loss, summed on the device (no host sync per step), its samples and tokens."""

    def __init__(self, device: torch.device, carried: tuple = (0.0, 0.0, 0.0, 0.0)) -> None:
        self.sum = torch.zeros((), device=device)
        self.samples = 0
        self.tokens = 0
        # from the part of the epoch before a resume: loss sum, samples, (tokens,) seconds
        self.carried = (*carried[:2], carried[2] if len(carried) == 4 else 0.0)

    def add(self, loss: torch.Tensor, samples: int, tokens: int | None = None) -> None:
        self.sum.add_(loss, alpha=samples)  # bf16 losses promote to fp32
        self.samples += samples
        self.tokens += tokens or 0

    def totals(self, runtime: Any) -> tuple[float, float, float]:
        """(loss × samples, samples, tokens) over the data-parallel ranks, with the carried part. A collective.

        Every rank adds its own; under tensor parallelism the ``tp`` ranks of a group read the same samples,
        so the sums are divided by ``world_size / data_parallel_size`` (each sample counted once)."""
        device = self.sum.device
        copies = runtime.world_size / runtime.data_parallel_size
        vec = runtime.all_reduce(torch.stack([self.sum, torch.tensor(float(self.samples), device=device),
                                              torch.tensor(float(self.tokens), device=device)])).tolist()
        return tuple(v / copies + c for v, c in zip(vec, self.carried))


@dataclass
class FitRun:
    """The objects of one ``fit`` (or evaluation) call, made in ``Trainer._setup``."""

    model: Any
    loop_module: Any  # trainscale.train.module.LoopModule
    wrapped: Any
    train_loader: Any
    val_loader: Any
    telemetry: Any
    sink: Any = None
    bar: Any = None
    epoch_loss: EpochLoss | None = None
    epoch_batches: int = 0  # micro-batches of the current epoch in all
    epoch_offset: int = 0  # of them, those done before this process resumed the epoch
    started: float = 0.0
