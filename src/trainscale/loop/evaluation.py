"""Validation, test and prediction loops: every sample counted once across ranks.

Evaluation loaders are split without padding (``UnpaddedDistributedSampler``: rank ``r`` of ``W``
takes samples ``r, r + W, ...``), so ranks may hold one batch more or less. No collective runs
inside the loop, except the forwards themselves under a strategy whose forward communicates (fsdp
all-gathers parameters): there every rank runs as many forwards as the rank with the most batches,
the extra results discarded.
"""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from trainscale.checkpointing import checkpointer, run_dirs as ckpt
from trainscale.checkpointing.rng import fit_seed
from trainscale.lightning.data_sources import resolve_loaders
from trainscale.lightning.metrics import MetricCollector, metric_states_kept
from trainscale.lightning.module import attach_trainer, set_up_model
from trainscale.loop.state import loader_length

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime
    from trainscale.loop.trainer import Trainer


def _extra_forwards(runtime: Runtime, num_batches: int) -> int:
    """Forwards this rank must add so that all ranks run the most batches of any rank.

    Raises:
        ValueError: some rank has no batch at all (fewer samples than ranks).
    """
    most, neg_least = runtime.all_reduce(torch.tensor([num_batches, -num_batches], device=runtime.device),
                                         op="max").tolist()
    if -neg_least == 0 and most > 0:
        raise ValueError(f"strategy={runtime.config.strategy!r} evaluates through collectives, but some rank has no "
                         "evaluation batch; give the evaluation set at least as many samples as ranks")
    return most - num_batches


def _no_hook(name: str, *args: Any) -> None:
    pass


def evaluate(runtime: Runtime, loop_module: Any, wrapped: Any, loader: Any, stage: str, collector: Any,
             num_batches: int | None = None, hook: Callable[..., Any] = _no_hook) -> dict[str, float]:
    """Sample-weighted means over the whole set (or its first ``num_batches`` batches on each rank) of what
    ``<stage>_step`` returned (or loss and accuracy for a plain classifier), prefixed ``val_``/``test_``, plus
    what ``self.log`` collected (as named, also in ``on_<stage>_epoch_end``). A key returned by some batches only
    is the mean over those batches' samples.

    ``hook(name, *args)`` runs Lightning's ``on_<stage>_epoch_start``, ``on_<stage>_batch_start(batch,
    batch_idx)``, ``on_<stage>_batch_end(outputs, batch, batch_idx)`` (outputs: the step's dict, a tensor as
    ``{"loss": tensor}``) and ``on_<stage>_epoch_end`` (``Trainer._hook``).
    Sums and counts stay on the device; one all-reduce at the end. A collective: every rank calls it.

    Raises:
        ValueError: on every rank, when a key was returned on some ranks and never on another that had
            batches (as ``self.log`` names logged on some ranks only), naming the key and the ranks.
    """
    rt = runtime
    prefix = "val_" if stage == "validation" else "test_"
    num_batches = loader_length(loader) if num_batches is None else num_batches  # inf: an iterable, to its end
    communicates = rt.strategy.forward_communicates
    if communicates and num_batches == math.inf:
        raise ValueError(f"strategy={rt.config.strategy!r} evaluates through collectives, so every rank must know its "
                         "number of batches: give the evaluation loader a map-style data set, or limit_val_batches")
    extra = _extra_forwards(rt, num_batches) if communicates else 0
    modes = eval_mode(wrapped)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}  # samples of the batches that returned each key
    count = 0
    batch = None
    hook(f"on_{stage}_epoch_start")
    for batch_idx, batch in enumerate(itertools.islice(loader, None if num_batches == math.inf else num_batches)):
        batch = rt.to_device(batch)
        collector.batch_size = _count(batch)
        hook(f"on_{stage}_batch_start", batch, batch_idx)
        with rt.autocast():
            metrics, n = (wrapped(batch, batch_idx, stage=stage) if communicates
                          else loop_module.evaluate(batch, batch_idx, stage))
        hook(f"on_{stage}_batch_end", metrics, batch, batch_idx)
        for key, value in metrics.items():
            value = torch.as_tensor(value, device=rt.device).detach().float() * n
            sums[key] = sums[key] + value if key in sums else value
            counts[key] = counts.get(key, 0) + n
        count += n
    collector.discard = True  # results and self.log values discarded: each sample is still counted once
    with metric_states_kept(loop_module):  # and what a torchmetrics Metric's update() took from them is undone
        for _ in range(extra):
            with rt.autocast():
                wrapped(batch, 0, stage=stage)
    collector.discard = False
    hook(f"on_{stage}_epoch_end")  # what it logs is among this stage's values
    keys = _same_keys_on_every_rank(rt, sorted(sums), count > 0, f"{stage}_step")  # a rank with no batch takes part
    zero = torch.zeros((), device=rt.device)
    vec = rt.all_reduce(torch.stack([sums.get(k, zero) for k in keys] + [zero + counts.get(k, 0) for k in keys]
                                    )).tolist() if keys else []
    restore_modes(modes)
    out = {f"{prefix}{k}": (total / n if n else math.nan) for k, total, n in zip(keys, vec, vec[len(keys):])}
    out.update(collector.take_epoch_values())
    collector.reset_metrics()
    return out


def _same_keys_on_every_rank(runtime: Runtime, keys: list[str], had_batches: bool, step: str) -> list[str]:
    """The keys of every rank (one ``all_gather_object``); raise on every rank when a rank that had batches never
    returned a key that another rank returned: its mean would silently cover some ranks' samples only."""
    every = runtime.all_gather_object((keys, had_batches))
    union = sorted(set().union(*(set(k) for k, _ in every)))
    missing = {key: [r for r, (k, had) in enumerate(every) if had and key not in k] for key in union}
    missing = {key: ranks for key, ranks in missing.items() if ranks}
    if missing:
        named = "; ".join(f"{key!r} not on rank(s) {', '.join(map(str, ranks))}" for key, ranks in missing.items())
        raise ValueError(f"{step} returned keys on some ranks only ({named}); return the same keys on every rank "
                         "(a key may be left out of some batches: its mean is over the batches that returned it)")
    return union


def _count(batch: Any) -> int:
    from trainscale.runtime.batch import batch_size

    return batch_size(batch)


def predict(runtime: Runtime, loop_module: Any, wrapped: Any, loader: Any, hook: Callable[..., Any] = _no_hook,
            num_batches: float | None = None) -> Any:
    """Every sample's prediction, gathered from all ranks in dataset order (each sample once), between
    Lightning's ``on_predict_epoch_start`` and ``on_predict_epoch_end``, with ``on_predict_batch_start(batch,
    batch_idx)`` and ``on_predict_batch_end(outputs, batch, batch_idx)`` around each batch (``hook(name, *args)``).

    Returns:
        For a module with Lightning's steps (``loop_module.plain_model`` False), Lightning's list of per-batch
        outputs: in one process each batch's output as ``predict_step`` returned it; on several ranks every
        sample in dataset order, cut into batches of the first batch's length (Lightning returns each rank's own
        batches only). For a plain model: one tensor (the per-batch outputs concatenated along dim 0) when its
        outputs are tensors; one dict of such tensors (or lists) when they are dicts of tensors (or lists) of
        the batch's length; else, in one process only, the list of per-batch outputs.

    Raises:
        ValueError: under several data-parallel ranks, outputs that cannot be split per sample (dataset order
            is per sample: each rank's batches hold every D-th sample).
    """
    rt = runtime
    communicates = rt.strategy.forward_communicates
    num_batches = loader_length(loader) if num_batches is None else num_batches  # each rank's first ones
    extra = _extra_forwards(rt, num_batches) if communicates else 0
    modes = eval_mode(wrapped)
    outputs, batch = [], None
    hook("on_predict_epoch_start")
    for batch_idx, batch in enumerate(itertools.islice(loader, None if num_batches == math.inf else num_batches)):
        batch = rt.to_device(batch)
        hook("on_predict_batch_start", batch, batch_idx)
        with rt.autocast():
            out = wrapped(batch, batch_idx, stage="predict") if communicates else loop_module.predict(batch, batch_idx)
        hook("on_predict_batch_end", out, batch, batch_idx)
        outputs.append(out.detach().cpu() if isinstance(out, torch.Tensor) else out)
    for _ in range(extra):
        with rt.autocast():
            wrapped(batch, 0, stage="predict")
    hook("on_predict_epoch_end")
    restore_modes(modes)
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


def eval_mode(module: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """Put ``module`` in eval mode for an evaluation; returns each submodule's ``training`` flag before it, for
    :func:`restore_modes`. Restoring them, rather than calling ``train()``, keeps a submodule the user put in eval
    mode (a frozen backbone's BatchNorm) so: Lightning's ``_ModuleMode`` (``utilities/model_helpers.py``)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    return modes


def restore_modes(modes: list[tuple[torch.nn.Module, bool]]) -> None:
    """Set each submodule's ``training`` flag back to what :func:`eval_mode` found."""
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


def fitted_model(trainer: Trainer, method: str, ckpt_path: Any) -> tuple[Any, Any]:
    """``(model, ckpt_path)`` for ``validate``/``test``/``predict`` called without a model: the model of the
    trainer's last ``fit``, and, when ``ckpt_path`` is None, its best checkpoint (the first ``ModelCheckpoint``'s
    ``best_model_path``: the newest without a monitor), with Lightning's warning (``_parse_ckpt_path``).

    Raises:
        ValueError: no fit ran on this trainer; ``ckpt_path`` None and no ``ModelCheckpoint`` has saved.
    """
    from trainscale.callbacks import ModelCheckpoint

    if trainer.last_setup is None or trainer._fit is None:
        raise ValueError(f"{method}() without a model needs an earlier fit() on this Trainer; pass the model: "
                         f"trainer.{method}(model, loader)")
    if ckpt_path is not None:
        return trainer._fit.model, ckpt_path
    saved = [cb.best_model_path for cb in trainer.callbacks
             if isinstance(cb, ModelCheckpoint) and cb.best_model_path]
    if not saved:
        raise ValueError(f"{method}() without a model evaluates the best checkpoint of the last fit (as Lightning), "
                         "but no ModelCheckpoint has saved one; pass the model (its current weights) or a ckpt_path")
    warnings.warn(f"`.{method}(ckpt_path=None)` was called without a model. The best model of the previous `fit` call "
                  f"will be used ({saved[0]}). You can pass `.{method}(ckpt_path='best')` to use the best model or "
                  f"`.{method}(ckpt_path='last')` to use the last model. If you pass a value, this warning will be "
                  "silenced.", stacklevel=3)
    return trainer._fit.model, Path(saved[0])


def run_stage(trainer: Trainer, method: str, model: Any, dataloaders: Any, loss_fn: Any = None,
              ckpt_path: Path | None = None, datamodule: Any = None, verbose: bool = False) -> Any:
    """``Trainer.validate``/``test``/``predict`` outside ``fit`` (``method``): ``model`` set up by the trainer's
    runtime, with the weights of ``ckpt_path`` when given (:func:`checkpoint_to_evaluate`; only the model's, the
    SHA-256 verified), the loader (passed, or from ``datamodule``'s or the model's hook: ``data_sources``) made
    sequential and unpadded (each sample once), then :func:`predict` or :func:`evaluate_stage` (its results as
    Lightning's list of one dict per loader); ``verbose``: rank zero prints the results (:func:`results_table`)."""
    rt = trainer.runtime
    attach_trainer(model, trainer)  # self.trainer inside the module's setup(stage), as Lightning
    if datamodule is not None:
        trainer.datamodule = datamodule
    dataloaders, _ = resolve_loaders(rt, method, model, dataloaders, datamodule,
                                     lambda: trainer.set_up_callbacks(model, method))
    trainer.last_setup = set_up_model(rt, model, loss_fn, trainer.last_setup)  # an earlier fit's: as it was
    _, loop_module, wrapped = trainer.last_setup
    trainer._arm_hooks(model)
    step = {"validate": "validation_step", "test": "test_step"}.get(method)
    if step is not None and loop_module.has_training_step and getattr(model, step, None) is None:
        raise ValueError(f"{method}() needs {type(model).__name__}.{step}(batch, batch_idx); it defines training_step "
                         f"but no {step}, so there is nothing to evaluate (Lightning refuses it too)")
    if ckpt_path is not None:
        rt.load(ckpt_path, {checkpointer.weights_key(checkpointer.is_sharded(ckpt_path)): model})
        rt.print(f"trainscale: {method} with the weights of {ckpt_path}")
    loader = rt.setup_dataloader(dataloaders, seed=fit_seed(trainer.config.seed), shuffle=False, even=False)
    if method == "predict":
        trainer._hook("on_predict_start")
        predictions = predict(rt, loop_module, wrapped, loader, trainer._hook,
                              trainer.config.eval_batches("predict", loader_length(loader)))
        trainer._hook("on_predict_end")
        teardown(trainer, model, method)
        return predictions
    stage = "validation" if method == "validate" else "test"
    results = evaluate_stage(trainer, loop_module, wrapped, loader, stage)
    if not loop_module.plain_model:  # Lightning's: what the module logged with logger=True (a returned value is
        # in the run's records only); a plain model: trainscale's val_loss, val_acc, ...
        results = {k: v for k, v in results.items() if k in trainer.metric_collector.to_logger}
    if verbose:
        rt.print(results_table(stage, results))
    teardown(trainer, model, method)
    return [results]  # Lightning's shape: one dict per evaluation loader (trainscale takes one)


def teardown(trainer: Trainer, model: Any, stage: str) -> None:
    """Lightning's teardown hooks once a stage ("fit", "validate", "test", "predict") has ended normally, in its
    order (``trainer/call.py``, ``_call_teardown_hook``): the data module's ``teardown(stage=...)``, then each
    callback's ``teardown(trainer, model, stage)`` (their ``setup`` ran at its start), then the module's
    ``teardown(stage=...)``. A hook that is missing (a plain ``nn.Module``, a data module without one) is skipped."""
    hook = getattr(trainer.datamodule, "teardown", None)
    if callable(hook):
        hook(stage=stage)
    for cb in trainer.callbacks:
        cb.teardown(trainer, model, stage)
    hook = getattr(model, "teardown", None)
    if callable(hook):
        hook(stage=stage)


def results_table(stage: str, results: dict[str, float]) -> str:
    """The results of ``validate``/``test`` as the table Lightning prints (``_EvaluationLoop._print_results``): a
    "<Stage> metric" column and one "DataLoader 0" column, metrics sorted by name, centred::

        Test metric    DataLoader 0
        -------------  --------------
          test_loss        0.4321
    """
    from tabulate import tabulate  # on rank zero, when verbose

    rows = [(name, f"{value:.6g}" if isinstance(value, float) else str(value)) for name, value in sorted(results.items())]
    return tabulate(rows, (f"{stage} metric".capitalize(), "DataLoader 0"), tablefmt="simple", disable_numparse=True,
                    colalign=("center", "center"))


def evaluate_stage(trainer: Trainer, loop_module: Any, wrapped: Any, loader: Any, stage: str,
                   num_batches: float | None = None) -> dict[str, float]:
    """:func:`evaluate` between Lightning's ``on_<stage>_start`` and ``on_<stage>_end`` hooks, with
    ``trainer.metric_collector`` (where ``self.log`` in the steps and hooks goes) a collector of ``stage``
    meanwhile; on ``num_batches`` (default: ``limit_val_batches``/``limit_test_batches``) of each rank's batches.
    The results are in ``trainer.callback_metrics`` by ``on_<stage>_end`` (where Lightning's checkpoint callbacks
    read them)."""
    collector = trainer.metric_collector
    trainer.metric_collector = stage_collector = MetricCollector(trainer.runtime, stage, routes_of=collector)
    if num_batches is None:
        num_batches = trainer.config.eval_batches(stage, loader_length(loader))
    try:
        trainer._hook(f"on_{stage}_start")
        results = evaluate(trainer.runtime, loop_module, wrapped, loader, stage, stage_collector, num_batches,
                           trainer._hook)
    finally:
        trainer.metric_collector = collector
    # what the module logged (a plain model: trainscale's val_loss, ...), a value logged on_step and on_epoch also
    # under its bare name ("val_acc" beside "val_acc_epoch"), as in Lightning's callback_metrics, where
    # EarlyStopping(monitor="val_acc") finds it; the records keep the two, and every value returned by the step
    logged = {k: v for k, v in results.items() if k in stage_collector.logged}
    trainer._publish(loop_module.plain_model, results, logged, stage_collector)
    trainer._hook(f"on_{stage}_end")
    return results
