"""The optimizers of a ``fit``: built from the user's factory or ``configure_optimizers``, checked before
the first step (the fix named in each message), wrapped for manual optimization."""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainscale.lightning.module import TrainingModule, step_hooks
from trainscale.lightning.optimizers import BackwardAgreement, ManualOptimizer, NoOptimizer, parse_optimization
from trainscale.utilities.model_helpers import is_overridden

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime


def build_optimizers(model: nn.Module, wrapped: nn.Module, optimizer: Any, config: Any, runtime: Runtime,
                     scaled_lr: Any = None, before_step: Any = None):
    """``(optimizers, scheduler configs, manual optimizers)`` for ``model`` wrapped as ``wrapped``, under the
    Trainer's ``config`` (``TrainerConfig``); the manual list is empty unless the module sets
    ``automatic_optimization = False``. ``scaled_lr``: the context each manual ``step()`` runs in
    (``BatchScaling.scaled_lr``); ``before_step(optimizer)``: the ``on_before_optimizer_step`` hooks of each manual step.

    Raises:
        RuntimeError: a ``training_step`` that takes Lightning 1.x's ``optimizer_idx`` (Lightning 2's error and words).
        ValueError / TypeError / RuntimeError: see :func:`configured_optimization` and :func:`check_optimizers`.
    """
    step = getattr(model, "training_step", None)
    if step is not None and "optimizer_idx" in inspect.signature(step).parameters:
        raise RuntimeError("Training with multiple optimizers is only supported with manual optimization. Remove the "
                           "`optimizer_idx` argument from `training_step`, set `self.automatic_optimization = False` "
                           "and access your optimizers in `training_step` with `opt1, opt2, ... = self.optimizers()` "
                           "(Lightning 2's words: a Lightning 1.x training_step(batch, batch_idx, optimizer_idx) "
                           "needs that change)")
    manual = not getattr(model, "automatic_optimization", True)
    own_step = "lr_scheduler_step" in step_hooks(model)  # it steps the schedulers, one of its own kind too
    optimization = parse_optimization(configured_optimization(model, wrapped, optimizer), manual, own_step)
    check_optimizers(optimization, wrapped, manual, config, runtime)
    optimizers = [runtime.strategy.setup_optimizer(o) for o in optimization.optimizers]
    sync = runtime.strategy.gradient_sync
    extra = {name: fn for name, fn in (("scaled_lr", scaled_lr), ("before_step", before_step)) if fn is not None}
    if manual and sync == "backward" and runtime.world_size > 1:
        extra["agreement"] = BackwardAgreement(runtime)  # one for the fit: manual_backward and every optimizer
    manuals = [ManualOptimizer(o, runtime, model, wrapped, sync, **extra) for o in optimizers] if manual else []
    return optimizers, list(optimization.schedulers), manuals


def configured_optimization(model: nn.Module, wrapped: nn.Module, optimizer: Any) -> Any:
    """What builds the optimizers: the ``optimizer`` factory (called on the wrapped module's
    parameters, after the strategy moved or sharded them) or ``model.configure_optimizers()``; when that returns
    None, a :class:`NoOptimizer` with a ``UserWarning``, as Lightning (the fit runs and the weights stay).

    Raises:
        ValueError: neither given (a ``TrainingModule`` that does not override ``configure_optimizers``, or sets
            it to None, gives none: Lightning's "No `configure_optimizers()` method defined").
        TypeError: ``optimizer`` is neither a factory nor an optimizer.
    """
    configure = getattr(model, "configure_optimizers", None)
    if isinstance(model, TrainingModule) and configure is not None and not is_overridden("configure_optimizers", model):
        configure = None  # the base class's: it only raises
    if optimizer is None and configure is not None:
        configured = configure()
        if configured is None:
            warnings.warn(f"`{type(model).__name__}.configure_optimizers` returned `None`, this fit will run with no "
                          "optimizer: the weights will not change (return an optimizer to train them)", UserWarning,
                          stacklevel=4)
            return NoOptimizer()
        return configured
    if optimizer is None:
        raise ValueError("No `configure_optimizers()` method defined (Lightning's words): no optimizer. Define "
                         "configure_optimizers() on the model, or pass "
                         "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3) to fit")
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(wrapped.parameters())
    raise TypeError(f"optimizer must be a factory params -> Optimizer, got {type(optimizer).__name__}")


def check_optimizers(optimization: Any, wrapped: nn.Module, manual: bool, config: Any, runtime: Runtime) -> None:
    """Refuse optimizers the loop would misuse.

    Raises:
        RuntimeError: several optimizers with automatic optimization (Lightning 2's error and words).
        ValueError: manual optimization with
            ``accumulate_grad_batches`` or ``gradient_clip_val``, under dp or pp, or under an FSDP-sharded
            strategy with parameters held by the model itself rather than a submodule; an optimizer holding
            parameters that are not the model's (built on another model, or before the strategy
            replaced the parameters).
    """
    if len(optimization.optimizers) > 1 and not manual:
        raise RuntimeError("Training with multiple optimizers is only supported with manual optimization. Set "
                           "`self.automatic_optimization = False`, then access your optimizers in `training_step` "
                           "with `opt1, opt2, ... = self.optimizers()` (configure_optimizers returned "
                           f"{len(optimization.optimizers)} optimizers; the Trainer steps one per step; step them "
                           "with self.manual_backward(loss) and opt.step())")
    if manual:
        _check_manual(config, runtime, wrapped)
    _check_parameters(optimization.optimizers, wrapped)


def _check_manual(config: Any, runtime: Runtime, wrapped: nn.Module) -> None:
    # Lightning's checks and words first (configuration_validator.py), then how to do it by hand
    if config.gradient_clip_val is not None:  # the Trainer never steps: the clipping would be silently skipped
        raise ValueError("Automatic gradient clipping is not supported for manual optimization. Remove "
                         f"`Trainer(gradient_clip_val={config.gradient_clip_val})` or switch to automatic "
                         "optimization: gradient_clip_val is for automatic optimization; under manual optimization "
                         "clip in training_step before each step: self.clip_gradients(opt, gradient_clip_val=..., "
                         "gradient_clip_algorithm='norm')")
    if config.accumulate_grad_batches != 1:
        raise ValueError("Automatic gradient accumulation is not supported for manual optimization. Remove "
                         f"`Trainer(accumulate_grad_batches={config.accumulate_grad_batches})` or switch to automatic "
                         "optimization: accumulate_grad_batches must be 1 under manual optimization; accumulate in "
                         "training_step (step the optimizer every N batches yourself)")
    strategy, refusal = runtime.config.strategy, runtime.strategy.manual_optimization_refusal
    if refusal is not None:  # dp: training_step would run in each replica's thread; pp: the schedule steps
        raise ValueError(f"manual optimization cannot run under strategy={strategy!r}: its training_step calls "
                         f"backward itself, which {refusal} cannot host; use 'ddp', 'fsdp', 'hsdp' or 'tp', or "
                         "automatic optimization")
    model = getattr(wrapped, "model", None)  # the LoopModule's user model (FSDP shards in place, no wrapper)
    sharded = runtime.strategy.gradient_sync == "backward" and model is not None  # FSDP2-sharded
    direct = [n for n, _ in model.named_parameters(recurse=False)] if sharded else []
    if direct:  # sharded with the root: resharded by the step's first backward, sharded tensors after it
        raise ValueError(f"under strategy={strategy!r} with manual optimization the parameters of "
                         f"{type(model).__name__} must live in submodules (each is sharded apart), but it holds "
                         f"{', '.join(direct)} itself; move them into a submodule (e.g. an nn.ParameterDict or "
                         "nn.Module attribute)")


def _check_parameters(optimizers, wrapped: nn.Module) -> None:
    own = {id(p) for p in wrapped.parameters()}
    for i, opt in enumerate(optimizers):
        foreign = sum(1 for group in opt.param_groups for p in group["params"] if id(p) not in own)
        if foreign:
            raise ValueError(f"optimizer {i} ({type(opt).__name__}) holds {foreign} parameter(s) that are not the "
                             "model's (built on another model, or before the strategy moved it); pass a factory "
                             "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), or build it in "
                             "configure_optimizers() from self.parameters()")
