"""The global batch size of a ``fit`` and, with ``lr_scaling``, the learning rates scaled to it.

``Trainer(lr_scaling="linear"|"sqrt", base_batch_size=B, lr_warmup_steps=W)``: every optimizer step uses each
param group's lr × m(step), where the factor f = :func:`~trainscale.scaling.lr_scaling.lr_factor` (G, B, rule) —
"linear" for SGD (Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", §2.1),
"sqrt" for adaptive optimizers such as Adam/AdamW (Malladi et al. 2022, "On the SDEs and Scaling Rules for
Adaptive Gradient Algorithms", NeurIPS) — and m ramps linearly from 1 at step 0 to f at step W, then stays at
f (Goyal et al.'s gradual warm-up, §2.2: from the tuned lr to the scaled one in constant increments).
G, the global batch size, is the per-device micro-batch × the data-parallel ranks × ``accumulate_grad_batches``.

Why at step time. The training step scales the lr around ``optimizer.step()`` only (:meth:`BatchScaling.scaled_lr`,
called by name in ``Trainer._train_step`` and in a manual optimizer's ``step()``), so between steps
``param_groups[i]["lr"]`` holds what the user's schedule set. Every schedule then
composes unchanged — ``LambdaLR`` (base_lr × λ), ``OneCycleLR`` (its ``max_lr`` is the tuned peak), chainable
schedulers, ``ReduceLROnPlateau`` (its ``min_lr`` is in tuned units, scaled like the rest), a hand-written loop
that sets ``group["lr"]`` each step (nanoGPT's) — where scaling ``initial_lr``/``base_lrs`` once would be undone
by any of them that writes absolute values. The checkpoint holds the unscaled lr once, so a resume scales it
by the new run's factor (the same on the same world size; the new one after a world-size change), never twice.
The multiplier of the next step is kept in each group as ``"lr_scale"``; the records' ``lr-<Optimizer>`` values
are lr × lr_scale, the lr the step uses (:func:`trainscale.scaling.lr_scaling.learning_rates`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

from trainscale.scaling.lr_scaling import LR_SCALE_KEY, lr_factor, warmup

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime


_UNSCALED = contextlib.nullcontext()  # no lr_scaling: the step runs as it is


def global_batch_size(loader: Any, runtime: Runtime, accumulate: int) -> int | None:
    """Samples per optimizer step: ``loader.batch_size`` × data-parallel ranks (tensor-parallel ranks share a
    batch: ``Strategy.data_world``) × ``accumulate``; None for a loader without a fixed ``batch_size``."""
    batch = getattr(loader, "batch_size", None)
    if batch is None:
        return None
    return batch * runtime.strategy.data_world(runtime.world).world_size * accumulate


def _no_steps() -> int:
    """The optimizer steps taken before :meth:`BatchScaling.attach` is given the loop's count."""
    return 0


class BatchScaling:
    """The Trainer's global batch size and LR scaling (module docstring), from a
    :class:`~trainscale.loop.config.TrainerConfig` (``lr_scaling`` None: no scaling)."""

    def __init__(self, config: Any) -> None:
        self.rule, self.base_batch_size = config.lr_scaling, config.base_batch_size
        self.warmup_steps, self.accumulate = config.lr_warmup_steps, config.accumulate_grad_batches
        self.global_batch_size: int | None = None
        self.factor = 1.0
        self._step: Callable[[], int] = _no_steps  # a module function, not a lambda: a Trainer pickles

    def multiplier(self, step: int) -> float:
        """The lr multiplier of optimizer step ``step`` (0-based): f after the warm-up, 1 → f during it."""
        if step >= self.warmup_steps:
            return self.factor
        return self.factor * warmup(self.warmup_steps, self.factor)(step)

    def attach(self, runtime: Runtime, loader: Any, optimizers, step: Callable[[], int]) -> int | None:
        """Compute the global batch size; with a rule, mark ``optimizers`` (after any checkpoint was loaded into
        them) with the next step's multiplier and print the scaled learning rates on rank zero. ``step()`` is the number of optimizer steps
        taken so far. Returns the global batch size.

        Raises:
            ValueError: ``lr_scaling`` with a loader that has no fixed ``batch_size``.
        """
        self.global_batch_size = global_batch_size(loader, runtime, self.accumulate)
        self.factor = 1.0
        for opt in optimizers:
            for group in opt.param_groups:
                group.pop(LR_SCALE_KEY, None)  # a checkpoint of a scaled run may carry it
        if self.rule is None:
            return self.global_batch_size
        if self.global_batch_size is None:
            raise ValueError(f"lr_scaling={self.rule!r} needs a training DataLoader with a fixed batch_size (it has a "
                             "batch_sampler); pass batch_size=... or drop lr_scaling")
        self.factor = lr_factor(self.global_batch_size, self.base_batch_size, self.rule)
        self._step = step
        for opt in optimizers:
            _set_scale(opt, self.multiplier(step()))
        runtime.print(self.describe(optimizers, loader.batch_size))
        return self.global_batch_size

    def describe(self, optimizers, micro_batch: int) -> str:
        """The line printed once per fit: the rule, the batch arithmetic and each group's lr before → after."""
        accumulate = self.accumulate
        ranks = self.global_batch_size // (micro_batch * accumulate)
        lrs = ", ".join(f"{float(g['lr']):.4g} → {float(g['lr']) * self.factor:.4g}"
                        for opt in optimizers for g in opt.param_groups)
        ramp = (f", warmed up from × 1 over {self.warmup_steps} steps (Goyal et al. 2017)" if self.warmup_steps else "")
        return (f"trainscale: lr scaling {self.rule}: global batch {self.global_batch_size} ({micro_batch} per device × "
                f"{ranks} rank(s) × {accumulate} accumulation) / base {self.base_batch_size} → lr × {self.factor:.4g} "
                f"({lrs}){ramp}")

    def summary(self) -> dict | None:
        """What the run summary records (None without a rule)."""
        if self.rule is None:
            return None
        return {"rule": self.rule, "base_batch_size": self.base_batch_size, "factor": self.factor,
                "warmup_steps": self.warmup_steps}

    def scaled_lr(self, optimizer: Any) -> ContextManager[None]:
        """Around one ``optimizer.step()``: each param group's lr × the multiplier of this step, the schedule's
        value put back after it (and the next step's multiplier recorded for the records). Nothing without a rule."""
        return _UNSCALED if self.rule is None else self._scaled(optimizer)

    @contextlib.contextmanager
    def _scaled(self, optimizer: Any) -> Iterator[None]:
        m = self.multiplier(self._step())
        saved = []
        for group in optimizer.param_groups:
            lr = group["lr"]
            if hasattr(lr, "mul_"):  # a tensor lr (capturable/fused optimizers): scaled in place
                saved.append(lr.clone())
                lr.mul_(m)
            else:
                saved.append(lr)
                group["lr"] = lr * m
        try:
            yield
        finally:
            for group, lr in zip(optimizer.param_groups, saved):
                if hasattr(group["lr"], "copy_"):
                    group["lr"].copy_(lr)
                else:
                    group["lr"] = lr
            _set_scale(optimizer, self.multiplier(self._step() + 1))


def _set_scale(optimizer: Any, multiplier: float) -> None:
    for group in optimizer.param_groups:
        group[LR_SCALE_KEY] = multiplier
