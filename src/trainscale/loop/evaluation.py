"""Validation, test and prediction loops: every sample counted once across ranks.

Evaluation loaders are split without padding (``UnpaddedDistributedSampler``: rank ``r`` of ``W``
takes samples ``r, r + W, ...``), so ranks may hold one batch more or less. No collective runs
inside the loop, except the forwards themselves under a strategy whose forward communicates (fsdp
all-gathers parameters): there every rank runs as many forwards as the rank with the most batches,
the extra results discarded.

A stage may have several loaders (``val_dataloader()`` returning a list or a dict): they run one after the other
between one ``on_<stage>_epoch_start`` and one ``on_<stage>_epoch_end``, as Lightning's ``CombinedLoader`` in
"sequential" mode, each split across the ranks as one loader is; the results are one dict per loader.
"""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from trainscale.checkpointing import checkpointer, run_dirs as ckpt
from trainscale.checkpointing.train_state import TrainerFn
from trainscale.checkpointing.rng import fit_seed
from trainscale.lightning.data_sources import resolve_loaders
from trainscale.lightning.metrics import MetricCollector, metric_states_kept
from trainscale.lightning.module import (MODE_HOOKS, TrainingModule, attach_trainer, refuse_dataloader_iter,
                                         set_up_model)
from trainscale.loop.state import loader_length
from trainscale.runtime.sampling import set_sampler_epoch, with_index_recording
from trainscale.utilities.model_helpers import is_overridden

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime
    from trainscale.loop.trainer import Trainer


def _extra_forwards(runtime: Runtime, num_batches: list[float]) -> list[int]:
    """Forwards this rank must add after each loader so that all ranks run the most batches of any rank (one
    all-reduce for every loader).

    Raises:
        ValueError: some rank has no batch at all of a loader that others have batches of (fewer samples than ranks).
    """
    mine = torch.tensor([*num_batches, *(-n for n in num_batches)], device=runtime.device)
    reduced = runtime.all_reduce(mine, op="max").tolist()
    most, least = reduced[:len(num_batches)], [-v for v in reduced[len(num_batches):]]
    if any(fewest == 0 and top > 0 for top, fewest in zip(most, least)):
        raise ValueError(f"strategy={runtime.config.strategy!r} evaluates through collectives, but some rank has no "
                         "evaluation batch; give the evaluation set at least as many samples as ranks")
    return [int(top - n) for top, n in zip(most, num_batches)]


def _no_hook(name: str, *args: Any) -> None:
    pass


def check_dataloader_idx(loop_module: Any, stage: str, several: bool) -> None:
    """Lightning's ``_verify_dataloader_idx_requirement``: with several loaders the module's ``<stage>_step`` (and its
    ``on_<stage>_batch_start``/``_end``, where it defines them) must take ``dataloader_idx``; with one, where it
    takes it, it needs a default (it is passed only with several, as Lightning does). Messages as Lightning's.

    Raises:
        RuntimeError: a step or hook that breaks either rule (the fix named).
    """
    loader = {"validation": "val", "test": "test", "predict": "predict"}[stage]
    model = loop_module.model
    hooks = [h for h in (f"on_{stage}_batch_start", f"on_{stage}_batch_end") if h in loop_module.hooks]
    for name in (f"{stage}_step", *hooks):
        fn = getattr(model, name, None)
        if not callable(fn):  # a plain model: no steps
            continue
        params = inspect.signature(fn).parameters
        given = params.get("dataloader_idx")
        if several and given is None and not any(p.kind == p.VAR_POSITIONAL for p in params.values()):
            raise RuntimeError(f"You provided multiple `{loader}_dataloader`, but no `dataloader_idx` argument in "
                               f"`{type(model).__name__}.{name}()`. Try adding `dataloader_idx=0` to its signature.")
        if not several and given is not None and given.default is inspect.Parameter.empty:
            raise RuntimeError(f"You provided only a single `{loader}_dataloader`, but have included `dataloader_idx` "
                               f"in `{type(model).__name__}.{name}()`. Either remove the argument or give it a default "
                               "value i.e. `dataloader_idx=0`.")


def evaluate(runtime: Runtime, loop_module: Any, wrapped: Any, loaders: list, stage: str, collector: Any,
             num_batches: list[float] | None = None, hook: Callable[..., Any] = _no_hook,
             move: Callable[[Any, int], Any] | None = None) -> list[dict[str, float]]:
    """One dict per loader of ``loaders`` (each evaluated in turn, as Lightning's "sequential" ``CombinedLoader``):
    sample-weighted means over the whole set (or its first ``num_batches[i]`` batches on each rank) of what
    ``<stage>_step`` returned (or loss and accuracy for a plain classifier), prefixed ``val_``/``test_``, plus what
    ``self.log`` collected in that loader's steps and hooks (as named) and in ``on_<stage>_epoch_start``/``_end``
    (in every loader's dict, as Lightning's results). A key returned by some batches only is the mean over those
    batches' samples. With several loaders the step gets ``dataloader_idx`` as its third argument and every name
    ends in ``/dataloader_idx_N`` (a ``self.log`` name unless logged with ``add_dataloader_idx=False``).

    ``hook(name, *args)`` runs Lightning's ``on_<stage>_epoch_start`` (once), ``on_<stage>_batch_start(batch,
    batch_idx)``, ``on_<stage>_batch_end(outputs, batch, batch_idx)`` (outputs: what the step returned, as
    Lightning's: a dict, a tensor, None; a plain model's metrics; with several loaders both get ``dataloader_idx``
    last) and ``on_<stage>_epoch_end`` (once) (``Trainer._hook``). ``move(batch, dataloader_idx)`` puts each batch on the device (the module's batch-transfer
    hooks: ``lightning.module.BatchTransfer``; None: ``runtime.to_device``). The caller sets the module's mode
    (:func:`model_eval`). Sums and counts stay on the device; one all-reduce at the end. A collective: every rank
    calls it.

    Raises:
        ValueError: on every rank, when a key was returned on some ranks and never on another that had
            batches (as ``self.log`` names logged on some ranks only), naming the key and the ranks.
        RuntimeError: a step that does not take ``dataloader_idx`` with several loaders (:func:`check_dataloader_idx`).
    """
    rt = runtime
    prefix = "val_" if stage == "validation" else "test_"
    if num_batches is None:  # inf: an iterable, to its end
        num_batches = [loader_length(loader) for loader in loaders]
    several = len(loaders) > 1
    check_dataloader_idx(loop_module, stage, several)
    communicates = rt.strategy.forward_communicates
    if communicates and math.inf in num_batches:
        raise ValueError(f"strategy={rt.config.strategy!r} evaluates through collectives, so every rank must know its "
                         "number of batches: give the evaluation loader a map-style data set, or limit_val_batches")
    extra = _extra_forwards(rt, num_batches) if communicates else [0] * len(loaders)
    hook(f"on_{stage}_epoch_start")
    runs = [_evaluate_loader(rt, loop_module, wrapped, (loader, move), stage, collector, n, hook, i if several else None,
                             more) for i, (loader, n, more) in enumerate(zip(loaders, num_batches, extra))]
    hook(f"on_{stage}_epoch_end")  # what it logs is in every loader's values
    means = _means(rt, runs, prefix, several, f"{stage}_step")
    logged = collector.by_loader(collector.take_epoch_values(), len(loaders))
    collector.reset_metrics()
    return [{**mean, **values} for mean, values in zip(means, logged)]


def _evaluate_loader(rt: Runtime, loop_module: Any, wrapped: Any, source: tuple[Any, Callable | None], stage: str,
                     collector: Any, num_batches: float, hook: Callable[..., Any], dataloader_idx: int | None,
                     extra: int) -> tuple[dict[str, torch.Tensor], dict[str, int], int]:
    """One loader's batches (``source``: the loader and :func:`evaluate`'s ``move``; ``dataloader_idx``: its index
    among several, else None): per key the sum on the device of the step's values times the batch's samples, and the
    samples of the batches that returned it; the samples seen. Then ``extra`` forwards whose results, ``self.log`` values and Metric updates are discarded."""
    communicates = rt.strategy.forward_communicates
    loader, move = source
    idx = () if dataloader_idx is None else (dataloader_idx,)  # Lightning passes it to the hooks with several only
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}  # samples of the batches that returned each key
    count, batch = 0, None
    collector.dataloader_idx = dataloader_idx
    stepless = getattr(loop_module.model, f"{stage}_step", None) is None
    for batch_idx, batch in enumerate(itertools.islice(loader, None if num_batches == math.inf else num_batches)):
        batch = rt.to_device(batch) if move is None else move(batch, dataloader_idx or 0)
        collector.batch_size = _count(batch)
        hook(f"on_{stage}_batch_start", batch, batch_idx, *idx)
        with rt.autocast():
            metrics, n = (wrapped(batch, batch_idx, stage=stage, dataloader_idx=dataloader_idx) if communicates
                          else loop_module.evaluate(batch, batch_idx, stage, dataloader_idx))
        # outputs: what the step returned, as Lightning passes it (a plain model, without steps: its metrics)
        outputs = metrics if stepless or rt.strategy.pipelined else loop_module.step_output
        hook(f"on_{stage}_batch_end", outputs, batch, batch_idx, *idx)
        for key, value in metrics.items():
            value = torch.as_tensor(value, device=rt.device).detach().float() * n
            sums[key] = sums[key] + value if key in sums else value
            counts[key] = counts.get(key, 0) + n
        count += n
    if extra:
        collector.discard = True  # results and self.log values discarded: each sample is still counted once
        with metric_states_kept(loop_module):  # and what a torchmetrics Metric's update() took from them is undone
            _extra_runs(rt, wrapped, batch, stage, extra, dataloader_idx)
        collector.discard = False
    collector.dataloader_idx = None
    return sums, counts, count


def _extra_runs(rt: Runtime, wrapped: Any, batch: Any, stage: str, extra: int, dataloader_idx: int | None) -> None:
    """``extra`` forwards of ``batch`` whose results are dropped: the collectives of a rank with fewer batches."""
    for _ in range(extra):
        with rt.autocast():
            wrapped(batch, 0, stage=stage, dataloader_idx=dataloader_idx)


def _means(rt: Runtime, runs: list[tuple[dict, dict, int]], prefix: str, several: bool,
           step: str) -> list[dict[str, float]]:
    """Each loader's sample-weighted means of the returned keys, named ``prefix + key`` (and ``/dataloader_idx_N``
    with several loaders): one ``all_gather_object`` of the keys, one all-reduce of every loader's sums and counts."""
    keys = _same_keys_on_every_rank(rt, [sorted(sums) for sums, _, _ in runs], [n > 0 for _, _, n in runs], step)
    named = [(i, key) for i, loader_keys in enumerate(keys) for key in loader_keys]
    zero = torch.zeros((), device=rt.device)
    vec = rt.all_reduce(torch.stack([runs[i][0].get(k, zero) for i, k in named] +
                                    [zero + runs[i][1].get(k, 0) for i, k in named])).tolist() if named else []
    out: list[dict[str, float]] = [{} for _ in runs]
    for (i, key), total, n in zip(named, vec, vec[len(named):]):
        out[i][f"{prefix}{key}{f'/dataloader_idx_{i}' if several else ''}"] = total / n if n else math.nan
    return out


def _same_keys_on_every_rank(runtime: Runtime, keys: list[list[str]], had_batches: list[bool],
                             step: str) -> list[list[str]]:
    """Per loader, the keys of every rank (one ``all_gather_object``); raise on every rank when a rank that had
    batches of a loader never returned a key that another rank returned for it: its mean would silently cover some
    ranks' samples only."""
    every = runtime.all_gather_object((keys, had_batches))
    union = [sorted(set().union(*(set(k[i]) for k, _ in every))) for i in range(len(keys))]
    missing = {(i, key): [r for r, (k, had) in enumerate(every) if had[i] and key not in k[i]]
               for i, loader_keys in enumerate(union) for key in loader_keys}
    missing = {at: ranks for at, ranks in missing.items() if ranks}
    if missing:
        named = "; ".join(f"{key!r}{f' of dataloader {i}' if len(keys) > 1 else ''} not on rank(s) "
                          f"{', '.join(map(str, ranks))}" for (i, key), ranks in missing.items())
        raise ValueError(f"{step} returned keys on some ranks only ({named}); return the same keys on every rank "
                         "(a key may be left out of some batches: its mean is over the batches that returned it)")
    return union


def _count(batch: Any) -> int:
    from trainscale.runtime.batch import batch_size

    return batch_size(batch)


def predict(runtime: Runtime, loop_module: Any, wrapped: Any, loaders: list, hook: Callable[..., Any] = _no_hook,
            num_batches: list[float] | None = None, move: Callable[[Any, int], Any] | None = None) -> Any:
    """Every sample's prediction, gathered from all ranks in dataset order (each sample once), between
    Lightning's ``on_predict_epoch_start`` and ``on_predict_epoch_end``, with ``on_predict_batch_start(batch,
    batch_idx)`` and ``on_predict_batch_end(outputs, batch, batch_idx)`` around each batch (``hook(name, *args)``),
    loader after loader; with several loaders ``predict_step`` and the batch hooks get ``dataloader_idx`` last.
    ``move``: as :func:`evaluate`'s; the caller sets the module's mode (:func:`model_eval`).

    Returns:
        With one loader, for a module with Lightning's steps (``loop_module.plain_model`` False), Lightning's list of
        per-batch outputs: in one process each batch's output as ``predict_step`` returned it; on several ranks every
        sample in dataset order, cut into batches of the first batch's length (Lightning returns each rank's own
        batches only). For a plain model: one tensor (the per-batch outputs concatenated along dim 0) when its
        outputs are tensors; one dict of such tensors (or lists) when they are dicts of tensors (or lists) of
        the batch's length; else, in one process only, the list of per-batch outputs. With several loaders, a list
        of those, one per loader (Lightning's list of lists).

    Raises:
        ValueError: under several data-parallel ranks, outputs that cannot be split per sample (dataset order
            is per sample: each rank's batches hold every D-th sample).
        RuntimeError: a ``predict_step`` that does not take ``dataloader_idx`` with several loaders
            (:func:`check_dataloader_idx`).
    """
    rt = runtime
    num_batches = [loader_length(loader) for loader in loaders] if num_batches is None else num_batches
    several = len(loaders) > 1
    check_dataloader_idx(loop_module, "predict", several)
    extra = _extra_forwards(rt, num_batches) if rt.strategy.forward_communicates else [0] * len(loaders)
    hook("on_predict_epoch_start")
    outputs = [_predict_loader(rt, loop_module, wrapped, (loader, move), n, hook, i if several else None, more)
               for i, (loader, n, more) in enumerate(zip(loaders, num_batches, extra))]
    hook("on_predict_epoch_end")
    results = [_gathered(rt, loop_module, out) for out in outputs]
    return results if several else results[0]


def _predict_loader(rt: Runtime, loop_module: Any, wrapped: Any, source: tuple[Any, Callable | None],
                    num_batches: float, hook: Callable[..., Any], dataloader_idx: int | None, extra: int) -> list:
    """One loader's per-batch predictions on this rank (on the CPU), then ``extra`` discarded forwards (``source``:
    as :func:`_evaluate_loader`'s)."""
    communicates = rt.strategy.forward_communicates
    loader, move = source
    idx = () if dataloader_idx is None else (dataloader_idx,)
    outputs, batch = [], None
    for batch_idx, batch in enumerate(itertools.islice(loader, None if num_batches == math.inf else num_batches)):
        batch = rt.to_device(batch) if move is None else move(batch, dataloader_idx or 0)
        hook("on_predict_batch_start", batch, batch_idx, *idx)
        with rt.autocast():
            out = (wrapped(batch, batch_idx, stage="predict", dataloader_idx=dataloader_idx) if communicates
                   else loop_module.predict(batch, batch_idx, dataloader_idx))
        hook("on_predict_batch_end", out, batch, batch_idx, *idx)
        outputs.append(out.detach().cpu() if isinstance(out, torch.Tensor) else out)
    _extra_runs(rt, wrapped, batch, "predict", extra, dataloader_idx)
    return outputs


def _gathered(rt: Runtime, loop_module: Any, outputs: list) -> Any:
    """One loader's predictions from every rank (:func:`_in_dataset_order`), in the form :func:`predict` returns."""
    ordered = _in_dataset_order(rt, outputs)
    if loop_module.plain_model:
        return ordered
    return outputs if rt.world_size == 1 else _in_batches(ordered, _columns(outputs[:1]))


def _in_batches(ordered: Any, first: Any) -> list:
    """Dataset-ordered predictions (a tensor, or a dict of tensors or lists) cut into batches of as many samples
    as ``first`` (this rank's first batch, as :func:`_columns` joins it; ``[]``: none) holds: Lightning's list of
    per-batch outputs."""
    size = 0 if first is None or isinstance(first, list) else _rows(first)
    if not size:
        return [ordered] if _rows(ordered) else []
    if isinstance(ordered, torch.Tensor):
        return list(ordered.split(size))
    total = _length(next(iter(ordered.values())))
    return [{k: v[i:i + size] for k, v in ordered.items()} for i in range(0, total, size)]


def model_eval(trainer: Trainer, loop_module: Any, wrapped: torch.nn.Module,
               stage: str) -> list[tuple[torch.nn.Module, bool]]:
    """Lightning's ``on_<stage>_model_eval`` before an evaluation's ``on_<stage>_start``: the module's override where
    it has one (Monte Carlo dropout keeps its dropout on), else ``wrapped.eval()``. Returns each submodule's
    ``training`` flag from before, for :func:`model_train`."""
    modes = [(m, m.training) for m in wrapped.modules()]
    hook = MODE_HOOKS[stage][0]
    if hook in loop_module.overrides:
        with trainer._running(hook):
            getattr(loop_module.model, hook)()
    else:
        wrapped.eval()
    return modes


def model_train(trainer: Trainer, loop_module: Any, modes: list[tuple[torch.nn.Module, bool]], stage: str) -> None:
    """Lightning's ``on_<stage>_model_train`` after an evaluation's ``on_<stage>_end``: the module's override where it
    has one, else each submodule's ``training`` flag as :func:`model_eval` found it. Restoring the flags, rather than
    calling ``train()``, keeps a submodule the user put in eval mode (a frozen backbone's BatchNorm) so: Lightning's
    ``_ModuleMode`` (``loops/utilities.py``). Predict has no such hook: its flags are always restored."""
    hook = MODE_HOOKS[stage][1]
    if hook is not None and hook in loop_module.overrides:
        with trainer._running(hook):
            getattr(loop_module.model, hook)()
        return
    for m, training in modes:
        m.training = training


def _in_dataset_order(runtime: Runtime, outputs: list) -> Any:
    """Interleave the data-parallel ranks' outputs back into dataset order (sample j was on data-parallel rank
    j % D, its j // D-th). Ranks that share their batches (the ``tp`` ranks of a group) hold the same outputs:
    the first of each group is taken, so each sample is returned once.

    Each rank sends its outputs as columns: one contiguous tensor (a dict: one per key, or one list), placed with
    one strided copy per rank (a per-sample view would pickle its whole storage: the cost would grow with the
    square of the samples)."""
    mine = _columns(outputs)
    data_rank = runtime.strategy.data_world(runtime.world).rank
    gathered = runtime.all_gather_object((data_rank, mine)) if runtime.world_size > 1 else [(data_rank, mine)]
    by_data_rank: dict[int, Any] = {}
    for rank, theirs in gathered:
        by_data_rank.setdefault(rank, theirs)
    per_rank = [by_data_rank[r] for r in sorted(by_data_rank)]
    if any(columns is None for columns in per_rank):  # decided on the gathered values: the same on every rank
        if len(per_rank) == 1:
            return outputs
        raise ValueError("predict_step returned outputs that cannot be split per sample (a tensor, or a dict of "
                         "tensors or lists, with the batch's length first), so several ranks' predictions cannot be "
                         "put back in dataset order; return per-sample values")
    per_rank = [columns for columns in per_rank if _rows(columns)]  # ranks that predicted nothing
    if not per_rank:
        return [] if not outputs or not isinstance(outputs[0], dict) else {}
    if isinstance(per_rank[0], dict):
        return {key: _interleave([columns[key] for columns in per_rank]) for key in per_rank[0]}
    return _interleave(per_rank)


def _columns(outputs: list) -> Any:
    """One rank's per-batch predictions joined along the samples: a tensor, or a dict of tensors (or lists) with
    the same keys in every batch; ``[]`` for no batch; None when they cannot be split per sample."""
    if not outputs:
        return []
    if all(isinstance(o, torch.Tensor) and o.dim() > 0 for o in outputs):
        return torch.cat([o.detach() for o in outputs])
    if not _per_sample_dicts(outputs):
        return None
    return {key: _joined([o[key] for o in outputs]) for key in outputs[0]}


def _per_sample_dicts(outputs: list) -> bool:
    """Dicts with the same keys in every batch, each value a tensor or list with the batch's length first."""
    if not all(isinstance(o, dict) and o for o in outputs) or len({tuple(o) for o in outputs}) != 1:
        return False
    lengths = [{_length(v) for v in o.values()} for o in outputs]
    return all(len(n) == 1 and None not in n for n in lengths)


def _joined(values: list) -> Any:
    """One key's per-batch values as one column: tensors concatenated (on the CPU), lists chained."""
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.cat([v.detach().cpu() for v in values])
    return [item for v in values for item in v]


def _length(value: Any) -> int | None:
    """The leading length of a tensor (not 0-d) or a list; None for anything else."""
    if isinstance(value, list):
        return len(value)
    return value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None


def _rows(columns: Any) -> int:
    return _length(next(iter(columns.values()))) if isinstance(columns, dict) else len(columns)


def _interleave(parts: list) -> Any:
    """The data-parallel ranks' columns back in dataset order: sample j from rank j % R, its j // R-th."""
    ranks, total = len(parts), sum(map(len, parts))
    if all(isinstance(p, torch.Tensor) for p in parts):
        ordered = parts[0].new_empty((total, *parts[0].shape[1:]))
        for r, part in enumerate(parts):
            ordered[r::ranks] = part
        return ordered
    return [parts[j % ranks][j // ranks] for j in range(total)]


def checkpoint_to_evaluate(trainer: Trainer, ckpt_path: Any, method: str = "validate") -> Path | None:
    """The checkpoint whose weights ``validate``/``test``/``predict`` evaluate, as Lightning's ``ckpt_path``:
    None (the model's own weights), "best" (the ``best_model_path`` of the trainer's first ``ModelCheckpoint``: by its
    ``monitor``, the newest without one, as Lightning), "last"
    (the newest checkpoint of this script's runs under ``default_root_dir``, as ``fit(ckpt_path="last")``) or a path.
    Resolved in the calling process, before any ``ddp_spawn`` start, so every rank loads the same file.

    "last" when no run of this script has a checkpoint yet: a warning and None, as Lightning (so the value can be
    set before the first ``fit``). Messages begin as Lightning's (``_CheckpointConnector._parse_ckpt_path``).

    Raises:
        ValueError: "best" without a ``ModelCheckpoint``, or with one that has saved no checkpoint; a value of
            another type.
        FileNotFoundError: a path that does not exist.
    """
    from trainscale.callbacks import ModelCheckpoint
    from trainscale.checkpointing.runs import script_key

    if ckpt_path is None:
        return None
    if ckpt_path == "best":
        best = [cb.best_model_path for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
        if len(best) > 1:
            warnings.warn(f'`.{method}(ckpt_path="best")` is called with Trainer configured with multiple '
                          "`ModelCheckpoint` callbacks. It will use the best checkpoint path from first checkpoint "
                          "callback.", UserWarning, stacklevel=3)
        best = best[:1]
        if not best:  # Lightning: the first ModelCheckpoint's (the newest without a monitor)
            raise ValueError(f'`.{method}(ckpt_path="best")` is set but `ModelCheckpoint` is not configured: add one to '
                             "the Trainer's callbacks and fit first, or pass a checkpoint's path, 'last' or None")
        if not best[0]:
            raise ValueError(f'`.{method}(ckpt_path="best")` is set but `ModelCheckpoint` is not configured to save the '
                             "best model (it has saved no checkpoint: fit first); or pass a checkpoint's path, 'last' "
                             "or None")
        return Path(best[0])
    if ckpt_path == "last":
        found = ckpt.find_last(trainer.config.default_root_dir, script=script_key())
        if found is None:
            warnings.warn(f'.{method}(ckpt_path="last") is set, but there is no last checkpoint available (no run of '
                          f"{script_key()} under {str(trainer.config.default_root_dir)!r} has one). No checkpoint "
                          "will be loaded: the model's own weights are evaluated", UserWarning, stacklevel=3)
        return found
    if not isinstance(ckpt_path, (str, Path)):
        raise ValueError(f"ckpt_path={ckpt_path!r}; pass a checkpoint path, 'best', 'last' or None")
    if not Path(ckpt_path).exists():
        raise FileNotFoundError(f"ckpt_path={str(ckpt_path)!r} does not exist; pass an existing checkpoint, 'best', "
                                "'last' or None (the model's own weights)")
    return Path(ckpt_path)


class NoModelError(TypeError, ValueError):
    """``validate``/``test``/``predict`` without a model on a Trainer that has not fitted one: a ``TypeError``, as
    Lightning raises it, and a ``ValueError``, as trainscale's other errors of a call's arguments."""


def fitted_model(trainer: Trainer, method: str, ckpt_path: Any) -> tuple[Any, Any]:
    """``(model, ckpt_path)`` for ``validate``/``test``/``predict`` called without a model: the model of the
    trainer's last ``fit`` (``trainer.fitted_module``; a ``ddp_spawn`` fit's too, its ranks' weights loaded), and,
    when ``ckpt_path`` is None, its best checkpoint (the first ``ModelCheckpoint``'s ``best_model_path``: the newest
    without a monitor), with Lightning's warning (``_parse_ckpt_path``).

    Raises:
        NoModelError: no fit ran on this trainer (a ``TypeError`` as Lightning's, and a ``ValueError``).
        ValueError: ``ckpt_path`` None and no ``ModelCheckpoint`` has saved.
    """
    from trainscale.callbacks import ModelCheckpoint

    model = trainer.fitted_module
    if model is None:  # Lightning's words first
        raise NoModelError(f"`Trainer.{method}()` requires a `LightningModule` when it hasn't been passed in a previous "
                           f"run: {method}() without a model needs an earlier fit() on this Trainer; pass the model: "
                           f"trainer.{method}(model, loader)")
    if ckpt_path is not None:
        return model, ckpt_path
    saved = [cb.best_model_path for cb in trainer.callbacks
             if isinstance(cb, ModelCheckpoint) and cb.best_model_path]
    if not saved:
        raise ValueError(f"{method}() without a model evaluates the best checkpoint of the last fit (as Lightning), "
                         "but no ModelCheckpoint has saved one; pass the model (its current weights) or a ckpt_path")
    warnings.warn(f"`.{method}(ckpt_path=None)` was called without a model. The best model of the previous `fit` call "
                  f"will be used ({saved[0]}). You can pass `.{method}(ckpt_path='best')` to use the best model or "
                  f"`.{method}(ckpt_path='last')` to use the last model. If you pass a value, this warning will be "
                  "silenced.", stacklevel=3)
    return model, Path(saved[0])


def check_steps(method: str, model: torch.nn.Module, has_training_step: bool) -> None:
    """Lightning's checks of the module before ``validate``/``test``/``predict`` (its
    ``trainer/configuration_validator.py``), with its words, then the fix.

    Raises:
        ValueError: ``validate``/``test`` of a module with ``training_step`` but no ``validation_step``/``test_step``;
            ``predict`` with ``predict_step`` set to None, or without ``forward`` and without its own ``predict_step``;
            the stage's step taking Lightning's ``dataloader_iter`` (:func:`refuse_dataloader_iter`).
    """
    refuse_dataloader_iter(model, (f"{method}_step" if method != "validate" else "validation_step",))
    step = {"validate": "validation_step", "test": "test_step"}.get(method)
    if step is not None and has_training_step and getattr(model, step, None) is None:
        raise ValueError(f"No `{step}()` method defined to run `Trainer.{method}`. {method}() needs "
                         f"{type(model).__name__}.{step}(batch, batch_idx); it defines training_step but no {step}, so "
                         "there is nothing to evaluate (Lightning refuses it too)")
    if method != "predict":
        return
    if "predict_step" in vars(model) and model.predict_step is None:  # set to None on the instance
        raise ValueError("`predict_step` cannot be None to run `Trainer.predict`: define predict_step(self, batch, "
                         "batch_idx), or leave the default, which returns self(batch)")
    own_step = isinstance(model, TrainingModule) and is_overridden("predict_step", model)
    if getattr(model, "forward", None) is None and not own_step:
        raise ValueError("`Trainer.predict` requires `forward` method to run: define forward, or a predict_step")


def run_stage(trainer: Trainer, method: str, model: Any, dataloaders: Any, loss_fn: Any = None,
              ckpt_path: Path | None = None, datamodule: Any = None, verbose: bool = False) -> Any:
    """``Trainer.validate``/``test``/``predict`` outside ``fit`` (``method``): ``model`` set up by the trainer's
    runtime, with the weights of ``ckpt_path`` when given (:func:`checkpoint_to_evaluate`; only the model's, the
    SHA-256 verified), the loader (passed, or from ``datamodule``'s or the model's hook: ``data_sources``) made
    sequential and unpadded (each sample once; several loaders each so, ``data_sources.eval_loaders``), their batches
    under the stage's ``limit_*_batches`` in ``trainer.num_test_batches``/``num_predict_batches`` (Lightning's lists),
    then :func:`predict` or :func:`evaluate_stage` (its results as Lightning's list of one dict per loader);
    ``verbose``: rank zero prints the results (:func:`results_table`)."""
    rt = trainer.runtime
    attach_trainer(model, trainer)  # self.trainer inside the module's setup(stage), as Lightning
    trainer.start_stage(model)  # configure_callbacks, the warning about hooks trainscale never calls
    if datamodule is not None:
        trainer.datamodule = datamodule
    stage = {"validate": "validation", "test": "test", "predict": "predict"}[method]
    off = trainer.config.eval_batches(stage, 1) == 0  # limit_*_batches=0: Lightning's loop skips the stage
    dataloaders, _ = resolve_loaders(rt, method, model, dataloaders, datamodule,
                                     lambda: trainer.set_up_callbacks(model, method), request=not off)
    trainer.last_setup = set_up_model(rt, model, loss_fn, trainer.last_setup)  # an earlier fit's: as it was
    _, loop_module, wrapped = trainer.last_setup
    trainer._arm_hooks(model)
    check_steps(method, model, loop_module.has_training_step)
    if ckpt_path is not None:
        rt.load(ckpt_path, {checkpointer.weights_key(checkpointer.is_sharded(ckpt_path)): model},
                strict=checkpointer.strict_loading(model))
        rt.print(f"trainscale: {method} with the weights of {ckpt_path}")
    model.zero_grad()  # Lightning's _run_stage frees the gradients before each stage runs
    loaders, num_batches = _stage_loaders(trainer, dataloaders, stage)
    if off:
        return _skipped_stage(trainer, model, method)
    if method == "predict":
        return _predict_stage(trainer, model, loop_module, wrapped, (loaders, dataloaders), num_batches)
    trainer.stage_dataloaders["val" if method == "validate" else method] = dataloaders.in_given_form(loaders)
    if method == "test":
        trainer.num_test_batches = num_batches
    results = evaluate_stage(trainer, loop_module, wrapped, loaders, stage, num_batches)
    if not loop_module.plain_model:  # Lightning's: what the module logged with logger=True (a returned value is
        # in the run's records only); a plain model: trainscale's val_loss, val_acc, ...
        results = [{k: v for k, v in r.items() if k in trainer.metric_collector.to_logger} for r in results]
    if verbose:
        rt.print(results_table(stage, results))
    teardown(trainer, model, method)
    return results  # Lightning's shape: one dict per evaluation loader


def _skipped_stage(trainer: Trainer, model: Any, method: str) -> list | None:
    """A stage turned off by its ``limit_*_batches=0``: its teardown hooks, then what Lightning's skipped loop returns
    (``[]`` from ``validate``/``test``, None from ``predict``); no batch counts (``num_test_batches`` ``[]``)."""
    if method == "test":
        trainer.num_test_batches = []
    if method == "predict":
        trainer.num_predict_batches = []
    teardown(trainer, model, method)
    return None if method == "predict" else []


def eval_loader(runtime: Runtime, loader: Any, seed: int | None, shuffle: bool | None = None) -> Any:
    """An evaluation loader as this rank reads it: a DataLoader split without padding (``Runtime.setup_dataloader``
    with ``even=False``: each sample on one rank; one that keeps its order on one data-parallel rank is returned as
    given); any other iterable (a wrapper of a loader, a generator's iterable) as given when there is one
    data-parallel rank, as Lightning takes any iterable (it re-creates only DataLoaders). ``shuffle``: as
    ``setup_dataloader``'s.

    Raises:
        TypeError: an object that cannot be iterated (Lightning's words: "An invalid dataloader was passed");
            an iterable other than a DataLoader on several data-parallel ranks, where every rank would read every
            sample (named with the fix).
    """
    if isinstance(loader, torch.utils.data.DataLoader):
        return runtime.setup_dataloader(loader, seed=seed or 0, shuffle=shuffle, even=False)
    try:
        iter(loader)  # as Lightning's _check_dataloader_iterable (a DataLoader is not asked: its iter() starts workers)
    except TypeError:
        raise TypeError(f"An invalid dataloader was passed. Found {loader!r}: an evaluation loader must be a "
                        "torch.utils.data.DataLoader, or an iterable of batches (a list, tuple or dict holds several "
                        "loaders)") from None
    if runtime.data_parallel_size > 1:
        raise TypeError(f"an evaluation loader is a {type(loader).__name__}, not a torch.utils.data.DataLoader, so "
                        f"trainscale cannot give each of the {runtime.data_parallel_size} data-parallel ranks its share "
                        "(every rank would evaluate every sample); pass the DataLoader itself, or a DataLoader over "
                        "an IterableDataset that yields only its rank's share (shards_by_rank = True)")
    return loader


def _stage_loaders(trainer: Trainer, dataloaders: list, stage: str) -> tuple[list, list[float]]:
    """Each of a stage's loaders as this rank reads it (sequential, unpadded: each sample on one rank:
    :func:`eval_loader`), and its batches under the stage's ``limit_*_batches``."""
    seed = fit_seed(trainer.config.seed)
    loaders = [eval_loader(trainer.runtime, dl, seed, shuffle=False) for dl in dataloaders]
    return loaders, [trainer.config.eval_batches(stage, loader_length(loader)) for loader in loaders]


def _predict_stage(trainer: Trainer, model: Any, loop_module: Any, wrapped: Any, loaders: tuple[list, Any],
                   num_batches: list[float]) -> Any:
    """``Trainer.predict``'s stage: :func:`predict` between ``on_predict_start`` and ``on_predict_end``, then the
    teardown hooks; ``loaders``: this rank's and those given (``data_sources.EvalLoaders``: their form, for
    ``trainer.predict_dataloaders``); ``num_batches`` (each loader's, under ``limit_predict_batches``) in
    ``trainer.num_predict_batches``."""
    trainer.num_predict_batches = num_batches
    loaders, given = loaders
    for loader in loaders:  # as evaluate_stage's (before the index recording wraps their batch samplers)
        set_sampler_epoch(loader, trainer.current_epoch)
    recorded = [with_index_recording(loader) for loader in loaders]  # each batch's sample indices, for the writers
    loaders, trainer.predict_batch_indices = [loader for loader, _ in recorded], [seen for _, seen in recorded]
    trainer.stage_dataloaders["predict"] = given.in_given_form(loaders)
    with grad_mode(trainer):  # inference_mode or no_grad, as Lightning's loop
        modes = model_eval(trainer, loop_module, wrapped, "predict")
        trainer._hook("on_predict_start")
        predictions = predict(trainer.runtime, loop_module, wrapped, loaders, trainer._hook, num_batches,
                              trainer.batch_transfer)
        trainer._hook("on_predict_end")
        model_train(trainer, loop_module, modes, "predict")
    teardown(trainer, model, "predict")
    return predictions


def teardown(trainer: Trainer, model: Any, stage: str) -> None:
    """Lightning's teardown hooks once a stage ("fit", "validate", "test", "predict") has ended normally, in its
    order (``trainer/call.py``, ``_call_teardown_hook``): the data module's ``teardown(stage=...)``, then each
    callback's ``teardown(trainer, model, stage)`` (their ``setup`` ran at its start), then the module's
    ``teardown(stage=...)``. A hook that is missing (a plain ``nn.Module``, a data module without one) is skipped.
    ``stage`` reaches them as Lightning's ``TrainerFn``, a ``str`` enum."""
    stage = TrainerFn(stage)
    hook = getattr(trainer.datamodule, "teardown", None)
    if callable(hook):
        hook(stage=stage)
    for cb in trainer.callbacks:
        cb.teardown(trainer, model, stage=stage)  # by keyword, as Lightning calls it
    hook = getattr(model, "teardown", None)
    if callable(hook):
        hook(stage=stage)


def results_table(stage: str, results: list[dict[str, float]]) -> str:
    """The results of ``validate``/``test`` as the table Lightning prints (``_EvaluationLoop._print_results``): a
    "<Stage> metric" column and one "DataLoader N" column per loader, each metric on one row under its name without
    the ``/dataloader_idx_N`` suffix (blank where a loader has none), sorted by name, centred::

        Test metric    DataLoader 0    DataLoader 1
        -------------  --------------  --------------
          test_loss        0.4321          0.5678
    """
    from tabulate import tabulate  # on rank zero, when verbose

    results = [{name.split("/dataloader_idx_")[0]: value for name, value in r.items()} for r in results]
    rows = [(name, *(_shown(r[name]) if name in r else "" for r in results))
            for name in sorted(set().union(*results))]
    headers = (f"{stage} metric".capitalize(), *(f"DataLoader {i}" for i in range(len(results))))
    return tabulate(rows, headers, tablefmt="simple", disable_numparse=True, colalign=("center",) * len(headers))


def _shown(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def merged(results: list[dict[str, float]]) -> dict[str, float]:
    """One evaluation's per-loader results in one dict (what an epoch record and ``callback_metrics`` take: with
    several loaders each name ends in its ``/dataloader_idx_N``; what the epoch hooks logged is the same in each)."""
    return {name: value for r in results for name, value in r.items()}


def evaluate_stage(trainer: Trainer, loop_module: Any, wrapped: Any, loaders: list, stage: str,
                   num_batches: list[float] | None = None) -> list[dict[str, float]]:
    """:func:`evaluate` of ``loaders`` between Lightning's ``on_<stage>_start`` and ``on_<stage>_end`` hooks, with
    ``trainer.metric_collector`` (where ``self.log`` in the steps and hooks goes) a collector of ``stage``
    meanwhile; on ``num_batches[i]`` (default: ``limit_val_batches``/``limit_test_batches``) of each rank's batches
    of loader i. Returns one dict per loader. The results (:func:`merged`) are in ``trainer.callback_metrics`` by
    ``on_<stage>_end`` (where Lightning's checkpoint callbacks read them). Each loader's sampler is told the epoch
    first (``set_sampler_epoch``: ``trainer.current_epoch``, the running one in a fit, the epochs done outside it),
    as Lightning's loops do for shuffling that follows the training's progress."""
    for loader in loaders:
        set_sampler_epoch(loader, trainer.current_epoch)
    collector = trainer.metric_collector
    trainer.metric_collector = stage_collector = MetricCollector(trainer.runtime, stage, routes_of=collector)
    if num_batches is None:
        num_batches = [trainer.config.eval_batches(stage, loader_length(loader)) for loader in loaders]
    with grad_mode(trainer):  # inference_mode or no_grad, as Lightning's loop
        modes = model_eval(trainer, loop_module, wrapped, stage)
        try:
            trainer._hook(f"on_{stage}_start")
            per_loader = evaluate(trainer.runtime, loop_module, wrapped, loaders, stage, stage_collector, num_batches,
                                  trainer._hook, trainer.batch_transfer)
        finally:
            trainer.metric_collector = collector
        collector.keep_evaluation_steps(stage_collector, record=not trainer.sanity_checking)
        results = merged(per_loader)
        # what the module logged (a plain model: trainscale's val_loss, ...), a value logged on_step and on_epoch
        # also under its bare name ("val_acc" beside "val_acc_epoch"), as in Lightning's callback_metrics, where
        # EarlyStopping(monitor="val_acc") finds it; the records keep the two, and every value returned by the step
        logged = {k: v for k, v in results.items() if k in stage_collector.logged}
        trainer._publish(loop_module.plain_model, results, logged, stage_collector)
        trainer._hook(f"on_{stage}_end")
        model_train(trainer, loop_module, modes, stage)
    return per_loader


def grad_mode(trainer: Trainer) -> Any:
    """The autograd mode an evaluation stage runs in, hooks included (Lightning's ``_no_grad_context``):
    ``torch.inference_mode()`` with ``Trainer(inference_mode=True)`` (the default), else ``torch.no_grad()``; also
    ``no_grad`` on a gloo process group and under a strategy whose forward runs collectives (fsdp, hsdp, tp, pp),
    where Lightning uses it too (pytorch/pytorch#95957)."""
    dist = torch.distributed
    gloo = dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"
    if trainer.config.inference_mode and not gloo and not trainer.runtime.strategy.forward_communicates:
        return torch.inference_mode()
    return torch.no_grad()
