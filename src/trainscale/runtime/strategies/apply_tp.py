"""``apply_tp``: tensor parallelism from outside the model with torch's ``parallelize_module``.

Megatron-LM's split of a transformer block (Shoeybi et al. 2019): the first linear layer of the
attention (query, key, value) and of the MLP is split by output columns (``ColwiseParallel``: each
rank computes some heads / some hidden units from the whole input), the second by input rows
(``RowwiseParallel``: each rank multiplies its slice, one all-reduce sums them). Two all-reduces per
block in forward, two in backward; each rank holds 1/tp of the blocks' matrices.

The embeddings are split too (torchtitan v0.1.0 ``apply_tp``: ``RowwiseParallel(input_layouts=Replicate())``
on the token embedding): each rank holds 1/tp of the vocabulary rows, looks up the ids it holds, and one
all-reduce completes the embedding; the position embedding is split by columns (1/tp of the width,
all-gathered after the lookup). The GPT's output projection is tied to
the token embedding (``F.linear(x, wte.weight)``, one parameter), so it uses the same row shards: the
final norm's output is marked replicated (``PrepareModuleOutput``), the projection then gives each rank
the logits of its vocabulary slice (``Shard(-1)``), and the GPT's output is all-gathered to whole
logits (the user's loss sees a plain tensor). The tie stays one parameter whose gradient gathers both
uses. Norms stay replicated (plain tensors, identical on the tp ranks, whose gradients come out
identical without communication). https://pytorch.org/docs/stable/distributed.tensor.parallel.html.

Sequence parallelism (norms and dropout on sequence shards) is not applied.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn


def gpt_plan(gpt: Any) -> dict:
    """The built-in plan for ``trainscale.models.GPT``'s submodules, keyed relative to the GPT module
    (the GPT itself gets :func:`gpt_output_style`).

    Raises:
        ValueError: ``n_head`` not divisible by the tp size is checked in :func:`apply_tp`.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel

    # token embedding: vocabulary rows split, the lookup completed by one all-reduce (torchtitan's plan).
    # Position embedding: width columns split, the lookup all-gathered; split by rows, its lookup by the 1-D
    # positions got a whole (replicated) gradient in torch 2.13, and with it whole optimizer state on every rank.
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "wpe": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            # the final norm's output as a replicated DTensor, so the tied projection F.linear(x, wte.weight)
            # multiplies it by the row shards of wte: logits sharded by vocabulary, Shard(-1)
            "ln_f": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(),
                                        use_local_output=False)}
    for i in range(len(gpt.blocks)):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def gpt_output_style() -> Any:
    """The GPT's own output: logits sharded by vocabulary, all-gathered into a plain ``(B, T, vocab)`` tensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput

    return PrepareModuleOutput(output_layouts=Shard(-1), desired_output_layouts=Replicate(), use_local_output=True)


def _has(module: nn.Module, key: str) -> bool:
    """Whether the plan key (dotted, each part an ``fnmatch`` pattern as ``parallelize_module`` reads
    it) names at least one submodule of ``module``."""
    head, _, rest = key.partition(".")
    for name, child in module.named_children():
        if fnmatch.fnmatch(name, head) and (not rest or _has(child, rest)):
            return True
    return False


def plan_target(root: nn.Module, plan: dict) -> nn.Module:
    """The module a user's plan is keyed against: ``root`` itself or one of its children (the Trainer
    puts the user's model inside its loop module as ``model``).

    Raises:
        ValueError: no such module holds every key (the message lists the missing keys).
    """
    for candidate in (root, *root.children()):
        if all(_has(candidate, key) for key in plan):
            return candidate
    missing = sorted(key for key in plan if not _has(root, key))
    names = [n for n, _ in root.named_modules() if n][:12]
    raise ValueError(f"tp_plan key(s) {missing} name no submodule of the model; its submodules include: "
                     f"{', '.join(names)}. Keys are module names relative to your model, e.g. 'layers.0.mlp.fc' "
                     "or 'layers.*.mlp.fc'")


def apply_tp(root: nn.Module, tp_mesh: Any, plan: dict | None = None) -> nn.Module:
    """Split ``root``'s layers over ``tp_mesh`` (1-D) by ``plan``, or by the built-in plan of every
    ``trainscale.models.GPT`` inside ``root`` when ``plan`` is None. In place; returns ``root``.

    Args:
        root: the module given to the strategy (the user's model, or the Trainer's loop module around it).
        tp_mesh: the ``tp`` dimension of the job's mesh.
        plan: ``{submodule name: ParallelStyle}`` (``ColwiseParallel()``, ``RowwiseParallel()``,
            ``SequenceParallel()``, ``PrepareModuleInput(...)``), names relative to the user's model.

    Raises:
        ValueError: no plan and no GPT inside ``root``; plan keys that match nothing; a GPT whose
            ``n_head`` is not divisible by the tp size.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from trainscale.models.gpt import GPT

    if plan is not None:
        parallelize_module(plan_target(root, plan), tp_mesh, plan)
        return root
    gpts = [m for m in root.modules() if isinstance(m, GPT)]
    if not gpts:
        raise ValueError(f"tensor parallelism has a built-in plan for trainscale.models.GPT only, and the model "
                         f"({type(root).__name__}) holds none; pass tp_plan={{'layer.name': ColwiseParallel(), ...}} "
                         "or parallelize=fn(model, mesh) (docs/strategies.md, 'Writing a TP plan')")
    for gpt in gpts:
        if gpt.config.n_head % tp_mesh.size():
            raise ValueError(f"tp={tp_mesh.size()} must divide the GPT's n_head={gpt.config.n_head} (each rank "
                             "computes whole attention heads)")
        parallelize_module(gpt, tp_mesh, gpt_plan(gpt))
        parallelize_module(gpt, tp_mesh, gpt_output_style())
    return root
