"""The loop's values: micro-batch grouping, per-micro-batch books, the epoch loss, the objects of a fit.

- :func:`micro_batches` — the micro-batches of an epoch, each knowing whether it ends an optimizer step.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NamedTuple

import torch

from trainscale.checkpointing.loader_state import LoaderPositions, check_same_world_size, resumes_itself
from trainscale.checkpointing.rng import set_rng_state
from trainscale.runtime.batch import batch_counts
from trainscale.runtime.sampling import set_sampler_epoch

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime


class MicroBatch(NamedTuple):
    batch: Any
    index: int  # position in the epoch (Lightning's batch_idx)
    is_last: bool  # the last micro-batch of its optimizer step: gradients are synchronised and stepped
    group_size: int  # micro-batches in its optimizer step (the epoch's last step may have fewer than k)
    ends_epoch: bool  # the last micro-batch of its epoch (of an iterable data set too: found by reading one ahead)


def micro_batches(batches: Iterable, k: int, total: int, start: int = 0) -> Iterator[MicroBatch]:
    """Number ``batches`` (``total`` of them, the first at index ``start``) and group them by ``k``.

    >>> [(m.index, m.is_last, m.group_size, m.ends_epoch) for m in micro_batches("abcde", 2, 5)][-2:]
    [(3, True, 2, False), (4, True, 1, True)]

    ``total`` infinite (an iterable data set: the epoch ends when its iterator does): the last micro-batch is found
    by reading one ahead, and every step divides by ``k``, as Lightning does for every step:

    >>> [(m.index, m.is_last, m.group_size, m.ends_epoch) for m in micro_batches(iter("abc"), 2, math.inf)]
    [(0, False, 2, False), (1, True, 2, False), (2, True, 2, True)]
    """
    if total == math.inf:
        yield from _open_ended(iter(batches), k, start)
        return
    for i, batch in enumerate(batches):
        first = (i // k) * k
        group_size = min(k, total - first)
        yield MicroBatch(batch, start + i, i - first == group_size - 1, group_size, i == total - 1)


_END = object()


def _open_ended(batches: Iterator, k: int, start: int) -> Iterator[MicroBatch]:
    ahead = next(batches, _END)
    i = 0
    while ahead is not _END:
        batch, ahead = ahead, next(batches, _END)
        yield MicroBatch(batch, start + i, i % k == k - 1 or ahead is _END, k, ahead is _END)
        i += 1


def loader_length(loader: Any) -> float:
    """Batches in ``loader``, or infinity for an ``IterableDataset`` (its iterator decides where an epoch ends,
    whatever its ``__len__`` says: a generator may yield a different number of samples every epoch) and for an
    iterable without ``len``."""
    if isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset) or not hasattr(loader, "__len__"):
        return math.inf
    return len(loader)


class EpochLoss:
    """The epoch's training loss, summed on the device (no host sync per step), its samples and tokens, and the
    samples whose micro-batch reported a loss (under manual optimization a ``training_step`` may return none)."""

    def __init__(self, device: torch.device, carried: tuple = (0.0, 0.0, 0.0, 0.0),
                 runtime: Runtime | None = None) -> None:
        """``carried``: the part of the epoch before a resume (loss sum, samples, (tokens,) seconds). Its loss sum
        goes into rank zero's device sum (× the ranks that share each sample), not added at the end, so that one
        process resumed mid-epoch sums the epoch's losses in the float32 order of the uninterrupted run."""
        copies = 1 if runtime is None else runtime.world_size / runtime.data_parallel_size
        zero = runtime is None or runtime.is_rank_zero
        self.sum = torch.full((), float(carried[0]) * copies if zero else 0.0, device=device)
        self.samples = 0
        self.tokens = 0
        self.loss_samples = 0
        self.carried = (0.0, carried[1], carried[2] if len(carried) == 4 else 0.0)  # the loss sum is in self.sum

    def add(self, loss: torch.Tensor | None, samples: int, tokens: int | None = None) -> None:
        """Count a micro-batch of ``samples`` samples (and ``tokens``); ``loss`` None: it reported no loss."""
        if loss is not None:
            self.sum.add_(loss, alpha=samples)  # bf16 losses promote to fp32
            self.loss_samples += samples
        self.samples += samples
        self.tokens += tokens or 0

    def totals(self, runtime: Runtime) -> tuple[float, float, float, float]:
        """(loss × samples, samples, tokens, samples with a loss) over the data-parallel ranks, with the carried
        part (whose samples all had a loss). A collective.

        Every rank adds its own; under tensor parallelism the ``tp`` ranks of a group read the same samples,
        so the sums are divided by ``world_size / data_parallel_size`` (each sample counted once)."""
        device = self.sum.device
        copies = runtime.world_size / runtime.data_parallel_size
        vec = runtime.all_reduce(torch.stack([self.sum, *(torch.tensor(float(n), device=device) for n in (
            self.samples, self.tokens, self.loss_samples))])).tolist()
        return tuple(v / copies + c for v, c in zip(vec, (*self.carried, self.carried[1])))


class MicroBatchBooks:
    """What the loop counts for each micro-batch, in one place: the data phase's end, samples and tokens (and
    ``self.log``'s batch size), then the telemetry phases, the epoch's loss sum (on the device), the non-finite
    watch, the loop position and the progress bar. Nothing here waits for the device."""

    def __init__(self, telemetry: Any, faults: Any, state: Any, metrics: Any, epoch_loss: EpochLoss, bar: Any) -> None:
        self.telemetry, self.faults, self.state, self.metrics = telemetry, faults, state, metrics
        self.epoch_loss, self.bar = epoch_loss, bar
        self._t_data: Any = None
        self._counts: tuple[int, int | None] = (0, None)

    def batch_ready(self, batch: Any) -> None:
        """The micro-batch is on the device: the data phase ends; its samples and tokens are counted."""
        self._t_data = self.telemetry.clock()
        self._counts = batch_counts(batch)
        self.metrics.batch_size = self._counts[0]

    def backward_done(self, loss: torch.Tensor | None, t_forward: Any) -> None:
        """Forward and backward ended (``t_forward``: the clock reading between them); ``loss`` is detached (None:
        a manual ``training_step`` returned none)."""
        samples, tokens = self._counts
        self.telemetry.micro_batch(self._t_data, t_forward, self.telemetry.clock(), samples, tokens)
        if loss is not None:
            self.faults.observe_loss(loss, self.state.global_step)
        self.epoch_loss.add(loss, samples, tokens)
        self.state.batches += 1
        self.state.total_batches += 1
        self.bar.update()


@dataclass
class FitRun:
    """The objects of one ``fit`` (or evaluation) call, made in ``Trainer._setup``."""

    model: Any
    loop_module: Any  # trainscale.lightning.module.LoopModule
    wrapped: Any
    train_loader: Any
    val_loader: list | None  # the validation loaders (one, or several run in turn); None: none (yet)
    telemetry: Any
    metrics: Any = None  # trainscale.loop.records.MetricsProcessor, made in Trainer._run_fit
    bar: Any = None
    epoch_loss: EpochLoss | None = None
    books: MicroBatchBooks | None = None
    epoch_batches: float = 0  # micro-batches of the current epoch in all (an int; inf for an iterable until it ends)
    epoch_offset: int = 0  # of them, those done before this process resumed the epoch
    accumulate: int = 0  # micro-batches per optimizer step in the current epoch (Trainer.accumulate_for); 0: none yet
    validated_after: int = -1  # the epoch's micro-batches done when validation last ran in it (-1: not yet)
    validate_at: float = math.inf  # time.monotonic() at which a time-based val_check_interval validates (inf: none)
    started: float = 0.0
    loader_positions: LoaderPositions | None = None  # the epoch's iterator of a loader that keeps its own position
    sources: Any = None  # trainscale.lightning.data_sources.FitSources: where the loaders come from (and again)
    validates: bool = False  # the fit validates (Lightning's enable_validation); its loaders are asked for when due
    loaded_epoch: int = 0  # the epoch at whose start the training loader was last made
    val_asked_epoch: float | None = None  # the epoch the validation loaders were last asked in (None: not yet)
    datamodule: Any = None  # the data module the loaders came from (its hyperparameters go into checkpoints)
    held_back_said: bool = False  # the note that min_epochs/min_steps hold a stop back was given (once per fit)
    # the count (batch index + 1) of the step whose "step" ReduceLROnPlateau update is still to come, from its
    # validation on: a checkpoint written in between (at that validation's end) holds it, to be made on resume
    plateau_pending: int | None = None
    epoch_rates: dict | None = None  # the learning rates the epoch trained with, noted before its "epoch" schedulers

def start_epoch(loader, epoch: int, position: dict | None, world_size: int, saved_world_size: int) -> int:
    """Point ``loader``'s sampler at ``epoch`` and, when resuming that epoch, at its saved position.

    Returns:
        Micro-batches to skip by iterating (only for samplers that cannot start mid-epoch; 0 otherwise).

    Raises:
        ValueError: a mid-epoch position with a sampler that cannot start there on another world size.
    """
    sampler = getattr(loader, "sampler", None)
    resume = position is not None and position["epoch"] == epoch and not position["complete"]
    if hasattr(sampler, "consumed_after"):
        sampler.set_epoch(epoch, position["consumed"] if resume and position["consumed"] is not None else 0)
        if resume and position["consumed"] is None:
            raise ValueError("the checkpoint holds no sample position for this epoch; resume with the loader "
                             "it was written with")
        return 0
    set_sampler_epoch(loader, epoch)  # its sampler's and its batch sampler's sampler's, as Lightning's
    skip = position["batches"] if resume else 0
    if skip and world_size != saved_world_size:
        raise ValueError(f"resuming mid-epoch on world size {world_size} (saved on {saved_world_size}) needs the "
                         "sampler trainscale injects; let the Trainer shard the DataLoader (no own sampler)")
    return skip

def epoch_batches(fit, state, epoch: int, resume, world_size: int, limit=lambda full: full):
    """Point ``fit``'s training loader at ``epoch`` (at ``resume``, a ``ResumePoint``, when it continues that
    epoch) and return the epoch's batches; set ``fit.epoch_offset`` (micro-batches done before), ``fit.epoch_batches``
    (the epoch's micro-batches in all: ``limit`` of the loader's, ``TrainerConfig.train_batches``) and
    ``state.batches``. trainscale's sampler starts mid-epoch itself (its ``len`` is then what is left); a loader
    that keeps its own position (a ``StatefulDataLoader``) gets its saved state back (``fit.loader_positions``
    then records its state after each batch, for the next checkpoint); other samplers' first batches are skipped
    by iterating. A mid-epoch checkpoint's RNG states are restored here, after the loader's iterator is made, as
    when it was saved.

    Raises:
        ValueError: a mid-epoch resume on another world size that the loader cannot follow (``start_epoch``,
            ``loader_state.check_same_world_size``).
    """
    loader = fit.train_loader
    state.batches = fit.epoch_offset = resume.batches if resume else 0
    own = resumes_itself(loader)
    restored = own and resume is not None and resume.loader_ranks > 0
    if restored:
        check_same_world_size(resume.loader_ranks, world_size)
        loader.load_state_dict(resume.loader_state)
    skip = start_epoch(loader, epoch, resume.position() if resume and not restored else None, world_size,
                       resume.world_size if resume else world_size)
    fit.epoch_batches = limit(loader_length(loader) + (0 if skip or restored else fit.epoch_offset))
    fit.loader_positions = LoaderPositions(loader, skip) if own else None
    batches = fit.loader_positions if own else iter(loader)
    if resume is not None and resume.rng is not None:
        set_rng_state(resume.rng)
    if fit.epoch_batches == math.inf:  # an iterable: until its iterator ends
        return itertools.islice(batches, skip, None)
    return itertools.islice(batches, skip, skip + max(0, fit.epoch_batches - fit.epoch_offset))
