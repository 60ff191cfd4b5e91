"""What trainscale reads from a Hugging Face ``transformers`` model, without importing ``transformers``.

A module can only be a ``transformers.PreTrainedModel`` once ``transformers`` has been imported, so
:func:`pretrained_model` looks the package up in ``sys.modules`` and never imports it: runs without the
``hf`` extra pay nothing. Used by the fsdp strategies (the default FSDP units), activation checkpointing
(class names), the checkpointer (the model's config saved beside its weights) and ``trainscale export``.
"""

from __future__ import annotations

import sys
from typing import Any


def pretrained_model(module: Any) -> Any:
    """The outermost ``transformers.PreTrainedModel`` in ``module`` (``module`` itself, or a submodule such as
    the model inside the Trainer's loop module), or None."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    return next((m for m in module.modules() if isinstance(m, transformers.PreTrainedModel)), None)


def no_split_modules(module: Any) -> tuple[str, ...]:
    """The class names a Hugging Face model in ``module`` declares as ``_no_split_modules`` (its decoder
    layer, e.g. ``("LlamaDecoderLayer",)``), sorted; empty for any other module.

    ``PreTrainedModel.__init__`` gathers the names of its own class and of every ``PreTrainedModel`` child
    into the instance's ``_no_split_modules`` (transformers 5, ``modeling_utils.py``). Accelerate's
    ``TRANSFORMER_BASED_WRAP`` FSDP policy wraps each submodule of these classes as a unit of its own; the
    fsdp strategies do the same (``apply_fsdp.fsdp_units``).
    """
    model = pretrained_model(module)
    return tuple(sorted(getattr(model, "_no_split_modules", None) or ())) if model is not None else ()


def config_dict(module: Any) -> dict | None:
    """``model.config.to_dict()`` of the Hugging Face model in ``module`` (what ``config.json`` holds), with the
    model's class as ``architectures`` (as ``save_pretrained`` sets it; FSDP2's ``FSDP`` class prefix removed), or
    None. Saved in checkpoints as ``hf_config`` so that ``trainscale export`` can write ``config.json``."""
    model = pretrained_model(module)
    if model is None:
        return None
    return {**model.config.to_dict(), "architectures": [type(model).__name__.removeprefix("FSDP")]}


def class_matches(module: Any, classes: tuple, names: frozenset) -> bool:
    """Whether ``module`` is an instance of one of ``classes`` or its class is named in ``names`` (how a policy
    given as Hugging Face's class-name strings, e.g. ``{"LlamaDecoderLayer"}``, is matched)."""
    return isinstance(module, classes) or type(module).__name__ in names


def split_policy(policy: Any, flag: str) -> tuple[tuple, frozenset]:
    """A set of ``nn.Module`` classes and/or class names (strings) → ``(classes, names)``.

    Raises:
        ValueError: ``policy`` is a single string or class, or holds something else (instances, non-modules).
    """
    import torch

    if isinstance(policy, (str, bytes, type)) or not hasattr(policy, "__iter__"):
        raise ValueError(f"{flag}={policy!r} must be a set of nn.Module classes or class names, "
                         "e.g. {TransformerBlock} or {'LlamaDecoderLayer'}")
    items = tuple(policy)
    bad = [c for c in items if not (isinstance(c, str) or isinstance(c, type) and issubclass(c, torch.nn.Module))]
    if bad:
        raise ValueError(f"{flag} takes nn.Module classes or class names (strings); got {bad!r}. "
                         "Pass e.g. {TransformerBlock} or {'LlamaDecoderLayer'}")
    return tuple(c for c in items if isinstance(c, type)), frozenset(c for c in items if isinstance(c, str))
