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
uses. https://pytorch.org/docs/stable/distributed.tensor.parallel.html.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2), on by default as torchtitan applies it with every TP plan (v0.1.0
``models/llama3/infra/parallelize.py`` ``apply_tp``): between the blocks' matrix products the residual
stream ``(B, T, C)`` is split by sequence, each rank holding ``(B, T/tp, C)``. The norms run on their
rank's tokens (``SequenceParallel``: weights replicated DTensors); the input of the attention and of the
MLP is all-gathered to the whole sequence (``PrepareModuleInput(Shard(1) -> Replicate())``); their output
projections reduce-scatter instead of all-reducing (``RowwiseParallel(output_layouts=Shard(1))``); the
token embedding reduce-scatters too, and the position embedding's rows are cut to the rank's positions.
The final norm's output is all-gathered for the tied projection. Same communication volume (an
all-reduce is a reduce-scatter plus an all-gather); what is saved is activation memory: the norms'
inputs, the residual stream and the dropout inputs are held for 1/tp of the tokens. torch's
``ColwiseParallel`` saves the all-gathered input of q/k/v and of the MLP's first layer for backward (the
paper's implementation re-gathers it in backward instead), so the saving is smaller than the paper's
``1/tp`` of everything: docs/strategies.md gives the measured bytes. Runs on CPU with gloo in torch 2.13.
The norms' weight gradients come out of backward as partial sums over the tp ranks; a gradient hook
all-reduces them (Megatron-LM's ``allreduce_layernorm_grads``; FSDP does it itself when it shards the
model on top). Not with dropout > 0 (each rank would draw its shard's mask from the same seeded generator,
so masks repeat every ``T/tp`` tokens; Megatron forks a per-rank generator here), and the sequence length
must be a multiple of tp; both are refused with an error. ``sequence_parallel=False`` gives the plain
Megatron split, with norms as plain replicated tensors.

A pipeline stage of the GPT (``apply_pp.keep_stage``: some blocks, the others dropped or None) gets the
plan of the modules it keeps; a stage without ``ln_f`` returns its residual stream as a plain local tensor
(``(B, T/tp, C)`` under sequence parallelism) for the next stage's first block, whose norm (or attention,
without sequence parallelism) takes it as it is. The token embedding's gradient is laid out as its
parameter by a gradient hook (``_grad_like_param``): the lookup's backward alone (the first stage's, which
lacks the tied projection) gives a whole ``Replicate`` gradient in torch 2.13, the rows of the other ranks
included.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable

import torch
from torch import nn

from trainscale.runtime import hf


def gpt_plan(gpt: Any, sequence_parallel: bool = False) -> dict:
    """The built-in plan for ``trainscale.models.GPT``'s submodules, keyed relative to the GPT module
    (the GPT itself gets :func:`gpt_output_style`, and with ``sequence_parallel`` the second pass
    :func:`gpt_sequence_outputs`).

    Raises:
        ValueError: ``n_head`` not divisible by the tp size is checked in :func:`apply_tp`.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    # token embedding: vocabulary rows split, the lookup completed by one all-reduce (torchtitan's plan), or
    # by a reduce-scatter to sequence shards. Position embedding: width columns split, the lookup all-gathered;
    # split by rows, its lookup by the 1-D positions got a whole (replicated) gradient in torch 2.13, and with
    # it whole optimizer state on every rank.
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "wpe": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    # the final norm's output as a replicated DTensor, so the tied projection F.linear(x, wte.weight)
    # multiplies it by the row shards of wte: logits sharded by vocabulary, Shard(-1)
    plan["ln_f"] = (SequenceParallel() if sequence_parallel else
                    PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(),
                                        use_local_output=False))
    plan = {name: style for name, style in plan.items() if getattr(gpt, name) is not None}  # a pipeline stage's
    for i, _ in gpt.blocks.named_children():  # a pipeline stage keeps some blocks, under their own indices
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel(output_layouts=seq)
        if sequence_parallel:  # norms on sequence shards; attention and MLP all-gather their input
            for norm, layer in (("ln_1", "attn"), ("ln_2", "mlp")):
                plan[f"blocks.{i}.{norm}"] = SequenceParallel()
                plan[f"blocks.{i}.{layer}"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                                 desired_input_layouts=(Replicate(),))
    return plan


def gpt_sequence_outputs(gpt: Any = None) -> dict:
    """Under sequence parallelism, the second pass on the GPT's submodules (a module takes one style per
    ``parallelize_module`` call): the position embedding ``(T, C)``, whole after its all-gather, cut to
    the rank's positions ``(T/tp, C)`` (a local slice); the final norm's ``(B, T/tp, C)`` output
    all-gathered to ``(B, T, C)`` for the tied projection. Of a pipeline stage ``gpt``, the entries of the
    modules it keeps."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput

    plan = {"wpe": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
            "ln_f": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                        use_local_output=False)}
    return {name: style for name, style in plan.items() if gpt is None or getattr(gpt, name) is not None}


def gpt_output_style() -> Any:
    """The GPT's own output: logits sharded by vocabulary, all-gathered into a plain ``(B, T, vocab)`` tensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput

    return PrepareModuleOutput(output_layouts=Shard(-1), desired_output_layouts=Replicate(), use_local_output=True)


def _grad_like_param(param: Any) -> None:
    """Lay a DTensor gradient out as its parameter: a replicated weight applied to sequence shards (a norm's)
    gets a ``Partial`` gradient, each rank's sum over its tokens (all-reduced here); the vocabulary-split token
    embedding gets a whole ``Replicate`` gradient from its lookup's backward in torch 2.13 (cut here to the
    rank's rows, no communication). The optimizer, the checkpoints and the pipeline's sum of the tied
    embedding's gradient across stages (``apply_pp.PipelineRunner.sync_shared``) expect the parameter's layout."""
    grad = param.grad
    if grad is not None and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(placements=param.placements)


def _check_sequence_length(tp: int) -> Any:
    """A forward pre-hook of the GPT: the sequence length must split evenly over the tp ranks."""
    def hook(module: nn.Module, args: tuple) -> None:
        T = args[0].shape[1]
        if T % tp:
            raise ValueError(f"sequence parallelism splits the sequence over tp={tp} ranks, but the input has "
                             f"T={T} tokens: use a context length divisible by {tp}, or "
                             "strategy_options={'sequence_parallel': False}")
    return hook


def _sequence_parallel_gpt(gpt: nn.Module, tp_mesh: Any) -> None:
    """The second pass, the norms' gradient hooks and the length check of a GPT under sequence parallelism."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(gpt, tp_mesh, gpt_sequence_outputs(gpt))
    for module in gpt.modules():
        if isinstance(module, nn.LayerNorm):
            for p in module.parameters():
                p.register_post_accumulate_grad_hook(_grad_like_param)
    if gpt.wpe is not None:  # token ids in (a later pipeline stage receives T/tp positions of hidden states)
        gpt.register_forward_pre_hook(_check_sequence_length(tp_mesh.size()))


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
    check_plan_keys(root, plan)  # raises: some key names nothing in root, or root would have been returned
    return root


def check_plan_keys(model: nn.Module, plan: dict) -> None:
    """Every key of ``plan`` names at least one submodule of ``model``.

    Raises:
        ValueError: naming the keys that match nothing, and listing some of the submodules.
    """
    missing = sorted(key for key in plan if not _has(model, key))
    if missing:
        names = [n for n, _ in model.named_modules() if n][:12]
        raise ValueError(f"tp_plan key(s) {missing} name no submodule of the model; its submodules include: "
                         f"{', '.join(names)}. Keys are module names relative to your model, e.g. "
                         "'layers.0.mlp.fc' or 'layers.*.mlp.fc'")


def check_plan_styles(plan: dict) -> None:
    """Every value of ``plan`` is a torch ``ParallelStyle``.

    Raises:
        ValueError: naming the entries that are not (a Hugging Face-style string is refused earlier, by the
            resolver, with its translation).
    """
    from torch.distributed.tensor.parallel import ParallelStyle

    bad = {key: style for key, style in plan.items() if not isinstance(style, ParallelStyle)}
    if bad:
        raise ValueError(f"tp_plan entries {bad!r} are not torch ParallelStyle objects; use ColwiseParallel(), "
                         "RowwiseParallel(), SequenceParallel(), PrepareModuleInput(...) or PrepareModuleOutput(...) "
                         "from torch.distributed.tensor.parallel")


def planned_style(name: str, plan: dict) -> tuple[str, Any] | None:
    """The ``(key, style)`` of ``plan`` that applies to the submodule ``name`` (dotted, relative to the plan's
    module): a key of as many parts, each an ``fnmatch`` pattern of the name's part, as ``parallelize_module``
    reads it; None when no key names it."""
    parts = name.split(".")
    for key, style in plan.items():
        patterns = key.split(".")
        if len(patterns) == len(parts) and all(fnmatch.fnmatch(n, k) for n, k in zip(parts, patterns)):
            return key, style
    return None


def leaves_output_sharded(style: Any) -> bool:
    """Whether a module under ``style`` returns less than its whole output as a plain tensor: its slice
    (``ColwiseParallel()``'s ``Shard(-1)``, ``SequenceParallel``'s ``Shard(1)``) or a DTensor
    (``use_local_output=False``), which the user's loss cannot take with plain targets."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    if isinstance(style, PrepareModuleInput):  # leaves the output as the module made it
        return False
    style = getattr(style, "prepare_module_output", style)  # PrepareModuleInputOutput: its output part
    if isinstance(style, SequenceParallel) or not getattr(style, "use_local_output", True):
        return True
    layouts = getattr(style, "desired_output_layouts", None) or getattr(style, "output_layouts", None) or ()
    layouts = layouts if isinstance(layouts, (tuple, list)) else (layouts,)
    return any(layout is not None and not isinstance(layout, Replicate) for layout in layouts)


def _sharded_output_error(name: str, style: Any) -> ValueError:
    return ValueError(
        f"tp_plan leaves the model's output sharded: its output comes from '{name}', planned as {style!r}, which "
        "returns each tp rank's slice of it (or a DTensor), so the loss would see part of the outputs (or fail on "
        "mixed tensor types). Give the output layer RowwiseParallel() (after a ColwiseParallel() layer), or "
        "ColwiseParallel(output_layouts=Replicate()) (all-gathers the whole output), or leave it out of the plan")


def check_last_unit_output(model: nn.Module, plan: dict, last_unit: str) -> None:
    """Under pipeline parallelism, before the cut, on every rank: the last unit (``apply_pp.units``, in the
    model's order, which the pipeline takes for its forward order) must not end in a planned layer whose
    output stays sharded: the last stage's output goes to the loss.

    Raises:
        ValueError: naming the layer, its style and the fixes.
    """
    unit = model.get_submodule(last_unit)
    leaves = [f"{last_unit}.{n}" if n else last_unit for n, m in unit.named_modules()
              if not list(m.children()) and any(True for _ in m.parameters(recurse=False))]
    found = planned_style(leaves[-1], plan) if leaves else None
    if found is not None and leaves_output_sharded(found[1]):
        raise _sharded_output_error(leaves[-1], found[1])


def check_output_at_first_forward(model: nn.Module, plan: dict) -> None:
    """Refuse, at ``model``'s first forward (on every rank: each runs the same forward), an output that is a
    DTensor or that is the very tensor a planned layer returned as its slice (``leaves_output_sharded``). The
    hooks remove themselves after that forward.

    Raises (at that forward):
        ValueError: naming the layer, its style and the fixes.
    """
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    sliced: list = []  # (output, name, style) of the planned layers that return slices, this forward only
    handles = []

    def keep(name: str, style: Any):
        return lambda module, args, out: sliced.append((out, name, style))

    for name, module in model.named_modules():
        found = planned_style(name, plan) if name else None
        if found is not None and leaves_output_sharded(found[1]):
            handles.append(module.register_forward_hook(keep(name, found[1])))

    def check(module, args, out):
        for handle in handles:
            handle.remove()
        leaves = [leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        try:
            for leaf in leaves:
                for tensor, name, style in sliced:
                    if leaf is tensor:
                        raise _sharded_output_error(name, style)
            if any(isinstance(leaf, DTensor) for leaf in leaves):
                raise _sharded_output_error(type(model).__name__, "a plan that returns a DTensor (use_local_output="
                                            "False)")
        finally:
            sliced.clear()

    handles.append(model.register_forward_hook(check))


def stage_plan(stage: nn.Module, plan: dict) -> dict:
    """The entries of a user's ``plan`` (keyed against the whole model) whose submodules the pipeline
    ``stage`` keeps (``apply_pp.keep_stage`` leaves the kept modules under their own names), so that each
    stage applies its part of the plan (torchtitan applies its ``parallelize_fn`` to each model part after
    the cut)."""
    return {key: style for key, style in plan.items() if _has(stage, key)}


def tied_parameters(module: nn.Module) -> list[list[str]]:
    """The names of each parameter ``module`` registers under more than one name (tied weights: a language model's
    output head and token embedding, T5's shared embedding), one list per parameter."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def parallelize_keeping_ties(parallelize: Callable, module: nn.Module, mesh) -> nn.Module | None:
    """The user's ``parallelize(module, mesh)``, then each weight ``module`` tied before it tied again
    (:func:`tie_again`): ``parallelize_module`` inside the user's function unties them as it does under a
    ``tp_plan``. Returns what ``parallelize`` returned; groups whose names the returned module no longer holds (it
    wrapped or replaced them) are left as the function made them.

    Raises:
        ValueError: the function split the tied names in different ways (:func:`tie_again`).
    """
    tied = tied_parameters(module)
    out = parallelize(module, mesh)
    target = module if out is None else out
    names = {name for name, _ in target.named_parameters(remove_duplicate=False)}
    tie_again(target, [group for group in tied if set(group) <= names], by="parallelize=fn")
    return out


def tie_again(module: nn.Module, tied: list[list[str]], by: str = "tp_plan") -> None:
    """Register each group of ``tied`` names (from :func:`tied_parameters`, before ``parallelize_module``) as one
    parameter again. ``parallelize_module`` replaces each planned module's parameters by new DTensor parameters,
    module by module, so a head tied to the embedding came out as a second parameter, trained apart from the
    embedding (and written twice by checkpoints). Kept as one, its gradient sums both uses, as without tp.

    Raises:
        ValueError: the plan (``by``: "tp_plan" or "parallelize=fn") lays the tied names out differently (one
            split and the other not, or split along other dimensions), naming them and a plan that splits both
            alike.
    """
    from torch.distributed.tensor import DTensor

    for group in tied:
        params = [module.get_parameter(name) for name in group]
        layouts = {name: tuple(p.placements) if isinstance(p, DTensor) else "a plain tensor"
                   for name, p in zip(group, params)}
        if len(set(layouts.values())) > 1:
            raise ValueError(
                f"{by} splits the tied weights {', '.join(group)} (one parameter) in different ways ({layouts}); "
                "split both modules' weights alike, e.g. RowwiseParallel(input_layouts=Replicate()) on the token "
                "embedding and ColwiseParallel(output_layouts=Replicate()) on the output head (both split the "
                "vocabulary rows, Shard(0)), or untie them (tie_word_embeddings=False)")
        for name in group[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, params[0])


def _hf_styles() -> dict:
    """Hugging Face's tensor-parallel style names (``transformers/integrations/tensor_parallel.py``) that have a
    torch ``ParallelStyle`` here, each tested on a Llama (tests/test_huggingface.py): Megatron's column and row
    splits, the vocabulary-row split of the token embedding (completed by one all-reduce, as torchtitan's
    plan), and a column split whose output is gathered whole (the language-model head: the loss sees whole
    logits)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
            "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate())}


def hf_plan(root: nn.Module, tp: int) -> dict | None:
    """The tensor-parallel plan a Hugging Face model in ``root`` declares (its ``tp_plan``: the config's
    ``base_model_tp_plan`` under the base model's prefix, and the head's ``_tp_plan``), as torch
    ``ParallelStyle``s keyed relative to ``root``; None when ``root`` holds no Hugging Face model.

    Raises:
        ValueError: the model declares no plan; a style other than those of :func:`_hf_styles` (naming them);
            ``tp`` does not divide its attention or key/value heads.
    """
    model = hf.pretrained_model(root)
    if model is None:
        return None
    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    name = type(model).__name__
    if not plan:
        raise ValueError(f"{name} declares no tensor-parallel plan (base_model_tp_plan); pass "
                         "tp_plan={'layer.name': ColwiseParallel(), ...} or parallelize=fn(model, mesh)")
    styles = _hf_styles()
    unknown = sorted({style for style in plan.values() if style not in styles})
    if unknown:
        raise ValueError(f"{name}'s tensor-parallel plan uses style(s) {', '.join(map(repr, unknown))}, which "
                         f"trainscale does not translate (it translates {', '.join(map(repr, styles))}); pass your own tp_plan of "
                         "torch ParallelStyles or parallelize=fn(model, mesh)")
    _check_hf_config(name, model.config, tp)
    prefix = next(n for n, m in root.named_modules() if m is model)
    return {f"{prefix}.{key}" if prefix else key: styles[style]() for key, style in plan.items()}


def _check_hf_config(name: str, config: Any, tp: int) -> None:
    """Raise unless ``tp`` divides the attention and key/value heads."""
    for field in ("num_attention_heads", "num_key_value_heads"):
        if getattr(config, field, None) and getattr(config, field) % tp:
            raise ValueError(f"tp={tp} must divide {name}'s {field}={getattr(config, field)} (each rank computes "
                             "whole attention heads)")


def apply_tp(root: nn.Module, tp_mesh: Any, plan: dict | None = None, sequence_parallel: bool = False,
             whole_output: bool = True) -> nn.Module:
    """Split ``root``'s layers over ``tp_mesh`` (1-D) by ``plan``, or when ``plan`` is None by the built-in plan of
    every ``trainscale.models.GPT`` inside ``root``, or by the plan a Hugging Face model in ``root`` declares
    (:func:`hf_plan`; without sequence parallelism). In place; returns ``root``.

    Args:
        root: the module given to the strategy (the user's model, or the Trainer's loop module around it).
        tp_mesh: the ``tp`` dimension of the job's mesh.
        plan: ``{submodule name: ParallelStyle}`` (``ColwiseParallel()``, ``RowwiseParallel()``,
            ``SequenceParallel()``, ``PrepareModuleInput(...)``), names relative to the user's model.
        sequence_parallel: with the built-in plan, split norms and the residual stream by sequence
            (module docstring); the strategy passes True by default.
        whole_output: with ``plan``, refuse at the first forward a model output left sharded by the plan
            (:func:`check_output_at_first_forward`); False for a pipeline stage, whose output may go on sharded
            to the next stage (the last stage's is checked before the cut: :func:`check_last_unit_output`).

    Raises:
        ValueError: no plan and no GPT inside ``root``; plan values that are not ``ParallelStyle``
            objects; plan keys that match nothing; tied weights the plan splits in different ways
            (:func:`tie_again`); at the first forward, an output the plan leaves sharded; a GPT whose
            ``n_head`` is not divisible by the tp size; under ``sequence_parallel``, a GPT with dropout > 0
            (and, at forward, a sequence length tp does not divide).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from trainscale.models.gpt import GPT

    if plan is not None:
        check_plan_styles(plan)
        target = plan_target(root, plan)
        tied = tied_parameters(target)
        parallelize_module(target, tp_mesh, plan)
        tie_again(target, tied)
        if whole_output:
            check_output_at_first_forward(target, plan)
        return root
    gpts = [m for m in root.modules() if isinstance(m, GPT)]
    if not gpts and (hf_styles := hf_plan(root, tp_mesh.size())) is not None:  # a Hugging Face model's own plan
        tied = tied_parameters(root)
        parallelize_module(root, tp_mesh, hf_styles)
        tie_again(root, tied)
        return root
    if not gpts:
        raise ValueError(f"tensor parallelism has a built-in plan for trainscale.models.GPT only, and the model "
                         f"({type(root).__name__}) holds none; pass tp_plan={{'layer.name': ColwiseParallel(), ...}} "
                         "or parallelize=fn(model, mesh) (docs/strategies.md, 'Writing a TP plan')")
    for gpt in gpts:
        if gpt.config.n_head % tp_mesh.size():
            raise ValueError(f"tp={tp_mesh.size()} must divide the GPT's n_head={gpt.config.n_head} (each rank "
                             "computes whole attention heads)")
        if sequence_parallel and gpt.config.dropout > 0:
            raise ValueError(f"sequence parallelism with GPT dropout={gpt.config.dropout}: the tp ranks would draw "
                             "the same dropout masks for their sequence shards; use dropout=0 or "
                             "strategy_options={'sequence_parallel': False}")
        parallelize_module(gpt, tp_mesh, gpt_plan(gpt, sequence_parallel))
        if gpt.wte is not None:
            gpt.wte.weight.register_post_accumulate_grad_hook(_grad_like_param)
        if sequence_parallel:
            _sequence_parallel_gpt(gpt, tp_mesh)
        if gpt.ln_f is not None:  # logits out: not a pipeline stage that sends hidden states on
            parallelize_module(gpt, tp_mesh, gpt_output_style())
    return root
