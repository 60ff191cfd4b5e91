"""Learning rate scaled with the global batch size: pure functions. The Trainer applies :func:`lr_factor` and
:func:`warmup` at each optimizer step (``Trainer(lr_scaling=..., base_batch_size=...)``,
:mod:`trainscale.scaling.batch_scaling`); a user of ``Runtime`` with their own loop calls
:func:`scale_learning_rates` once, after the optimizer is built and before its LR scheduler is.

- "linear": lr × G / B (Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour",
  §2.1, with a gradual warm-up from lr to lr × G / B over the first epochs, §2.2) — for SGD.
- "sqrt": lr × sqrt(G / B) (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
  Algorithms", NeurIPS) — for adaptive optimizers (Adam, AdamW).
- "none": unchanged.

G is the global batch size (per-device batch × devices × accumulation steps), B the batch size the
learning rates were tuned for.
"""

from __future__ import annotations

import math
from typing import Callable

RULES = ("linear", "sqrt", "none")
UNSCALED_KEY = "lr_before_scaling"  # kept in each param group: scaling again starts from it
LR_SCALE_KEY = "lr_scale"  # the Trainer's multiplier of the next step, kept in each param group


def lr_factor(global_batch_size: int, base_batch_size: int, rule: str = "linear") -> float:
    """The factor a learning rate tuned at ``base_batch_size`` is multiplied by at ``global_batch_size``.

    Raises:
        ValueError: an unknown rule, or a batch size that is not a positive int.
    """
    if rule not in RULES:
        raise ValueError(f"lr_scaling={rule!r} is not a rule; choose one of {', '.join(map(repr, RULES))}")
    for name, value in (("global_batch_size", global_batch_size), ("base_batch_size", base_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int (samples per optimizer step)")
    ratio = global_batch_size / base_batch_size
    return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


def scale_learning_rates(optimizer, global_batch_size: int, base_batch_size: int,
                         rule: str = "linear") -> list[float]:
    """Set each param group's ``lr`` to its unscaled value × :func:`lr_factor`; return the new values.

    The unscaled value is kept in the group as ``"lr_before_scaling"`` (saved with the optimizer's
    ``state_dict``), so calling this again — after a resume, or with another world size — scales the
    tuned value, never an already scaled one.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (float or tensor ``lr``).
        global_batch_size: per-device batch × devices × accumulation steps.
        base_batch_size: the global batch size the learning rates were tuned for.
        rule: "linear", "sqrt" or "none".

    Raises:
        ValueError: bad rule or batch sizes; or an LR scheduler already built on ``optimizer`` (its
            ``initial_lr`` would keep the unscaled value): build the scheduler after scaling.
    """
    factor = lr_factor(global_batch_size, base_batch_size, rule)
    if any("initial_lr" in group and UNSCALED_KEY not in group for group in optimizer.param_groups):
        raise ValueError("scale the learning rates before building the LR scheduler: a scheduler already took "
                         "'initial_lr' from this optimizer and would undo the scaling")
    scaled = []
    for group in optimizer.param_groups:
        unscaled = group.setdefault(UNSCALED_KEY, float(group["lr"]))
        new = unscaled * factor
        if hasattr(group["lr"], "fill_"):  # a tensor lr (capturable/fused optimizers): keep the tensor
            group["lr"].fill_(new)
        else:
            group["lr"] = new
        scaled.append(new)
    return scaled


def warmup(warmup_steps: int, factor: float) -> Callable[[int], float]:
    """Goyal et al.'s gradual warm-up as a ``torch.optim.lr_scheduler.LambdaLR`` multiplier: from
    ``1 / factor`` of the scaled lr (the unscaled lr) at step 0, linearly to 1 at ``warmup_steps``.

    Raises:
        ValueError: ``warmup_steps`` < 0 or ``factor`` <= 0.
    """
    if warmup_steps < 0 or factor <= 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 and factor={factor} > 0")
    start = 1.0 / factor

    def multiplier(step: int) -> float:
        if step >= warmup_steps:
            return 1.0
        return start + (1.0 - start) * step / warmup_steps

    return multiplier


def param_group_names(optimizers, schedulers=(),
                      refuse_duplicates: bool = False) -> list[tuple[object, list[str]]]:
    """Each optimizer (unwrapped) with one name per param group, as Lightning's ``LearningRateMonitor`` names them
    (``callbacks/lr_monitor.py``): ``lr-<Optimizer class>``, or the ``"name"`` of the optimizer's ``lr_scheduler``
    dict; a second optimizer of one class (without a scheduler name) ``lr-AdamW-1``; with several param groups
    ``<name>/pg1``, ``<name>/pg2``, ... (counted from 1), or ``<name>/<group's "name">``, which a single group
    also gets. The optimizers with a scheduler come first, in the schedulers' order, then the others.

    ``schedulers``: objects with ``scheduler`` (whose ``optimizer`` it steps) and ``name`` (None: none given).
    Two groups of one optimizer with the same ``"name"`` are named ``pg1``, ``pg2``, ... instead, unless
    ``refuse_duplicates`` (``LearningRateMonitor``, which refuses them as Lightning's does).

    Raises:
        ValueError: with ``refuse_duplicates``, two param groups of one optimizer with the same ``"name"``.
    """
    named = [(config.scheduler.optimizer, config.name) for config in schedulers]
    held = [opt for opt, _ in named]
    unwrapped = (getattr(opt, "optimizer", opt) for opt in optimizers)  # a ManualOptimizer's torch optimizer
    order = named + [(opt, None) for opt in unwrapped if not any(opt is o for o in held)]
    counts: dict[str, int] = {}
    out = []
    for opt, custom in order:
        cls = type(opt).__name__
        if custom is None:
            counts[cls] = counts.get(cls, 0) + 1
        name = custom or f"lr-{cls}"
        if counts.get(cls, 0) > 1:  # Lightning numbers a custom name too once its class was seen twice
            name += f"-{counts[cls] - 1}"
        out.append((opt, _group_names(name, opt.param_groups, refuse_duplicates)))
    return out


def _group_names(name: str, groups: list[dict], refuse_duplicates: bool) -> list[str]:
    """``name`` for one unnamed group; ``name/<label>`` for each of several (label: its "name" or pg1, pg2, ...)."""
    labels = [group.get("name", f"pg{i}") for i, group in enumerate(groups, start=1)]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice and not refuse_duplicates:
        labels = [f"pg{i}" for i in range(1, len(groups) + 1)]  # unique keys for the records
    elif twice:
        raise ValueError(f"A single `Optimizer` cannot have multiple parameter groups with identical `name` values: "
                         f"{name} has duplicated parameter group names {twice} (Lightning refuses it too); give each "
                         "group its own 'name'")
    if len(groups) == 1 and "name" not in groups[0]:
        return [name]
    return [f"{name}/{label}" for label in labels]


def learning_rates(optimizers, schedulers=()) -> dict[str, float]:
    """The learning rate of every param group, under :func:`param_group_names`' names (``lr-AdamW``;
    ``lr-AdamW/pg1``, ``lr-AdamW/pg2`` for two groups). Under ``Trainer(lr_scaling=...)`` the lr the next step
    uses: the group's lr × its ``"lr_scale"``."""
    return LearningRates()(optimizers, schedulers)


class LearningRates:
    """:func:`learning_rates` for a loop that reads them at every log step: the param groups' names are made
    once (:func:`param_group_names`) and again only when the optimizers, the schedulers or an optimizer's number
    of param groups change (``add_param_group``, as ``BaseFinetuning`` does when it unfreezes a layer); a group's
    ``"name"`` is read when the names are made."""

    def __init__(self) -> None:
        self._held: tuple = ()  # the optimizers and schedulers the names were made for
        self._named: list[tuple[object, list[str]]] = []  # (unwrapped optimizer, its groups' names)
        self._groups: list[int] = []  # each of those optimizers' param groups when the names were made

    def __call__(self, optimizers, schedulers=()) -> dict[str, float]:
        """``{name: lr}`` of every param group, as :func:`learning_rates`."""
        held = (tuple(optimizers), tuple(schedulers))
        if held != self._held or self._groups != [len(opt.param_groups) for opt, _ in self._named]:
            self._held, self._named = held, param_group_names(*held)
            self._groups = [len(opt.param_groups) for opt, _ in self._named]
        return {name: float(group["lr"]) * group.get(LR_SCALE_KEY, 1.0)
                for opt, names in self._named for name, group in zip(names, opt.param_groups)}
