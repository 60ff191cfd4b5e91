"""Optimizers and learning-rate schedulers as Lightning's ``configure_optimizers`` returns them.

Every form Lightning documents (``LightningModule.configure_optimizers``) is accepted:

- an optimizer;
- ``(optimizer, scheduler)`` (trainscale's earlier form);
- two lists ``[optimizers], [schedulers]``;
- a dict ``{"optimizer": opt, "lr_scheduler": sched | {"scheduler", "interval", "frequency", "monitor"},
  "monitor": ...}``, or a list/tuple of such dicts;
- a list of optimizers (several optimizers: manual optimization only).

Each scheduler becomes Lightning's ``LRSchedulerConfig`` (``trainscale.utilities.types``; what
``trainer.lr_scheduler_configs`` holds), with Lightning's keys: ``interval`` "epoch" (default) or "step", ``frequency``
(every N epochs or steps), ``monitor`` (the metric a ``ReduceLROnPlateau`` reads, e.g. "val_loss"), ``strict``,
``name``, ``reduce_on_plateau``. The Trainer steps each through the module's ``lr_scheduler_step(scheduler, metric)``
(:func:`step_schedulers`; the default :func:`lr_scheduler_step`).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

import torch

from trainscale.runtime.strategies.apply_fsdp import gradient_sync_for
from trainscale.utilities.types import LRSchedulerConfig

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime

_PLATEAU = torch.optim.lr_scheduler.ReduceLROnPlateau
_SCHEDULER_KEYS = {field.name for field in fields(LRSchedulerConfig)}  # the lr_scheduler dict's keys, Lightning's
_PLATEAU_KEYS = ("reduce_on_plateau", "monitor", "strict")  # ignored under manual optimization


def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
    """Lightning's default ``LightningModule.lr_scheduler_step``: ``scheduler.step()``, or ``scheduler.step(metric)``
    for a scheduler that reads a monitored value (``metric`` not None). A module's own hook replaces it."""
    if metric is None:
        scheduler.step()
    else:
        scheduler.step(metric)


def step_schedulers(schedulers, interval: str, count: int, metrics: dict[str, Any],
                    step: Callable[[Any, Any], None] = lr_scheduler_step, plateau: bool | None = None) -> None:
    """Step the ``interval`` ("epoch" or "step") schedulers due at ``count`` (counted from 1: the epoch's number, or
    for "step" ones the epoch's batch index + 1 at an optimizer step, as Lightning's, so with accumulation or across
    epochs ``frequency`` counts batches, not optimizer steps; every ``frequency``-th), each through ``step(scheduler, metric)`` (the module's ``lr_scheduler_step``, as Lightning's
    ``_update_learning_rates``), ``metric`` the monitored value of a ``reduce_on_plateau`` one (its ``monitor`` in
    ``metrics``), else None. ``plateau`` True or False: only the ``reduce_on_plateau`` ones or only the others
    (Lightning steps a step's plateau schedulers after its metrics are logged and its validation ran).

    Raises:
        ValueError: the monitored metric is not among ``metrics`` (the available names are listed) and ``strict``
            (without it: a ``RuntimeWarning``, and the scheduler does not step, as Lightning's; Lightning raises its
            ``MisconfigurationException``).
    """
    for config in schedulers:
        if (config.interval != interval or count % config.frequency
                or (plateau is not None and config.reduce_on_plateau != plateau)):
            continue
        metric = None
        if config.reduce_on_plateau:
            if config.monitor not in metrics:
                said = (f"ReduceLROnPlateau conditioned on metric {config.monitor!r} which is not available"
                        + (" but strict is set to False: the scheduler did not step" if not config.strict else "")
                        + f". Available metrics are: {', '.join(sorted(metrics))} (this {interval}); log it or "
                        "change 'monitor'")
                if config.strict:
                    raise ValueError(said)
                warnings.warn(said, RuntimeWarning, stacklevel=2)
                continue
            metric = metrics[config.monitor]
        step(config.scheduler, metric)


class NoOptimizer(torch.optim.Optimizer):
    """What a fit trains with when ``configure_optimizers`` returns None (Lightning's ``_MockOptimizer``): it holds
    no parameters, so ``step()`` and ``zero_grad()`` change nothing, and its state is empty."""

    def __init__(self) -> None:
        super().__init__([torch.zeros(1)], {})  # torch refuses an empty list; add_param_group below keeps none

    def add_param_group(self, param_group: dict) -> None:
        pass

    def step(self, closure: Any = None) -> Any:
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


@dataclass(frozen=True)
class Optimization:
    """What ``configure_optimizers`` (or the ``optimizer`` factory) returned, normalised."""

    optimizers: tuple
    schedulers: tuple[LRSchedulerConfig, ...] = ()


def _scheduler(entry: Any, monitor: str | None, manual: bool) -> LRSchedulerConfig:
    """One scheduler (or ``lr_scheduler`` dict) as Lightning's ``_configure_schedulers_automatic_opt`` and
    ``_configure_schedulers_manual_opt`` make its config: ``monitor``, the one beside it in the optimizer dict, for a
    ``ReduceLROnPlateau`` given alone; under ``manual`` optimization ``reduce_on_plateau``/``monitor``/``strict`` are
    ignored (the module steps its schedulers).

    Raises:
        ValueError: a dict without "scheduler", an unknown ``interval``, a ``frequency`` that is not an int >= 1.
    """
    if not isinstance(entry, dict):
        plateau = isinstance(entry, _PLATEAU) and not manual
        return LRSchedulerConfig(entry, reduce_on_plateau=plateau, monitor=monitor if plateau else None)
    given = _known_keys(entry, manual)
    given.setdefault("reduce_on_plateau", isinstance(entry["scheduler"], _PLATEAU) and not manual)
    if given["reduce_on_plateau"]:
        given.setdefault("monitor", monitor)
    config = LRSchedulerConfig(**given)
    if config.interval not in ("epoch", "step"):
        raise ValueError(f'The "interval" key in lr scheduler dict must be "step" or "epoch", not {config.interval!r}')
    if isinstance(config.frequency, bool) or not isinstance(config.frequency, int) or config.frequency < 1:
        raise ValueError(f"lr_scheduler frequency={config.frequency!r} must be an int >= 1")
    return config


def _known_keys(entry: dict, manual: bool) -> dict:
    """The keys of an ``lr_scheduler`` dict that make its config: Lightning's, with a ``RuntimeWarning`` for the
    others and, under ``manual`` optimization, for ``reduce_on_plateau``/``monitor``/``strict`` (left out too).

    Raises:
        ValueError: no "scheduler" key.
    """
    if "scheduler" not in entry:
        raise ValueError(f"The lr scheduler dict must have the key \"scheduler\" with its item being an lr "
                         f"scheduler; it has {sorted(entry)} (and may have {sorted(_SCHEDULER_KEYS - {'scheduler'})})")
    unknown = sorted(set(entry) - _SCHEDULER_KEYS)
    if unknown:  # Lightning warns and leaves them out (core/optimizer.py, _configure_schedulers_automatic_opt)
        warnings.warn(f"Found unsupported keys in the lr scheduler dict: {{{', '.join(map(repr, unknown))}}}; they "
                      f"are ignored (remove them from configure_optimizers' output; the keys: "
                      f"{sorted(_SCHEDULER_KEYS)})", RuntimeWarning, stacklevel=5)
    ignored = [key for key in entry if key in _PLATEAU_KEYS] if manual else []
    if ignored:
        warnings.warn(f"The lr scheduler dict contains the key(s) {ignored}, but the keys will be ignored. You need to "
                      "call `lr_scheduler.step()` manually in manual optimization (remove them from "
                      "configure_optimizers' output)", RuntimeWarning, stacklevel=5)
    return {key: value for key, value in entry.items() if key in _SCHEDULER_KEYS and key not in ignored}


def _check_schedulers(schedulers: tuple[LRSchedulerConfig, ...], manual: bool, own_step: bool) -> None:
    """Lightning's checks of the schedulers (``core/optimizer.py``: ``_configure_schedulers_automatic_opt``,
    ``_validate_scheduler_api``), each message naming the fix. Under manual optimization (``manual``) the module steps
    its schedulers itself: any object with a state is accepted; so it is where the module overrides
    ``lr_scheduler_step`` (``own_step``), which steps each scheduler.

    Raises:
        TypeError: a scheduler without ``state_dict``/``load_state_dict`` (checkpoints save and restore it).
        ValueError: under automatic optimization, a scheduler that is not torch's ``LRScheduler`` or
            ``ReduceLROnPlateau`` without the module's own ``lr_scheduler_step``, or a ``reduce_on_plateau`` one
            without a monitor.
    """
    for config in schedulers:
        sched, name = config.scheduler, type(config.scheduler).__name__
        if not (callable(getattr(sched, "state_dict", None)) and callable(getattr(sched, "load_state_dict", None))):
            raise TypeError(f"The provided lr scheduler `{name}` is invalid. It should have `state_dict` and "
                            "`load_state_dict` methods defined (checkpoints save and restore it)")
        if manual:
            continue
        if not isinstance(sched, (torch.optim.lr_scheduler.LRScheduler, _PLATEAU)) and not own_step:
            raise ValueError(f"The provided lr scheduler `{name}` doesn't follow PyTorch's LRScheduler API. You should "
                             "override the `LightningModule.lr_scheduler_step` hook with your own logic if you are "
                             "using a custom LR scheduler (def lr_scheduler_step(self, scheduler, metric): "
                             "scheduler.step(...)), subclass torch.optim.lr_scheduler.LRScheduler, or set "
                             "automatic_optimization = False and step it in training_step")
        if config.reduce_on_plateau and config.monitor is None:
            raise ValueError("`configure_optimizers` must include a monitor when a `ReduceLROnPlateau` scheduler is "
                             "used: return {'optimizer': opt, 'lr_scheduler': "
                             "{'scheduler': sched, 'monitor': 'val_loss'}}")
        if isinstance(sched, torch.optim.lr_scheduler.OneCycleLR) and config.interval == "epoch":
            warnings.warn("A `OneCycleLR` scheduler is using 'interval': 'epoch'. Are you sure you didn't mean "
                          "'interval': 'step'? (its total_steps count optimizer steps: pass {'scheduler': sched, "
                          "'interval': 'step'} from configure_optimizers)", RuntimeWarning, stacklevel=4)


def _from_dict(entry: dict, manual: bool) -> Optimization:
    if "optimizer" not in entry:
        raise ValueError(f"configure_optimizers returned a dict with keys {sorted(entry)}; it needs 'optimizer' "
                         "(and optionally 'lr_scheduler', 'monitor')")
    unknown = sorted(set(entry) - {"optimizer", "lr_scheduler", "monitor"})
    if unknown:  # Lightning warns and leaves them out
        warnings.warn(f"Found unsupported keys in the optimizer configuration: {{{', '.join(map(repr, unknown))}}}; "
                      "they are ignored (the keys: 'optimizer', 'lr_scheduler', 'monitor')", RuntimeWarning, stacklevel=4)
    sched = entry.get("lr_scheduler")
    schedulers = () if sched is None else (_scheduler(sched, entry.get("monitor"), manual),)
    return Optimization((entry["optimizer"],), schedulers)


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, _PLATEAU, dict))


def _from_dicts(configured: list | tuple, manual: bool) -> Optimization:
    parts = [_from_dict(e, manual) for e in configured]
    return Optimization(sum((p.optimizers for p in parts), ()), sum((p.schedulers for p in parts), ()))


def _from_sequence(configured: list | tuple, manual: bool) -> Optimization | None:
    """The list/tuple forms, or None when ``configured`` is none of them."""
    if all(isinstance(e, dict) for e in configured):  # a list of {"optimizer", "lr_scheduler"} dicts
        return _from_dicts(configured, manual)
    if all(isinstance(e, torch.optim.Optimizer) for e in configured):  # several optimizers
        return Optimization(tuple(configured))
    if len(configured) != 2:
        return None
    first, second = configured
    if isinstance(first, (list, tuple)):  # [optimizers], [schedulers]
        schedulers = second if isinstance(second, (list, tuple)) else [second]
        return Optimization(tuple(first), tuple(_scheduler(s, None, manual) for s in schedulers))
    if isinstance(first, torch.optim.Optimizer) and _is_scheduler(second):  # (optimizer, scheduler)
        return Optimization((first,), (_scheduler(second, None, manual),))
    return None


def parse_optimization(configured: Any, manual: bool = False, own_step: bool = False) -> Optimization:
    """Normalise any of the forms in the module docstring; ``manual``: the module sets
    ``automatic_optimization = False`` (it steps its schedulers itself); ``own_step``: it overrides
    ``lr_scheduler_step`` (which then steps every scheduler, one of its own too).

    Raises:
        ValueError: an unrecognised form, a bad scheduler config, or no optimizer at all.
        TypeError: a scheduler without ``state_dict``/``load_state_dict``.
    """
    if isinstance(configured, torch.optim.Optimizer):
        return Optimization((configured,))
    if isinstance(configured, dict):
        parsed = _from_dict(configured, manual)
    else:
        parsed = _from_sequence(configured, manual) if isinstance(configured, (list, tuple)) and configured else None
    if parsed is None:
        raise ValueError(f"Unknown configuration for model optimizers: configure_optimizers returned "
                         f"{type(configured).__name__}: return an optimizer, "
                         "(optimizer, scheduler), [optimizers], [schedulers], or a dict with 'optimizer' and "
                         "'lr_scheduler' (Lightning's forms)")
    returned = [getattr(opt, "optimizer", opt) for opt in parsed.optimizers]
    if any(not any(config.scheduler.optimizer is opt for opt in returned) for config in parsed.schedulers
           if hasattr(config.scheduler, "optimizer")):
        raise ValueError("Some schedulers are attached with an optimizer that wasn't returned from "
                         "`configure_optimizers`: build each scheduler on an optimizer you return")
    _check_schedulers(parsed.schedulers, manual, own_step)
    return parsed


def rank_flags(runtime: Runtime, flag: bool) -> list[float]:
    """Every rank's ``flag`` (1.0 or 0.0, indexed by rank), in one all-reduce of ``world_size`` numbers."""
    flags = torch.zeros(runtime.world_size, device=runtime.device)
    flags[runtime.rank] = 1.0 if flag else 0.0
    return runtime.all_reduce(flags).tolist()


class BackwardAgreement:
    """Under fsdp on several ranks with manual optimization: whether every rank runs each backward that
    reduce-scatters gradients (FSDP2 does it inside the backward, a collective of every rank). A rank that skips
    ``self.manual_backward(loss)`` (a branch some ranks take) would meet the others' reduce-scatter with its next
    collective: gloo aborts the job with SIGABRT ("collective mismatch"), NCCL waits for the timeout.

    Each synchronising ``manual_backward`` agrees first, in one all-reduce of a flag per rank (``world_size``
    numbers, one host read); a rank that reaches ``opt.step()`` (or ``clip_gradients``) without one since its last
    step agrees there with a flag of 0, which the others' backward meets. A rank that skips both its backward and its step is not
    caught (its next collective is the next forward's all-gather).

    Raises:
        RuntimeError: on every rank, naming the ranks that called ``manual_backward`` and those that did not.
    """

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self.syncing = True  # False inside toggle_model(sync_grad=False): that backward does not communicate
        self._agreed = False  # since the last step: a synchronising backward agreed on, or a clip that agreed

    def before_backward(self) -> None:
        if self.syncing:
            self._agree(True)
            self._agreed = True

    def before_update(self) -> None:
        """Before ``clip_gradients`` or ``step()``, whose collectives must not meet another rank's agreement."""
        if not self._agreed:
            self._agree(False)
        self._agreed = True

    def after_step(self) -> None:
        self._agreed = False

    def _agree(self, backward: bool) -> None:
        flags = rank_flags(self._rt, backward)
        if 0 < sum(flags) < len(flags):
            called = [r for r, f in enumerate(flags) if f]
            skipped = [r for r, f in enumerate(flags) if not f]
            raise RuntimeError(f"self.manual_backward(loss) was called on rank(s) {called} and not on rank(s) "
                               f"{skipped} before their opt.step() (e.g. in a branch taken on some ranks only): "
                               "under fsdp each backward reduce-scatters the gradients with every rank, so every "
                               "rank must call it (backward a zero loss, e.g. 0 * loss, where a rank has nothing "
                               "to learn)")


class StepOptimizer:
    """The optimizer as a module's ``optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)`` receives it under
    automatic optimization (Lightning's ``LightningOptimizer``): ``step(closure=None, **kwargs)`` runs the closure, then
    the Trainer's step (``take_step(closure, **kwargs)``: at the scaled lr, through the precision, unless the "skip"
    mode of ``on_nonfinite`` skips it), and returns the closure's result; everything else is the optimizer's.

    The optimizer's own ``step`` gets a closure too, as under Lightning: its first call returns that result (the
    gradients are ready), each later one calls ``closure`` again, so an optimizer that evaluates the loss several
    times per step (``torch.optim.LBFGS``) has the Trainer's closure run the step's forward and backward again."""

    def __init__(self, optimizer: torch.optim.Optimizer, take_step: Callable[..., None]) -> None:
        self.optimizer = optimizer
        self._take_step = take_step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if closure is None:
            self._take_step(None, **kwargs)
            return None
        result = closure()
        unread = [result]

        def evaluate() -> Any:  # the optimizer's closure: the result above, then a new evaluation at each call
            return unread.pop() if unread else closure()

        self._take_step(evaluate, **kwargs)
        return result


class ManualOptimizer:
    """An optimizer as ``TrainingModule.optimizers()`` hands it out under manual optimization.

    Under ddp, ``step()`` averages this optimizer's gradients over the ranks (one ``all_reduce`` of them
    flattened) and steps through the Runtime (GradScaler under "16-mixed"), so the gradients are
    synchronised once per optimizer step whatever the accumulation: the user's backward passes never
    communicate, and a model left unused by one step (a GAN's generator in the discriminator step) needs
    no ``find_unused_parameters``. Under fsdp the parameters are sharded (DTensors) and FSDP2
    reduce-scatters each sharded submodule's gradients in the backward pass; ``toggle_model(sync_grad=
    False)`` turns that off for the block (``set_requires_gradient_sync(False)``: gradients accumulate
    unsharded on each rank), so with Lightning's accumulation pattern each unit's gradients are
    reduce-scattered once per optimizer step, on the boundary. Everything else is the optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, runtime: Runtime, model: torch.nn.Module,
                 wrapped: torch.nn.Module, gradient_sync: str,
                 scaled_lr: Callable[[torch.optim.Optimizer], ContextManager] = lambda opt: contextlib.nullcontext(),
                 before_step: Callable[[torch.optim.Optimizer], None] = lambda opt: None,
                 agreement: BackwardAgreement | None = None) -> None:
        """``gradient_sync``: "step" (ddp: averaged in :meth:`step`), "backward" (fsdp: reduce-scattered by
        FSDP2 in backward) or "none" (one process). ``scaled_lr(optimizer)``: the context the step runs in
        (the Trainer's ``BatchScaling.scaled_lr`` under ``lr_scaling``). ``before_step(optimizer)``: the
        ``on_before_optimizer_step`` hooks, called with the gradients averaged and unscaled (Lightning calls
        them after the closure, before the step). ``agreement``: the fit's :class:`BackwardAgreement` (fsdp
        on several ranks; shared by its optimizers and ``manual_backward``)."""
        self.optimizer = optimizer
        self._model = model
        self._wrapped = wrapped  # what Runtime.setup returned (the FSDP root under fsdp)
        self._rt = runtime
        self._sync_in_backward = gradient_sync == "backward"
        self._average = gradient_sync == "step" and runtime.world_size > 1
        self._averaged = False  # this step's gradients already averaged (by clip_gradients)
        self._frozen: list[torch.Tensor] = []
        self._scaled_lr = scaled_lr
        self._warned_no_gradients = False
        self._before_step = before_step
        self._steps = 0  # steps since the Trainer last counted them (take_steps): Lightning's global_step counts each
        self.agreement = agreement

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def _params(self) -> Iterator[torch.Tensor]:
        return (p for group in self.optimizer.param_groups for p in group["params"])

    def _average_gradients(self) -> None:
        """Under ddp, average the gradients over ranks (once per step)."""
        if not self._average or self._averaged:
            return
        grads = [p.grad for p in self._params() if p.grad is not None]
        self._check_every_rank_has_gradients(bool(grads))
        if grads:
            flat = self._rt.all_reduce(torch.cat([g.reshape(-1) for g in grads])) / self._rt.world_size
            for g, new in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(new.view_as(g))
        self._averaged = True

    def _check_every_rank_has_gradients(self, has: bool) -> None:
        """Before the gradient all-reduce, under ddp: whether each rank has gradients for this optimizer, in one
        all-reduce of a flag per rank (``world_size`` numbers, one host read per optimizer step: manual
        optimization only). A rank that skipped ``self.manual_backward`` has none and would not join the
        all-reduce of the others (gloo aborts the job with SIGABRT, "collective mismatch"; NCCL times out).

        Raises:
            RuntimeError: on every rank, naming the ranks without gradients and the fix.
        """
        having = rank_flags(self._rt, has)
        if 0 < sum(having) < len(having):
            missing = [r for r, flag in enumerate(having) if not flag]
            raise RuntimeError(f"{type(self.optimizer).__name__}.step(): rank(s) {missing} have no gradients while the "
                               "other ranks have theirs: self.manual_backward(loss) was skipped there this step (e.g. "
                               "in a branch taken on some ranks only); under ddp every rank must call it before "
                               "opt.step(), whose gradient all-reduce needs every rank (backward a zero loss, e.g. "
                               "0 * loss, where a rank has nothing to learn)")

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Lightning's ``LightningOptimizer.step``: ``optimizer.step(closure=..., **kwargs)`` at the scaled lr,
        through the precision (``Precision.optimizer_step``), where the closure passed is yours (None: one that does
        nothing) followed by what makes the gradients ready: averaged over the ranks (ddp), unscaled ("16-mixed"),
        then the ``on_before_optimizer_step`` hooks (Lightning's ``_wrap_closure``). ``kwargs`` go to the optimizer's
        ``step``. Returns what it returned (your closure's result)."""
        def ready() -> Any:
            if closure is not None:
                self._averaged = False  # the closure's backward makes new gradients
            result = closure() if closure is not None else None
            self._warn_if_no_gradients()
            if self.agreement is not None:
                self.agreement.before_update()
            self._average_gradients()
            self._rt.precision.unscale_gradients(self.optimizer)
            self._before_step(self.optimizer)
            return result

        with self._scaled_lr(self.optimizer):
            result = self._rt.precision.optimizer_step(self.optimizer, ready, **kwargs)
        self._averaged = False
        if self.agreement is not None:
            self.agreement.after_step()
        self._steps += 1
        return result

    def take_steps(self) -> int:
        """The optimizer steps taken since the last call (the Trainer adds them to ``global_step``)."""
        steps, self._steps = self._steps, 0
        return steps

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _warn_if_no_gradients(self) -> None:
        """Warn once when this optimizer steps with no gradient at all: the step changes nothing (torch's
        optimizers skip parameters without one), the usual cause a missing ``self.manual_backward(loss)``."""
        if self._warned_no_gradients or any(p.grad is not None for p in self._params()):
            return
        self._warned_no_gradients = True
        warnings.warn(f"{type(self.optimizer).__name__}.step() on rank {self._rt.rank} with no gradients: "
                      "the step changes nothing. Under manual optimization call self.manual_backward(loss) before "
                      "opt.step(); under ddp every rank must call it (a rank that skips it while the others call "
                      "it stops the job at the gradient all-reduce)", RuntimeWarning, stacklevel=3)

    def clip_gradients(self, gradient_clip_val: float, gradient_clip_algorithm: str = "norm") -> torch.Tensor | None:
        """Clip this optimizer's gradients, averaged over ranks first (ddp) and unscaled ("16-mixed"): by
        their total norm (over all shards under fsdp: ``dtensor_clip.clip_grad_norm``) or by value.
        Returns the norm before clipping (a 0-d tensor), None for "value".

        Raises:
            ValueError: ``gradient_clip_val`` <= 0, or an algorithm other than "norm"/"value".
        """
        from trainscale.runtime.strategies.dtensor_clip import clip_grad_norm

        if gradient_clip_algorithm not in ("norm", "value") or not gradient_clip_val > 0:
            raise ValueError(f"clip_gradients(gradient_clip_val={gradient_clip_val!r}, gradient_clip_algorithm="
                             f"{gradient_clip_algorithm!r}): the value must be > 0 and the algorithm 'norm' or 'value'")
        if self.agreement is not None:
            self.agreement.before_update()
        self._average_gradients()
        self._rt.precision.unscale_gradients(self.optimizer)
        params = list(self._params())
        if gradient_clip_algorithm == "norm":
            return clip_grad_norm(params, gradient_clip_val)
        torch.nn.utils.clip_grad_value_([p for p in params if p.grad is not None], gradient_clip_val)
        return None

    def toggle(self) -> None:
        """Freeze every parameter of the model that this optimizer does not own (Lightning's
        ``toggle_optimizer``): the other model gets no gradients from this optimizer's loss. Under fsdp
        the sharded parameters are frozen; FSDP2 carries ``requires_grad`` to the gathered ones."""
        own = {id(p) for p in self._params()}
        self._frozen = [p for p in self._model.parameters() if id(p) not in own and p.requires_grad]
        for p in self._frozen:
            p.requires_grad_(False)

    def untoggle(self) -> None:
        """Undo :meth:`toggle`."""
        for p in self._frozen:
            p.requires_grad_(True)
        self._frozen = []

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True):
        """Lightning's ``optimizer.toggle_model(sync_grad=...)``: toggled for the block. Under fsdp the
        backward passes in the block reduce-scatter the gradients of this optimizer's FSDP units only, and
        only with ``sync_grad=True`` (pass it on the micro-batch that steps): the other units keep theirs
        unsharded until their own optimizer's synced block (``apply_fsdp.gradient_sync_for``). Under ddp
        gradients are averaged in :meth:`step` only, so ``sync_grad`` needs no action there."""
        self.toggle()
        syncing = self.agreement.syncing if self.agreement is not None else True
        try:
            with gradient_sync_for(self._wrapped, self._params(), sync_grad) if self._sync_in_backward \
                    else contextlib.nullcontext():
                if self.agreement is not None:
                    self.agreement.syncing = sync_grad
                yield
        finally:
            if self.agreement is not None:
                self.agreement.syncing = syncing
            self.untoggle()
