"""The batch-size finder: the largest per-device micro-batch that trains, agreed on by every rank.

    from trainscale.tune import find_batch_size
    bs = find_batch_size(model, F.cross_entropy, train_set, strategy="ddp", max_memory=2 * 2**30)
    Trainer(devices=2, strategy="ddp", batch_size="max").fit(model, loader)   # the loader rebuilt with it

**Search** (:func:`search`, pure logic): ``start``, 2·``start``, 4·``start`` … until a size fails or the
limit is reached, then a binary search between the last size that fit and the first that did not
(Lightning's ``BatchSizeFinder`` "binsearch" mode; ``mode="power"`` stops after the growth, and ``shrink=True``
halves a ``start`` that does not fit until a size does, as Lightning's tuner: ``trainscale.tuner.Tuner``'s
``scale_batch_size`` searches with it). At most ``max_trials`` trials.

**A trial** of size b runs one training step — forward, backward, optimizer step — on a batch of b
samples (the data set's first b, collated by the loader's ``collate_fn``), on a *copy* of the model
wrapped by the run's strategy (``copy.deepcopy``, wrapped once, discarded after the search), so the
search never changes the model's weights or the user's optimizer; the GradScaler's state is restored
too. Between trials the batch, loss and gradients are freed (``gc.collect``, and
``torch.cuda.empty_cache`` on CUDA). A trial *fits on this rank* when it raised no out-of-memory
error (``torch.OutOfMemoryError``, ``MemoryError``) and, with ``max_memory``, its peak stayed within it:

- CUDA: ``torch.cuda.max_memory_allocated`` over the trial (peak statistics reset before it);
- CPU (no out-of-memory error arrives before the OS kills the process, so a budget is required): the
  peak of live tensor bytes counted by PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker``
  (a dispatch mode that follows every storage allocated and freed; the one ``trainscale.plan`` and its
  tests use). It is entered while the copy is built and wrapped, so the parameters, DDP's gradient
  buckets and FSDP's buffers count, and again around each trial (its peak restarts there).

**Every rank agrees**: after each trial the ranks all-reduce (MIN) whether it fit, so all of them take
the same path through the search and return the same size, the largest that fits on every rank (a
rank with less memory decides). Trials must not leave a rank inside a collective its peers skipped:
under ddp a trial runs under ``no_backward_sync`` (no all-reduce: its only collective is DDP's buffer
broadcast in the first trial's forward), so an out-of-memory error on one rank is caught there and
the ranks meet again at the agreement. FSDP and model parallelism gather parameters inside forward, so
their trials keep their collectives: a budget (``max_memory``, checked after the trial) keeps the ranks
in step, while a real out-of-memory error under them is raised (it would leave the peers waiting).
Lightning's finder refuses DDP altogether (Lightning-AI/pytorch-lightning#4424, #10560, #20994).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from torch import nn

from trainscale.runtime.flags import AcceleratorFlag, PrecisionFlag, StrategyFlag

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime

MAX_TRIALS = 25


class BatchSizeError(RuntimeError):
    """Not even the smallest batch fits."""


def search(fits: Callable[[int], bool], start: int = 1, limit: int | None = None,
           max_trials: int = MAX_TRIALS, mode: Literal["binsearch", "power"] = "binsearch",
           shrink: bool = False) -> int:
    """The largest size in ``[start, limit]`` for which ``fits`` is true, assuming that a size fits
    whenever a larger one does: powers of two times ``start``, then a binary search.

    Args:
        fits: ``size -> bool``, called once per trial, in the same order on every rank.
        start: the first size tried (>= 1).
        limit: the largest size worth trying (None: no limit; growth stops after ``max_trials``).
        max_trials: calls of ``fits`` at most; when they run out, the largest size that fit.
        mode: "binsearch" (the binary search between the last size that fit and the first that did not) or
            "power" (none: the last power of two times ``start`` that fit, Lightning's ``mode="power"``).
        shrink: when ``start`` does not fit, halve it until a size fits (Lightning's tuner; the first failure
            then bounds the search from above) instead of raising.

    Raises:
        ValueError: ``start`` < 1, ``limit`` < ``start``, ``max_trials`` < 1 or an unknown ``mode``.
        BatchSizeError: ``start`` itself does not fit (with ``shrink``: not even 1 does, or the trials ran out).
    """
    if start < 1 or (limit is not None and limit < start) or max_trials < 1 or mode not in ("binsearch", "power"):
        raise ValueError(f"start={start} must be >= 1 and <= limit={limit}, max_trials={max_trials} >= 1, "
                         f"mode={mode!r} 'binsearch' or 'power'")
    if fits(start):
        good, bad, trials = _grow(fits, start, limit, max_trials)
    elif shrink:
        good, bad, trials = _shrink(fits, start, max_trials)
    else:
        raise BatchSizeError(f"not even a batch of {start} fits; lower the start, raise max_memory, or shard the "
                             "model (strategy='fsdp')")
    while mode == "binsearch" and bad is not None and bad - good > 1 and trials < max_trials:
        mid = (good + bad) // 2
        trials += 1
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def _grow(fits: Callable[[int], bool], good: int, limit: int | None, max_trials: int) -> tuple[int, int | None, int]:
    """Double from ``good`` (which fits) until a size fails, the limit is reached or the trials run out:
    ``(largest size that fit, first that failed or None, trials used)``."""
    trials = 1
    while trials < max_trials and (limit is None or good < limit):
        size = 2 * good if limit is None else min(2 * good, limit)
        trials += 1
        if not fits(size):
            return good, size, trials
        good = size
    return good, None, trials


def _shrink(fits: Callable[[int], bool], bad: int, max_trials: int) -> tuple[int, int, int]:
    """Halve from ``bad`` (which does not fit) until a size fits: ``(that size, the last that failed, trials
    used)``.

    Raises:
        BatchSizeError: not even 1 fits, or the trials ran out first."""
    trials = 1
    while bad > 1 and trials < max_trials:
        size, trials = bad // 2, trials + 1
        if fits(size):
            return size, bad, trials
        bad = size
    raise BatchSizeError(f"not even a batch of {bad} fits (after {trials} trials); free memory (a smaller model, "
                         "precision='bf16-mixed') or shard the model (strategy='fsdp')")


@dataclass
class Trial:
    """One trial on this rank: the size, whether it fit here and on every rank, the peak bytes (None
    after an out-of-memory error)."""

    batch_size: int
    fits_here: bool
    fits_all: bool
    peak_bytes: int | None


@dataclass
class _TrialRun:
    """The wrapped copy, its optimizer and what the trials need."""

    runtime: Runtime
    wrapped: nn.Module
    optimizer: Any
    make_batch: Callable[[int], Any]
    max_memory: int | None
    sync: bool
    tracker: Any = None
    trials: list[Trial] = field(default_factory=list)


class _TrialHost:
    """What a ``TrainingModule``'s ``training_step`` may reach during a trial: ``self.log`` is
    discarded, ``trainer.runtime`` is the run's, epoch and step are 0."""

    current_epoch = 0
    global_step = 0

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.metric_collector = self

    def log(self, *args: Any, **kwargs: Any) -> None:
        pass


def _trial_copy(model: nn.Module, runtime: Runtime) -> nn.Module:
    """A deep copy of ``model`` for the trials (without the Trainer a previous fit attached to it:
    ``TrainingModule.__getstate__``)."""
    clone = copy.deepcopy(model)
    clone.__dict__["_trainer"] = _TrialHost(runtime)
    return clone


def _batch_maker(data: Any, data_world: int) -> tuple[Callable[[int], Any], int | None]:
    """``(size -> batch, the largest useful size)`` from a Dataset, a DataLoader (its dataset and
    ``collate_fn``) or a function ``size -> batch``; the limit is one rank's share of the data set."""
    from torch.utils.data import DataLoader, IterableDataset
    from torch.utils.data._utils.collate import default_collate

    if callable(data) and not hasattr(data, "__getitem__") and not isinstance(data, DataLoader):
        return data, None
    dataset, collate = (data.dataset, data.collate_fn) if isinstance(data, DataLoader) else (data, default_collate)
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or len(dataset) == 0:
        raise ValueError("the batch-size finder needs a map-style data set with a length (or a function "
                         "size -> batch); an IterableDataset cannot give it a batch of a chosen size")
    n = len(dataset)
    return (lambda size: collate([dataset[i % n] for i in range(size)])), math.ceil(n / data_world)


def _tracker(device: torch.device, max_memory: int | None):
    if device.type == "cuda":
        return None
    if max_memory is None:
        raise ValueError("on a CPU an out-of-memory error only comes when the OS kills the process: pass "
                         "max_memory=<bytes> (e.g. 2 * 2**30), the budget each rank's live tensors must stay within")
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


def _setup(model: nn.Module, loss_fn: Callable | None, optimizer: Any, runtime: Runtime, tracker) -> tuple:
    """Copy, wrap (inside the tracker, so wrapping's buffers count) and build one optimizer."""
    from trainscale.lightning.module import LoopModule
    from trainscale.lightning.optimizer_setup import configured_optimization
    from trainscale.lightning.optimizers import parse_optimization

    if not getattr(model, "automatic_optimization", True):
        raise ValueError("the batch-size finder steps the optimizer itself; under manual optimization "
                         "(automatic_optimization = False) choose the batch size yourself")
    with tracker if tracker is not None else contextlib.nullcontext():
        clone = _trial_copy(model, runtime)
        wrapped, _ = runtime.setup(LoopModule(clone, loss_fn))
        opt = parse_optimization(configured_optimization(clone, wrapped, optimizer)).optimizers[0]
        opt = runtime.strategy.setup_optimizer(opt)
    if tracker is not None:
        tracker.track_external(wrapped, opt)  # storages made without dispatch (none are counted twice)
    return wrapped, opt


def _step(run: _TrialRun, size: int) -> int:
    """One training step on a batch of ``size``; the peak bytes of it (see the module docstring)."""
    rt = run.runtime
    cuda = rt.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(rt.device)
    with run.tracker if run.tracker is not None else contextlib.nullcontext():
        batch = rt.to_device(run.make_batch(size))
        with rt.no_backward_sync(run.wrapped, enabled=not run.sync):
            with rt.autocast():
                loss = run.wrapped(batch, 0)
            rt.backward(loss)
        rt.step(run.optimizer)
        run.optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(rt.device)
        return int(torch.cuda.max_memory_allocated(rt.device))
    run.tracker.reset_mod_stats()  # per-module statistics of one step only (MemTracker refuses a second)
    return int(sum(s["Total"] for s in run.tracker.get_tracker_snapshot("peak").values()))


def _free(run: _TrialRun) -> None:
    run.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if run.runtime.device.type == "cuda":
        torch.cuda.empty_cache()


def _fits(run: _TrialRun, size: int) -> bool:
    """Run one trial, then agree with every rank (all-reduce MIN) on whether it fit."""
    peak, oom = None, False
    try:
        peak = _step(run, size)
    except (torch.OutOfMemoryError, MemoryError):
        if run.sync:  # peers may be waiting inside a collective this rank will never reach
            raise
        oom = True
    _free(run)
    here = not oom and (run.max_memory is None or peak <= run.max_memory)
    flag = torch.tensor([int(here)], device=run.runtime.device)
    agreed = bool(run.runtime.all_reduce(flag, op="min").item())
    run.trials.append(Trial(size, here, agreed, peak))
    return agreed


def _check(max_memory: Any, start: Any, max_batch_size: Any) -> None:
    for name, value in (("max_memory", max_memory), ("max_batch_size", max_batch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive int (bytes for max_memory) or None")
    if isinstance(start, bool) or not isinstance(start, int) or start < 1:
        raise ValueError(f"start={start!r} must be an int >= 1 (the first batch size tried)")


def find_batch_size(model: nn.Module, loss_fn: Callable | None = None, data: Any = None, *, optimizer: Any = None,
                    runtime: Runtime | None = None, accelerator: AcceleratorFlag = "auto",
                    devices: int | Literal["auto"] = "auto", strategy: StrategyFlag = "auto",
                    precision: PrecisionFlag = "32-true", max_memory: int | None = None,
                    start: int = 1, max_batch_size: int | None = None, max_trials: int = MAX_TRIALS,
                    trials: list | None = None) -> int:
    """The largest per-device micro-batch that trains on every rank (see the module docstring).

    Call it on every rank (as the training script runs on every rank).

    Args:
        model: a plain ``nn.Module`` with ``loss_fn`` (default cross-entropy) or a module that defines
            ``training_step``; it is copied for the trials and never changed.
        data: a map-style Dataset, a DataLoader (its dataset and ``collate_fn``), or ``size -> batch``.
        optimizer: a factory ``params -> Optimizer`` (or None for ``configure_optimizers()``).
        runtime: a launched :class:`~trainscale.runtime.runtime.Runtime` (the Trainer's); None: one is
            made from ``accelerator``, ``devices``, ``strategy`` and ``precision``.
        max_memory: bytes each rank's trial may peak at (required on CPU; optional on CUDA, where an
            out-of-memory error also ends the growth). Each rank may pass its own.
        start: the first size tried. max_batch_size: the largest (default: one rank's share of the
            data set; none for a function).
        trials: a list to which each :class:`Trial` is appended (for reports and tests).

    Returns:
        The batch size (the same int on every rank).

    Raises:
        ValueError: a bad argument, no budget on CPU, an IterableDataset, manual optimization.
        BatchSizeError: not even ``start`` fits.
        torch.OutOfMemoryError: under fsdp or model parallelism on CUDA without a budget that stops
            the growth first (see the module docstring).
    """
    _check(max_memory, start, max_batch_size)
    if runtime is None:
        from trainscale.runtime.runtime import Runtime

        runtime = Runtime(accelerator=accelerator, devices=devices, strategy=strategy, precision=precision)
    runtime.launch()
    make_batch, limit = _batch_maker(data, runtime.strategy.data_world(runtime.world).world_size)
    tracker = _tracker(runtime.device, max_memory)
    scaler_state = copy.deepcopy(runtime.precision.state_dict())
    wrapped, opt = _setup(model, loss_fn, optimizer, runtime, tracker)
    run = _TrialRun(runtime, wrapped, opt, make_batch, max_memory,
                    runtime.strategy.forward_communicates, tracker, trials if trials is not None else [])
    try:
        found = search(lambda size: _fits(run, size), start, max_batch_size or limit, max_trials)
    finally:
        runtime.precision.load_state_dict(scaler_state)
        del run, wrapped, opt
        gc.collect()
    runtime.print(f"batch-size finder: {found} per device fits on every rank"
                  + (f" within {max_memory:,} bytes" if max_memory else ""))
    return found


def tuned_loader(runtime: Runtime, config: Any, model: nn.Module, loss_fn: Callable | None, optimizer: Any,
                 loader: Any) -> Any:
    """``Trainer(batch_size="max")``: the training ``loader`` rebuilt with the size :func:`find_batch_size`
    finds (its dataset, sampler, ``collate_fn`` and workers kept: ``sampling.with_batch_size``); the
    loader itself when ``config.batch_size`` is None, and under ``fast_dev_run`` (with Lightning's warning).
    Called before the run is seeded, so the trials' random numbers do not change the run's.

    The loader to rebuild is the one passed to ``fit``: unlike Lightning, which re-calls
    ``train_dataloader()`` after setting a ``batch_size`` attribute on the module or data module, the
    Trainer rebuilds the DataLoader object it was given, as it does for the distributed sampler.

    Raises:
        ValueError: a loader with its own ``batch_sampler``; see :func:`find_batch_size`.
    """
    if config.batch_size != "max":
        return loader
    if config.fast_dev_run:  # a quick check of the code, as Lightning's tuner (tuner/batch_size_scaling.py)
        if runtime.is_rank_zero:
            warnings.warn("Skipping batch size scaler since `fast_dev_run` is enabled: the loader keeps its batch "
                          "size (drop fast_dev_run to search for the largest)", UserWarning, stacklevel=4)
        return loader
    from trainscale.runtime.sampling import with_batch_size

    if getattr(loader, "batch_size", None) is None:
        with_batch_size(loader, 1)  # raises the error that names the fix
    found = find_batch_size(model, loss_fn, loader, optimizer=optimizer, runtime=runtime,
                            max_memory=config.max_memory)
    return with_batch_size(loader, found)
