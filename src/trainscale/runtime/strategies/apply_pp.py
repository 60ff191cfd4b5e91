"""``apply_pp``: cut a model into pipeline stages from outside it, and run them with torch's schedules.

Manual stage construction, as torchtitan does it (``distributed/pipeline_parallel.py``,
``pipeline_module_split``): every rank holds the whole model, keeps the modules of its own stage and
drops the others, in place: a child of a ``ModuleList``/``ModuleDict`` is deleted (``delattr``, so the
remaining entries keep their names, and so the state-dict keys of the whole model: a checkpoint of the
stages is a checkpoint of the model), any other child is set to ``None``. The model's ``forward`` must
tolerate that (torchtitan's rule): it iterates over what its lists hold and skips a step whose module
is ``None`` (``trainscale.models.GPT`` does; docs/strategies.md shows how for your own model).

A *split point* is a unit's name where a new stage begins; the units are the model's children in
registration order, a ``ModuleList``/``ModuleDict`` child entry by entry (e.g. ``"blocks.2"``).

A module kept by several stages is *shared*: the GPT's token embedding is read by the first stage and,
as the tied output projection, by the last (Press & Wolf 2017). Each of those stages holds a copy;
after backward their gradients are summed across them (Megatron-LM's embedding group, Shoeybi et al.
2019, §3), so the copies take identical optimizer steps, and gradient clipping counts them once.

The schedules are torch's ``ScheduleGPipe`` (Huang et al. 2019, "GPipe") and ``Schedule1F1B``
(Narayanan et al. 2019, "PipeDream"; https://pytorch.org/docs/stable/distributed.pipelining.html).
A schedule fixes the shapes of the activations a stage receives at its first step, so each batch
shape (the last, smaller batch of an epoch) gets its own ``PipelineStage`` and schedule, made on first
use and kept, with as many micro-batches as divide it (:func:`micro_batches_for`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def units(model: nn.Module) -> list[str]:
    """The names a split point may take, in order: ``model``'s children, those of a ``ModuleList`` or
    ``ModuleDict`` child one by one (``"blocks.0"``, ``"blocks.1"``, ...)."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out.extend(f"{name}.{key}" for key, _ in child.named_children())
        else:
            out.append(name)
    return out


def gpt_split_points(gpt: nn.Module, stages: int) -> list[str]:
    """The built-in split of ``trainscale.models.GPT``: its blocks spread evenly over ``stages`` (the
    first stages take one more when they do not divide), the embeddings before the first block, the
    final norm after the last.

    Raises:
        ValueError: fewer blocks than stages.
    """
    n = len(gpt.blocks)
    if n < stages:
        raise ValueError(f"pp={stages} stages need at least as many GPT blocks, but n_layer={n}; use fewer stages "
                         "or a deeper model")
    per, extra = divmod(n, stages)
    points, start = [], 0
    for s in range(stages - 1):
        start += per + (1 if s < extra else 0)
        points.append(f"blocks.{start}")
    return points


def stage_names(model: nn.Module, split_points: list[str], stages: int) -> list[list[str]]:
    """The units of each stage: stage ``s`` runs from split point ``s - 1`` (or the first unit) up to
    split point ``s`` (or the last unit).

    Raises:
        ValueError: not ``stages - 1`` split points, a name that is not a unit, points out of order
            (each message lists the units).
    """
    names = units(model)
    listing = f"the units of {type(model).__name__}, in order: {', '.join(names)}"
    if not isinstance(split_points, (list, tuple)) or len(split_points) != stages - 1:
        raise ValueError(f"pp={stages} stages need {stages - 1} split point(s) (the unit where each later stage "
                         f"begins), got pp_split_points={split_points!r}; {listing}")
    unknown = [p for p in split_points if p not in names]
    if unknown:
        raise ValueError(f"pp_split_points {unknown} name no unit of the model; {listing}")
    bounds = [0, *(names.index(p) for p in split_points), len(names)]
    empty = [s for s, (a, b) in enumerate(zip(bounds, bounds[1:])) if a >= b]
    if empty:
        even = [names[len(names) * s // stages] for s in range(1, stages)]
        first = (f"; {split_points[0]!r} is the model's first unit, where stage 0 begins anyway (a split point names "
                 "where a later stage begins)" if bounds[1] == 0 else "")
        raise ValueError(f"pp_split_points={list(split_points)} leave stage {empty[0]} without a unit{first}: they must "
                         f"be in the model's order, each stage at least one unit, e.g. pp_split_points={even}; "
                         f"{listing}")
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def shared_parameters(model: nn.Module, names: list[list[str]]) -> dict[int, list[int]]:
    """``{id(parameter): [stages that hold it]}`` for each parameter held by more than one stage (a unit
    in several stages' lists, or one tensor registered in units of different stages: a tied weight).

    Raises:
        ValueError: parameters registered on ``model`` itself, which belong to no unit.
    """
    own = [name for name, _ in model.named_parameters(recurse=False)]
    if own:
        raise ValueError(f"parameter(s) {own} sit on {type(model).__name__} itself, outside every pipeline unit; "
                         "move them into a submodule so that one stage holds them")
    holders: dict[int, list[int]] = {}
    for stage, stage_units in enumerate(names):
        for unit in stage_units:
            for p in model.get_submodule(unit).parameters():
                if stage not in holders.setdefault(id(p), []):
                    holders[id(p)].append(stage)
    return {pid: stages for pid, stages in holders.items() if len(stages) > 1}


def keep_stage(model: nn.Module, keep: list[str]) -> nn.Module:
    """Drop every unit of ``model`` not in ``keep``, in place (see the module's docstring); return ``model``."""
    for name in units(model):
        if name in keep:
            continue
        parent, _, child = name.rpartition(".")
        if parent:
            delattr(model.get_submodule(parent), child)  # no renumbering: the others keep their names
        else:
            setattr(model, child, None)
    return model


class StageForwardError(RuntimeError):
    """A pipeline stage's forward used a module that this stage does not hold (see :func:`explain_missing_modules`)."""


def explain_missing_modules(stage: nn.Module, index: int, kept: list[str]) -> None:
    """Wrap ``stage.forward`` (in place, an instance attribute) so that a forward that calls a module this stage
    dropped (``keep_stage``: a plain child set to None, a list entry deleted) raises :class:`StageForwardError`
    naming the stage, its units and the fix, instead of torch's ``'NoneType' object is not callable`` inside the
    schedule. Other errors pass unchanged."""
    import functools

    forward = stage.forward

    @functools.wraps(forward)
    def guarded(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        except (AttributeError, TypeError, KeyError, IndexError) as err:
            if not (isinstance(err, (KeyError, IndexError)) or "NoneType" in str(err)):
                raise
            raise StageForwardError(
                f"pipeline stage {index} holds only the units {kept}, and its forward used a module it does not hold "
                f"({type(err).__name__}: {err}): under strategy='pp' each stage's copy of the model keeps its own "
                "units; the others are None (plain children) or deleted (ModuleList/ModuleDict entries). Write the "
                "forward so that it skips a module that is None and iterates over what its lists hold, e.g. "
                "`if self.embed is not None: x = self.embed(x)` and `for layer in self.layers: x = layer(x)` "
                "(docs/strategies.md, 'Pipeline split')") from err

    stage.forward = guarded


def _unwrapped(err: BaseException) -> BaseException:
    """The :class:`StageForwardError` that torch's ``PipelineStage`` wrapped in its "failed to run forward"
    RuntimeError, else ``err``."""
    cause = err.__cause__
    return cause if isinstance(cause, StageForwardError) else err


def micro_batches_for(batch: int, microbatches: int) -> int:
    """The micro-batches a batch of ``batch`` samples is cut into: the most, up to ``microbatches``, that
    divide it evenly (torch's schedules split the inputs and the targets by different rules, which give
    chunks of different sizes when they do not divide: ``torch.tensor_split`` against ``torch.chunk``)."""
    return max(n for n in range(1, min(microbatches, batch) + 1) if batch % n == 0)


def _schedule_key(inputs: torch.Tensor, training: bool, with_loss: bool = True) -> tuple:
    """What a schedule is made for: the batch's shape and dtype, training or not, with a loss or not."""
    return tuple(inputs.shape), inputs.dtype, training, with_loss


class PipelineRunner:
    """This rank's stage and its schedules: one training or evaluation step of a whole batch.

    Args:
        model: the stage (the model after :func:`keep_stage`).
        stage: this stage's index; ``stages``: how many; ``group``: the process group of the stages (rank
            ``s`` of it runs stage ``s``).
        schedule: "gpipe" or "1f1b"; ``microbatches``: how many micro-batches a batch is cut into.
        shared: ``[(process group, [parameters])]``: the gradients to sum across the stages holding them.
        autocast: None, or a factory of the autocast context (``Precision.autocast``) that the stage's forward
            and the loss run under (mixed precision, "64-true"'s default dtype: :func:`autocast_forward`).
        loss_dtype: the dtype of the step's loss as every stage returns it (float64 under "64-true", else float32).
    """

    def __init__(self, model: nn.Module, stage: int, stages: int, device: torch.device, group: Any,
                 schedule: str, microbatches: int, shared: list, autocast: Callable | None = None,
                 strict_microbatches: bool = False, units: list[str] | None = None,
                 loss_dtype: torch.dtype = torch.float32) -> None:
        import torch.distributed as dist

        self.model, self.stage, self.stages, self.device, self.group = model, stage, stages, device, group
        self.schedule, self.microbatches, self.shared = schedule, microbatches, shared
        self.autocast, self.strict_microbatches, self.loss_dtype = autocast, strict_microbatches, loss_dtype
        explain_missing_modules(model, stage, units or [])
        if autocast is not None:
            autocast_forward(model, autocast)
        self.last_rank = dist.get_global_rank(group, stages - 1)
        self._schedules: dict = {}
        self._loss_fn: Callable | None = None
        self._weight = 1.0
        self._scale: Callable | None = None  # the loss scaling of this step ("16-mixed"), or None

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def _schedule_for(self, inputs: torch.Tensor, training: bool, with_loss: bool = True):
        """The schedule of batches shaped like ``inputs`` (made on first use: one stage per shape); without
        ``with_loss`` one that computes no loss (prediction: the last stage's outputs only)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        key = _schedule_key(inputs, training, with_loss)
        if training and self.strict_microbatches and not any(k[2] for k in self._schedules):
            self._check_first_batch(inputs.shape[0])
        if key not in self._schedules:
            n = micro_batches_for(inputs.shape[0], self.microbatches)
            cls = Schedule1F1B if self.schedule == "1f1b" and n >= self.stages else ScheduleGPipe  # 1F1B needs n ≥ P
            stage = PipelineStage(self.model, self.stage, self.stages, self.device, group=self.group)
            self._schedules[key] = cls(stage, n, loss_fn=self._loss if with_loss else None, scale_grads=False)
        return self._schedules[key]

    def _check_first_batch(self, batch: int) -> None:
        """The first training batch (each rank's, before any communication) holds at least ``pp_microbatches``
        samples; a later, smaller batch (an epoch's last) runs in fewer micro-batches.

        Raises:
            ValueError: on every rank, naming both numbers and the fixes.
        """
        if batch < self.microbatches:
            raise ValueError(f"pp_microbatches={self.microbatches} is more than the batch of {batch} samples each "
                             f"pipeline reads (a micro-batch needs at least one sample): use pp_microbatches <= "
                             f"{batch}, or a per-device batch size of at least {self.microbatches} (a multiple of it "
                             "keeps the micro-batches equal)")

    def _run(self, step: Callable, *args, **kwargs) -> Any:
        """A schedule's ``step``/``eval``, a stage's missing-module error raised as itself (:func:`_unwrapped`)."""
        try:
            return step(*args, **kwargs)
        except RuntimeError as err:
            cause = _unwrapped(err)
            if cause is err:
                raise
            raise cause from cause.__cause__

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        """A micro-batch's loss weighted by its share of the batch (and divided for accumulation), so the
        micro-batches' gradients sum to those of the batch's mean loss however the batch divides; multiplied
        by the loss scale under "16-mixed" (the schedule runs backward from what this returns)."""
        if self.autocast is None:
            loss = self._loss_fn(output, target) * (target.shape[0] * self._weight)
        else:
            with self.autocast():  # as a one-process loop computes it: e.g. cross-entropy of bf16 logits in fp32
                loss = self._loss_fn(output, target) * (target.shape[0] * self._weight)
        return loss if self._scale is None else self._scale(loss)

    def train_step(self, inputs: torch.Tensor, targets: Any, loss_fn: Callable, divisor: int,
                   sync: bool, scale: Callable | None = None) -> torch.Tensor:
        """Forward and backward of one batch; the gradients of the batch's mean loss divided by ``divisor``
        (and multiplied by ``scale``, the GradScaler's ``scale`` under "16-mixed") are added to ``.grad``;
        with ``sync`` the shared ones are then summed across their stages.
        Returns the batch's mean loss (0-d, detached, unscaled), the same on every stage (broadcast from the last)."""
        self._loss_fn, self._weight, self._scale = loss_fn, 1.0 / (inputs.shape[0] * divisor), scale
        # the loss scale, a power of 2, without a host sync; on every stage, as it starts the scaler of a stage
        # that computes no loss (GradScaler.unscale_ refuses to run on a scaler whose scale() was never called)
        factor = scale(torch.ones((), device=self.device)) if scale is not None else None
        losses: list = []
        fresh = _schedule_key(inputs, True) not in self._schedules
        kept = self._take_gradients() if fresh else {}
        # return_outputs=False: the last stage keeps no micro-batch's output (the logits) to the end of the step
        self._run(self._schedule_for(inputs, True).step, *self._first(inputs), target=targets, losses=losses,
                  return_outputs=False)
        for p, grad in kept.items():
            p.grad = grad if p.grad is None else p.grad + grad
        if sync:
            self.sync_shared()
        loss = torch.zeros((), device=self.device, dtype=self.loss_dtype)
        if self.is_last:
            loss = torch.stack(losses).detach().to(self.loss_dtype).sum() * divisor
            loss = loss if factor is None else loss / factor  # exact for GradScaler's powers of 2
        return self._from_last(loss)

    def _take_gradients(self) -> dict:
        """Detach the stage's gradients from its parameters (returned by parameter). A new schedule's first step
        infers the activations' shapes by a real forward and backward, after which torch 2.13 sets the
        gradients of FSDP modules to None (``_post_metadata_inference_cleanup``): a batch of a new shape
        inside an accumulated step would drop the earlier micro-batches' gradients."""
        kept = {p: p.grad for p in self.model.parameters() if p.grad is not None}
        for p in kept:
            p.grad = None
        return kept

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: Any, loss_fn: Callable) -> dict[str, float]:
        """The batch's mean loss (and accuracy for a classifier's ``(N, classes)`` logits) from a
        forward-only schedule step, as numbers, the same on every stage."""
        self._loss_fn, self._weight, self._scale = loss_fn, 1.0 / inputs.shape[0], None
        out = self._run(self._schedule_for(inputs, False).eval, *self._first(inputs), target=targets, losses=[])
        metrics = None
        if self.is_last:
            metrics = {"loss": float(loss_fn(out, targets))}
            if out.ndim == 2 and targets.ndim == 1 and not targets.is_floating_point():
                metrics["accuracy"] = float((out.argmax(dim=1) == targets).float().mean())
        return self._object_from_last(metrics)

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's outputs on the batch ``inputs`` (the micro-batches' outputs concatenated, on the host)
        from a forward-only schedule step without a loss, the same on every stage (sent from the last)."""
        out = self._run(self._schedule_for(inputs, False, with_loss=False).eval, *self._first(inputs))
        return self._object_from_last(out.detach().cpu() if self.is_last else None)

    def _first(self, inputs: torch.Tensor) -> tuple:
        return (inputs,) if self.stage == 0 else ()

    def _from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.broadcast(tensor, src=self.last_rank, group=self.group)
        return tensor

    def _object_from_last(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return box[0]

    @torch.no_grad()
    def broadcast_shared(self) -> None:
        """Give every copy of a shared parameter the values of the first stage holding it (one broadcast
        each, of the local shards): after a meta-device model is materialised stage by stage."""
        import torch.distributed as dist

        for group, params in self.shared:
            for p in params:
                local = p.to_local() if hasattr(p, "to_local") else p
                dist.broadcast(local, src=dist.get_global_rank(group, 0), group=group)

    def sync_shared(self) -> None:
        """Sum the gradients of shared parameters across the stages that hold them (one all-reduce each; of
        the local shards under FSDP, which shards every stage's copy alike)."""
        import torch.distributed as dist

        for group, params in self.shared:
            for p in params:
                if p.grad is None:  # unused on this stage this step: its part is zero
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad, group=group)


def autocast_forward(module: nn.Module, autocast: Callable) -> None:
    """Run every call of ``module`` (a pipeline stage) under ``autocast()``, entered by a forward pre-hook and
    left by a forward hook: torch's ``PipelineStage`` calls the stage itself and runs its backward (which must
    not run under autocast: https://pytorch.org/docs/stable/amp.html#autocasting) in the same schedule step."""
    contexts: list = []

    def enter(mod, args):
        contexts.append(autocast())
        contexts[-1].__enter__()

    def leave(mod, args, output):
        contexts.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(leave, always_call=True)
