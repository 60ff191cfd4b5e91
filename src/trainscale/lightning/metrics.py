"""What ``TrainingModule.log`` collects, and its reduction across ranks.

Values stay on the device until a record is written: step values (``on_step``) at log intervals,
epoch values (``on_epoch``) at the end of the epoch or evaluation. Epoch values are reduced over
the data-parallel ranks (every sample counted once): "mean" is the sample-weighted mean
(``sum(value·n) / sum(n)`` with ``n`` the micro-batch's sample count, Lightning's ``batch_size``), "sum",
"max" and "min" their namesakes over every logged value. The ranks of a tensor-parallel group (or of one
pipeline) read the same samples and log the same values, so a sum over all ranks counts each of them
``world_size / data_parallel_size`` times: it is divided by that, as the epoch's training loss is
(``state.EpochLoss.totals``). Step values are each rank's last value, averaged over ranks when
logged with ``sync_dist=True``.

A torchmetrics ``Metric`` logged as the value is treated as Lightning treats it: its step value is the batch value
of its last ``forward`` (``metric(preds, target)``; nothing when only ``update`` was called), its epoch value
``metric.compute()`` (torchmetrics gathers the states of every rank itself), after which it is reset; ``reduce_fx``
and ``sync_dist`` do not apply. torchmetrics is never imported here: a ``Metric`` is recognised only once its
package is loaded.
"""

from __future__ import annotations

import contextlib
import numbers
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainscale.telemetry.processor import RECORD_FIELDS

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime

REDUCE_FX = ("mean", "sum", "max", "min")
# Every field trainscale's own records hold: a logged value of that name would replace it in the step and epoch
# records and in summary.json (which `trainscale report`, `check` and `bench` read). The losses are not here: a
# module's own "train_loss" or "val_loss" is what Lightning users log, and theirs is the one recorded.
RESERVED = {"step": "the optimizer step", "epoch": "the epoch", "kind": "the record's kind", "rank": "the rank",
            "time": "the wall-clock time", "epoch_time_s": "the epoch's duration", "partial": "a cut-short epoch",
            "grad_norm": "the gradient norm before clipping",
            **{name: "a telemetry figure" for name in RECORD_FIELDS}}
RESERVED_PREFIXES = {"lr-": "the learning rates (LearningRateMonitor's names)"}
_DEFAULTS = {"train": (True, False), "validation": (False, True), "test": (False, True)}  # (on_step, on_epoch)
# Lightning's _FxValidator (trainer/connectors/logger_connector/fx_validator.py): the hooks in which self.log raises,
# and those in which it logs epoch values only (their default too); in the others the stage's defaults hold
NO_LOGGING_HOOKS = frozenset({
    "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end", "on_train_end",
    "on_validation_end", "on_test_end", "on_exception", "on_save_checkpoint", "on_load_checkpoint", "setup",
    "configure_optimizers",
    *(f"on_predict_{point}" for point in ("start", "end", "epoch_start", "epoch_end", "batch_start", "batch_end"))})
EPOCH_ONLY_HOOKS = frozenset({"on_train_start", "on_validation_start", "on_test_start", *(
    f"on_{stage}_epoch_{point}" for stage in ("train", "validation", "test") for point in ("start", "end"))})


def check_loggable(name: str, value: Any, add_dataloader_idx: bool = True) -> None:
    """Raise Lightning's ``ValueError`` for a value ``self.log`` cannot record: anything but a number, a tensor or a
    torchmetrics ``Metric`` (``LightningModule.__check_allowed``), and, with ``add_dataloader_idx``, for a name that
    carries ``/dataloader_idx_``, the suffix added to the names logged while one of several evaluation loaders runs."""
    if not isinstance(value, (numbers.Number, torch.Tensor)) and not is_metric(value):
        what = "nested dictionaries" if isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()) \
            else f"`{type(value).__name__}` values"
        raise ValueError(f"`self.log({name}, {value})` was called, but {what} cannot be logged: log a number, a "
                         f"one-element tensor or a torchmetrics Metric, and several values with "
                         f"self.log_dict({{name: value, ...}})")
    if add_dataloader_idx and "/dataloader_idx_" in name:
        raise ValueError(f"You called `self.log` with the key `{name}` but it should not contain information about "
                         "`dataloader_idx` when `add_dataloader_idx=True`: log it as "
                         f"{name.split('/dataloader_idx_')[0]!r} (with several evaluation loaders the suffix is added "
                         "for you), or pass add_dataloader_idx=False to keep the name as given")


def reserved_field(name: str) -> str | None:
    """What the run's own records hold under ``name`` (:data:`RESERVED`, :data:`RESERVED_PREFIXES`), or None."""
    return RESERVED.get(name) or next((v for k, v in RESERVED_PREFIXES.items() if name.startswith(k)), None)


def _hook_levels(hook: str | None, on_step: bool | None, on_epoch: bool | None) -> tuple[bool | None, bool | None]:
    """``on_step`` and ``on_epoch`` as the hook ``hook`` allows them (Lightning's ``_FxValidator``); None still
    means the stage's default.

    Raises:
        ValueError: see :meth:`MetricCollector.log`.
    """
    if hook in NO_LOGGING_HOOKS:
        raise ValueError(f"You can't `self.log()` inside `{hook}`: log in a step or in a batch or epoch hook. HINT: "
                         "You can still log directly to the logger by using `self.logger.experiment`")
    if hook not in EPOCH_ONLY_HOOKS:
        return on_step, on_epoch
    for flag, value, allowed in (("on_step", on_step, False), ("on_epoch", on_epoch, True)):
        if value is not None and value is not allowed:
            raise ValueError(f"You can't `self.log({flag}={value})` inside `{hook}`, must be one of ({allowed},): "
                             f"it logs the epoch's value (drop {flag}=...)")
    return False, True


@dataclass
class _Running:
    fx: str
    total: torch.Tensor
    weight: float


class MetricCollector:
    """Collects ``log`` calls of one stage ("train", "validation", "test") on one rank.

    Args:
        runtime: the Trainer's Runtime (device, collectives).
        stage: sets Lightning's defaults: training logs per step, evaluation per epoch.
        routes_of: a collector whose :attr:`prog_bar` and :attr:`to_logger` this one adds to (the Trainer's, for
            an evaluation's collector), so that ``trainer.progress_bar_metrics`` and ``logged_metrics`` see every
            stage's names.
    """

    def __init__(self, runtime: Runtime, stage: str, routes_of: MetricCollector | None = None) -> None:
        self.rt = runtime
        self.stage = stage
        self.batch_size = 1  # set by the loop before each step: the weight of a "mean"
        self.discard = False  # True while evaluation runs forwards whose results are dropped (fsdp's extra ones)
        self.step_values: dict[str, tuple[torch.Tensor, bool, str]] = {}  # name -> (value, sync_dist, reduce_fx)
        self.unpublished = False  # a step value logged that Trainer.callback_metrics has not taken yet
        self.epoch_values: dict[str, _Running] = {}
        self.epoch_metrics: dict[str, Any] = {}  # name -> a torchmetrics Metric logged on_epoch: computed at the end
        self.metrics_seen: dict[int, Any] = {}  # every Metric logged since the last epoch end: reset there
        # the names (as kept: "x", or "x_step" and "x_epoch") logged with prog_bar=True, and with logger=True
        self.prog_bar: set[str] = routes_of.prog_bar if routes_of is not None else set()
        self.to_logger: set[str] = routes_of.to_logger if routes_of is not None else set()
        self.in_epoch_hook = False  # in on_train_epoch_start/end: Lightning's defaults there are on_epoch=True
        # the last evaluation batch's values logged on_step with logger=True or prog_bar=True ("x_step";
        # keep_evaluation_steps): in trainer.logged_metrics or progress_bar_metrics, not in callback_metrics, as Lightning's
        self.evaluation_steps: dict[str, torch.Tensor] = {}
        self.logged: set[str] = set()  # every name logged so far (in callback_metrics the user's value wins)
        self.bare: dict[str, str] = {}  # "x_step" and "x_epoch" -> "x", for a value logged on_step and on_epoch
        # the evaluation loader running, set by the loop when there are several (its values' names end in
        # "/dataloader_idx_N"); None: one loader, training, or an epoch hook
        self.dataloader_idx: int | None = None
        self.loader_of: dict[str, int | None] = {}  # each epoch value's name -> the loader it was logged in
        # (hook, name, loader) -> the options it was first logged with there (Lightning's _Metadata of a key)
        self.options: dict[tuple, tuple] = {}

    @contextlib.contextmanager
    def epoch_hook(self):
        """For a block that runs ``on_train_epoch_start``/``_end`` hooks: ``self.log`` there defaults to
        ``on_step=False, on_epoch=True`` (Lightning's ``_FxValidator``), each rank's value weighted alike."""
        self.in_epoch_hook, batch_size, self.batch_size = True, self.batch_size, 1
        try:
            yield
        finally:
            self.in_epoch_hook, self.batch_size = False, batch_size

    def log(self, name: str, value: Any, *, on_step: bool | None = None, on_epoch: bool | None = None,
            prog_bar: bool = False, sync_dist: bool = False, reduce_fx: Any = "mean",
            batch_size: int | None = None, logger: bool = True, hook: str | None = None,
            add_dataloader_idx: bool = True) -> None:
        """Record ``value`` (a number or one-element tensor) under ``name``; see ``TrainingModule.log``. ``hook``: the
        Lightning hook it is called from (None: a step method or outside the hooks). While one of several evaluation
        loaders runs (:attr:`dataloader_idx`) the names end in ``/dataloader_idx_N``, unless ``add_dataloader_idx``
        is False (Lightning's ``_ResultCollection.log``).

        Raises:
            ValueError: an unknown ``reduce_fx``; a value that is not a number, a tensor or a torchmetrics
                ``Metric`` (None, a string, a list, a dict: Lightning's message, naming ``log_dict`` and ``mean()``)
                or a tensor with more than one element; a name with ``/dataloader_idx_`` (Lightning adds that
                suffix itself) unless ``add_dataloader_idx`` is False; a name logged with ``add_dataloader_idx=False``
                in two loaders of one evaluation; a name of :data:`RESERVED` (naming another); a ``hook`` of
                :data:`NO_LOGGING_HOOKS`, ``on_step=True`` or ``on_epoch=False`` in one of :data:`EPOCH_ONLY_HOOKS`,
                ``on_step=False`` with ``on_epoch=False``; a name logged in one hook with other options than before
                (Lightning's ``MisconfigurationException`` in each case).
        """
        on_step, on_epoch = _hook_levels(hook, on_step, on_epoch)
        reduce_fx = reduction_name(reduce_fx)
        check_loggable(name, value, add_dataloader_idx)
        what = reserved_field(name)
        if what is not None:
            raise ValueError(f"self.log({name!r}, ...): trainscale's records already hold {name!r} ({what}), which "
                             f"this value would replace; log it under another name, e.g. 'my_{name}'")
        if self.discard:
            return
        on_step, on_epoch, step_name, epoch_name = self._names(name, on_step, on_epoch, add_dataloader_idx)
        self._check_same_options(hook, name, add_dataloader_idx,
                                 (on_step, on_epoch, prog_bar, logger, reduce_fx, sync_dist, add_dataloader_idx))
        if not (on_step or on_epoch):  # nothing would be kept
            raise ValueError(f"`self.log({name!r}, on_step=False, on_epoch=False)` is not useful: pass on_step=True "
                             "(each step's value) or on_epoch=True (the epoch's reduced value)")
        kept = [n for n, on in ((step_name, on_step), (epoch_name, on_epoch)) if on]
        if prog_bar:
            self.prog_bar.update(kept)
        if logger:
            self.to_logger.update(kept)
        if is_metric(value):
            self._log_metric(step_name if on_step else None, epoch_name if on_epoch else None, value)
            return
        value = self._scalar(name, value)
        if on_step:
            self.step_values[step_name] = (value, sync_dist, reduce_fx)
            self.unpublished = True
        if on_epoch:
            self._accumulate(epoch_name, value, reduce_fx, self.batch_size if batch_size is None else batch_size)

    def _names(self, name: str, on_step: bool | None, on_epoch: bool | None,
               add_dataloader_idx: bool = True) -> tuple[bool, bool, str, str]:
        """``on_step`` and ``on_epoch`` with Lightning's defaults for this stage or hook, and the names the value is
        kept under (``name_step``/``name_epoch`` when both; while one of several evaluation loaders runs each followed
        by its ``/dataloader_idx_N`` unless ``add_dataloader_idx`` is False, as Lightning's ``_forked_name``), noted
        in :attr:`logged` and :attr:`bare`, an epoch value's loader in :attr:`loader_of`."""
        idx = self.dataloader_idx
        suffix = "" if idx is None or not add_dataloader_idx else f"/dataloader_idx_{idx}"
        default_step, default_epoch = (False, True) if self.in_epoch_hook else _DEFAULTS[self.stage]
        on_step = default_step if on_step is None else on_step
        on_epoch = default_epoch if on_epoch is None else on_epoch
        both = on_step and on_epoch
        step_name = f"{name}_step{suffix}" if both else f"{name}{suffix}"
        epoch_name = f"{name}_epoch{suffix}" if both else f"{name}{suffix}"
        name = f"{name}{suffix}"
        if both:
            self.bare[step_name] = self.bare[epoch_name] = name
        self.logged.update((name, step_name, epoch_name))
        if on_epoch:
            self._note_loader(epoch_name)
        return on_step, on_epoch, step_name, epoch_name

    def _check_same_options(self, hook: str | None, name: str, add_dataloader_idx: bool, options: tuple) -> None:
        """Raises Lightning's ``ValueError`` (its ``MisconfigurationException``) when ``name`` was logged in this hook
        (a step method when ``hook`` is None), for this loader, with other options (``on_step``, ``on_epoch``,
        ``prog_bar``, ``logger``, ``reduce_fx``, ``sync_dist``, ``add_dataloader_idx``) by this collector before:
        Lightning keeps one result per hook and name, with the options it was first logged with."""
        fx = hook or {"train": "training_step"}.get(self.stage, f"{self.stage}_step")
        first = self.options.setdefault((fx, name, self.dataloader_idx if add_dataloader_idx else None), options)
        if first != options:
            raise ValueError(f"You called `self.log({name}, ...)` twice in `{fx}` with different arguments. This is "
                             "not allowed: log it with the same arguments each time, or under another name")

    def _note_loader(self, epoch_name: str) -> None:
        """Note the evaluation loader ``epoch_name`` is logged in (:attr:`loader_of`), for :meth:`by_loader`.

        Raises:
            ValueError: the name was logged in another loader of this evaluation (with ``add_dataloader_idx=False``:
                the two loaders' values would mix; Lightning refuses it too).
        """
        before = self.loader_of.setdefault(epoch_name, self.dataloader_idx)
        if None not in (before, self.dataloader_idx) and before != self.dataloader_idx:
            raise ValueError(f"self.log({epoch_name!r}, ..., add_dataloader_idx=False) was called in dataloader "
                             f"{before} and in dataloader {self.dataloader_idx}, which would mix their values; give "
                             f"each loader its own name (e.g. f'{epoch_name}_{{dataloader_idx}}') or drop "
                             "add_dataloader_idx=False")

    def by_loader(self, values: dict[str, float], loaders: int) -> list[dict[str, float]]:
        """``values`` (:meth:`take_epoch_values`'s) split into one dict per evaluation loader, as Lightning's results:
        each loader's dict holds what was logged while it ran, and every dict what was logged outside the loaders'
        steps (in ``on_validation_epoch_end``, ...); the names noted are cleared."""
        where, self.loader_of = self.loader_of, {}
        return [{k: v for k, v in values.items() if where.get(k) in (None, i)} for i in range(loaders)]

    def _log_metric(self, step_name: str | None, epoch_name: str | None, metric: Any) -> None:
        """A torchmetrics ``Metric``, as Lightning logs it: per step the batch value of its last ``forward``
        (none when only ``update()`` was called), per epoch kept for ``compute()`` (:meth:`take_epoch_values`);
        not averaged by ``sync_dist`` (torchmetrics syncs its own states in ``compute()``)."""
        self.metrics_seen[id(metric)] = metric
        if step_name is not None and metric._forward_cache is not None:
            self.step_values[step_name] = (self._scalar(step_name, metric._forward_cache), False, "mean")
            self.unpublished = True
        if epoch_name is None:
            return
        kept = self.epoch_metrics.setdefault(epoch_name, metric)
        if kept is not metric:
            raise ValueError(f"self.log({epoch_name!r}, metric) was given two different Metric objects in one epoch; "
                             "log one Metric object per name (make one attribute per metric in __init__)")

    def _scalar(self, name: str, value: Any) -> torch.Tensor:
        value = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value,
                                dtype=torch.float32, device=self.rt.device)
        if value.numel() != 1:  # Lightning's message, with the shape
            raise ValueError(f"`self.log({name}, {value})` was called, but the tensor must have a single element "
                             f"(it has shape {tuple(value.shape)}). You can try doing `self.log({name}, value.mean())`")
        return value.reshape(())

    def _accumulate(self, name: str, value: torch.Tensor, fx: str, n: int) -> None:
        running = self.epoch_values.get(name)
        if running is None:
            self.epoch_values[name] = _Running(fx, value * n if fx == "mean" else value.clone(), float(n))
            return
        if running.fx != fx:
            raise ValueError(f"{name!r} was logged with reduce_fx={running.fx!r} and then {fx!r}; use one")
        if fx == "mean":
            running.total += value * n
        elif fx == "sum":
            running.total += value
        else:
            running.total = torch.maximum(running.total, value) if fx == "max" else torch.minimum(running.total, value)
        running.weight += n

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """The step values as they stand (device tensors: no host sync, no collective), for
        ``trainer.callback_metrics`` after every optimizer step, as Lightning's; on several ranks without the
        ``sync_dist`` ones, which are reduced over the ranks at the log steps (:meth:`take_step_values`). Clears
        :attr:`unpublished`."""
        local, self.unpublished = self.rt.world_size == 1, False
        return self.with_bare_names({name: v for name, (v, sync, _) in self.step_values.items() if local or not sync})

    def with_bare_names(self, values: dict) -> dict:
        """``values`` and, for a value logged ``on_step`` and ``on_epoch``, its bare name too (``x`` beside ``x_step``
        or ``x_epoch``), as Lightning's ``callback_metrics`` hold it."""
        return {**values, **{self.bare[n]: v for n, v in values.items() if n in self.bare}}

    def take_step_values(self) -> dict[str, float]:
        """The last step values as floats (those logged with ``sync_dist=True`` reduced over all ranks with their
        ``reduce_fx``: "sum", "mean", "max" or "min", as Lightning's ``sync_dist``); cleared. Every rank calls it
        at the same step: a collective with several ranks (:func:`_check_sync_dist_everywhere`, then one
        all-reduce of the sums and means and one per max or min, when some value has ``sync_dist``).

        Raises:
            ValueError: on every rank, when ``sync_dist`` values were logged on some ranks only, or under other
                names or reductions on each (naming the ranks and the names).
        """
        values, self.step_values = self.step_values, {}
        synced = {name: (value, fx) for name, (value, sync, fx) in sorted(values.items()) if sync}
        out = {name: value for name, (value, sync, _) in values.items() if not sync}
        if self.rt.world_size > 1:
            _check_sync_dist_everywhere(self.rt, list(synced))
        if synced and self.rt.world_size > 1:
            _check_same_names(self.rt, [(n, fx) for n, (_, fx) in synced.items()], "sync_dist=True step values")
            out.update(_reduced_over_ranks(self.rt, synced))
        else:
            out.update((name, value) for name, (value, _) in synced.items())
        return {name: float(v) for name, v in out.items()}

    def keep_evaluation_steps(self, evaluation: MetricCollector, record: bool) -> None:
        """Take ``evaluation``'s last step values (:meth:`take_step_values`: a collective, every rank calls it) and,
        with ``record`` (not in the sanity check), keep those logged with ``logger=True`` or ``prog_bar=True`` in
        :attr:`evaluation_steps`, where Lightning's ``logged_metrics`` and ``progress_bar_metrics`` have them
        (``val_loss_step``; its ``_LoggerConnector.on_batch_end``)."""
        values = evaluation.take_step_values()
        if record:
            self.evaluation_steps.update((k, torch.tensor(v)) for k, v in values.items()
                                         if k in self.to_logger or k in self.prog_bar)

    def take_epoch_values(self) -> dict[str, float]:
        """The epoch values reduced over all ranks (a collective: every rank calls it), and each ``Metric`` logged
        ``on_epoch``'s ``compute()`` (it gathers every rank's states); cleared (the Metrics: :meth:`reset_metrics`).

        Raises:
            ValueError: ranks logged different names (the names that differ are listed).
        """
        values, self.epoch_values = self.epoch_values, {}
        metrics, self.epoch_metrics = self.epoch_metrics, {}
        names = sorted(values)
        if self.rt.world_size > 1:
            _check_same_names(self.rt, [(n, values[n].fx) for n in names] + [(n, "Metric") for n in sorted(metrics)],
                              "epoch values")
        out = self._reduce_sums({n: values[n] for n in names if values[n].fx in ("mean", "sum")})
        # every rank computes the same Metrics in the same order: each compute() gathers that metric's states
        out.update((n, float(metrics[n].compute())) for n in sorted(metrics))
        for fx in ("max", "min"):
            chosen = [n for n in names if values[n].fx == fx]
            if chosen:
                reduced = self.rt.all_reduce(torch.stack([values[n].total for n in chosen]), op=fx).tolist()
                out.update(zip(chosen, reduced))
        return out

    def drop_values(self) -> None:
        """Forget the step and epoch values not yet taken (logged outside a loop, or after a previous fit's last log
        step) and the options each name was logged with: a fit starts from none, as Lightning resets its results
        when a run starts."""
        self.step_values, self.epoch_values, self.epoch_metrics, self.unpublished = {}, {}, {}, False
        self.options = {}

    def reset_metrics(self) -> None:
        """Reset every torchmetrics ``Metric`` logged since the last call (also those logged ``on_step`` only), as
        Lightning does once an epoch's end hooks have run (until then ``metric.compute()`` returns the epoch value)."""
        seen, self.metrics_seen = self.metrics_seen, {}
        for metric in seen.values():
            metric.reset()

    def _reduce_sums(self, values: dict[str, _Running]) -> dict[str, float]:
        """"mean" and "sum" values over the data-parallel ranks: one all-reduce of every total and weight over
        all ranks, a sum divided by the copies of each sample (a mean's copies cancel)."""
        if not values:
            return {}
        names = list(values)
        weights = [torch.tensor(values[n].weight, device=self.rt.device) for n in names]
        vec = self.rt.all_reduce(torch.stack([values[n].total for n in names] + weights)).tolist()
        copies = self.rt.world_size / self.rt.data_parallel_size
        return {name: vec[i] / vec[len(names) + i] if values[name].fx == "mean" else vec[i] / copies
                for i, name in enumerate(names)}


def _reduced_over_ranks(runtime: Runtime, values: dict[str, tuple[torch.Tensor, str]]) -> dict[str, torch.Tensor]:
    """Each value (name -> (0-dim tensor, reduce_fx)) reduced over all ranks with its ``reduce_fx`` (a "mean" is
    the sum over the world size): one all-reduce of the sums and means, one of the maxima, one of the minima."""
    out = {}
    for fxs, op in ((("sum", "mean"), "sum"), (("max",), "max"), (("min",), "min")):
        chosen = [name for name, (_, fx) in values.items() if fx in fxs]
        if chosen:
            reduced = runtime.all_reduce(torch.stack([values[n][0] for n in chosen]), op=op)
            out.update((n, r / runtime.world_size if values[n][1] == "mean" else r)
                       for n, r in zip(chosen, reduced.unbind()))
    return out


def logged_metrics(callback_metrics: dict, collector: MetricCollector) -> dict[str, torch.Tensor]:
    """Lightning's ``trainer.logged_metrics``: the values in ``callback_metrics`` of the names logged with
    ``logger=True`` (the default), as kept (``x_step`` and ``x_epoch`` for a value logged on_step and on_epoch, not
    the bare ``x``), as tensors, and the last evaluation batch's step values (:attr:`MetricCollector.evaluation_steps`);
    trainscale's own numbers (throughput, the loss it records) are not among them."""
    steps = {name: v for name, v in collector.evaluation_steps.items() if name in collector.to_logger}
    return {**steps, **{name: v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                        for name, v in callback_metrics.items() if name in collector.to_logger}}


def progress_bar_metrics(callback_metrics: dict, collector: MetricCollector) -> dict[str, float]:
    """Lightning's ``trainer.progress_bar_metrics``: the values in ``callback_metrics`` of the names logged with
    ``prog_bar=True`` (``x_step`` and ``x_epoch`` as :func:`logged_metrics`) and the last evaluation batch's step
    values logged so (:attr:`MetricCollector.evaluation_steps`), as floats (one host read each)."""
    return {name: float(v) for values in (collector.evaluation_steps, callback_metrics)
            for name, v in values.items() if name in collector.prog_bar}


def is_metric(value: Any) -> bool:
    """Whether ``value`` is a torchmetrics ``Metric`` (without importing torchmetrics: one exists only once it is)."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, torchmetrics.Metric)


@contextlib.contextmanager
def metric_states_kept(module: torch.nn.Module):
    """The states of ``module``'s torchmetrics ``Metric`` submodules put back after the block: forwards whose results
    are discarded (the extra evaluation forwards of a rank with fewer batches under fsdp) leave no sample in them.
    Reads torchmetrics' ``metric_state`` and ``_update_count`` (torchmetrics 1.x)."""
    torchmetrics = sys.modules.get("torchmetrics")
    metrics = [m for m in module.modules() if isinstance(m, torchmetrics.Metric)] if torchmetrics else []
    saved = [(m, {k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in m.metric_state.items()},
              m._update_count) for m in metrics]
    try:
        yield
    finally:
        for metric, state, count in saved:
            for name, value in state.items():
                setattr(metric, name, value)
            metric._update_count, metric._computed = count, None


def reduction_name(reduce_fx: Any) -> str:
    """``reduce_fx`` as one of :data:`REDUCE_FX`, from every spelling Lightning's ``self.log`` takes: the names in any
    case, "avg" for "mean", and ``torch.mean``, ``torch.sum``/``sum``, ``torch.max``/``max``, ``torch.min``/``min``.

    Raises:
        ValueError: any other value (Lightning refuses custom reductions too, in the words the message begins with).
    """
    if isinstance(reduce_fx, str):
        name = {"avg": "mean"}.get(reduce_fx.lower(), reduce_fx.lower())
        if name in REDUCE_FX:
            return name
    for name, functions in _REDUCE_FUNCTIONS.items():
        if any(reduce_fx is fn for fn in functions):
            return name
    raise ValueError("Only `self.log(..., reduce_fx={min,max,mean,sum})` are supported. If you need a custom "
                     f"reduction, please log a `torchmetrics.Metric` instance instead. Found: {reduce_fx}; "
                     f"choose one of {', '.join(map(repr, REDUCE_FX))} (or torch.mean, torch.sum, torch.max, "
                     "torch.min, or the builtins sum, max, min)")


_REDUCE_FUNCTIONS = {"mean": (torch.mean,), "sum": (torch.sum, sum), "max": (torch.max, max), "min": (torch.min, min)}


def _check_sync_dist_everywhere(runtime: Runtime, synced: list[str]) -> None:
    """Whether this rank has ``sync_dist`` step values to average, compared across ranks in one all-reduce of a
    flag per rank (``world_size`` numbers, one host read, at log intervals only): a rank that logged such a value
    while another did not would wait in the average's all-reduce that the other never joins, until the
    collective timeout. The names are gathered (``all_gather_object``) only when the flags differ.

    Raises:
        ValueError: on every rank, naming the metrics and the ranks that logged them and those that did not.
    """
    flags = torch.zeros(runtime.world_size, device=runtime.device)
    flags[runtime.rank] = 1.0 if synced else 0.0
    logged = runtime.all_reduce(flags).tolist()
    if 0 < sum(logged) < len(logged):
        names = sorted({n for rank_names in runtime.all_gather_object(synced) for n in rank_names})
        ranks = [r for r, flag in enumerate(logged) if flag]
        others = [r for r, flag in enumerate(logged) if not flag]
        raise ValueError(f"self.log({', '.join(map(repr, names))}, ..., sync_dist=True) was called on rank(s) {ranks} "
                         f"and not on rank(s) {others} in this log interval: a sync_dist value is averaged over every "
                         "rank, so every rank must log it (log 0 where a rank has nothing, or drop sync_dist=True)")


def _check_same_names(runtime: Runtime, names: list, what: str) -> None:
    """Raise on every rank when the ranks' ``names`` differ (one ``all_gather_object``)."""
    every = [{str(n) for n in rank_names} for rank_names in runtime.all_gather_object(names)]
    different = sorted(set().union(*every) - set.intersection(*every))
    if different:
        raise ValueError(f"ranks logged different {what}: {', '.join(different)} not logged on every rank; "
                         "call self.log with the same names on every rank (log 0 where a rank has nothing)")
