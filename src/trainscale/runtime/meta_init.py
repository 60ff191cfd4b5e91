"""Materialising a model built on the meta device, after it has been sharded.

A model built under ``with torch.device("meta"):`` holds no memory. A sharded strategy shards it
first (``fully_shard`` and ``parallelize_module`` accept meta parameters), then allocates only this
rank's shards with ``module.to_empty(device=...)`` and fills them in place: the whole model never
exists on one device. This is the recipe of torch's FSDP2 and torchtitan (``model.to_empty``, then
``model.init_weights()``; https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).

Initialisation runs, for every submodule from the root down, the first of: the module's own
``init_weights()`` (which then covers its whole subtree), else its ``reset_parameters()`` (torch's
layers all have one), continuing into its children.

Random values on CPU meshes: DTensor's random operators keep shards of one tensor distinct only
on CUDA-like devices (torch's ``OffsetBasedRNGTracker``; ``is_rng_supported_mesh``). On a CPU mesh every
rank would draw the same numbers for its own shard, so rows ``i`` and ``i + rows/N`` of a weight
would be equal and stay equal in training (symmetric units). There, the caller passes a
``seed_offset`` (the index of this rank's shard) and the initialisation runs under a forked CPU
generator seeded with one draw of the current generator plus that offset: shards differ, the same
seed gives the same model, and the caller's random state moves on by that one draw on every rank.
"""

from __future__ import annotations


import torch
from torch import nn


def on_meta(module: nn.Module) -> bool:
    """True when ``module``'s parameters and buffers are all on the meta device; False when none is.

    Raises:
        ValueError: only some are (``to_empty`` would discard the real ones).
    """
    tensors = [*module.parameters(), *module.buffers()]
    meta = [t.is_meta for t in tensors]
    if any(meta) and not all(meta):
        raise ValueError("the model has some parameters or buffers on the meta device and some not; build the "
                         "whole model under `with torch.device('meta'):` (or none of it)")
    return bool(tensors) and all(meta)


def uninitialisable(module: nn.Module) -> list[str]:
    """Names of submodules holding parameters or buffers of their own that neither an ``init_weights()``
    of theirs or of an ancestor, nor a ``reset_parameters()`` of their own would initialise."""
    missing: list[str] = []

    def visit(name: str, sub: nn.Module) -> None:
        if callable(getattr(sub, "init_weights", None)):
            return
        owns = any(True for _ in sub.parameters(recurse=False)) or any(True for _ in sub.buffers(recurse=False))
        if owns and not callable(getattr(sub, "reset_parameters", None)):
            missing.append(f"{name or '<root>'} ({type(sub).__name__})")
        for child_name, child in sub.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", module)
    return missing


def check_initialisable(module: nn.Module) -> None:
    """Raise before sharding if :func:`initialise` would leave tensors uninitialised.

    Raises:
        ValueError: names the submodules and the fix (an ``init_weights()`` on the model).
    """
    missing = uninitialisable(module)
    if missing:
        raise ValueError(f"the model was built on the meta device, but {', '.join(missing[:5])}"
                         f"{' and others' if len(missing) > 5 else ''} own parameters or buffers with no "
                         "init_weights() or reset_parameters() to fill them after to_empty(); define "
                         "init_weights() on the model (see trainscale.models.GPT), or build it on a real device")


def check_meta(module: nn.Module, tensor_parallel: bool, device_type: str) -> bool:
    """Whether ``module`` is on the meta device (:func:`on_meta`), checked to be materialisable by a strategy
    that shards it, with ``tensor_parallel`` layers, on a ``device_type`` mesh.

    Raises:
        ValueError: partly on meta; submodules nothing initialises (:func:`check_initialisable`); tensor
            parallelism on a CPU mesh (DTensor's RNG keeps the shards of one tensor distinct on CUDA only).
    """
    if not on_meta(module):
        return False
    check_initialisable(module)
    if tensor_parallel and device_type == "cpu":
        raise ValueError("a meta-device model under tensor parallelism needs a CUDA mesh (DTensor's RNG keeps "
                         "the shards of one tensor distinct on CUDA only); on CPU build the model on the CPU")
    return True


def initialise(module: nn.Module) -> None:
    """Fill ``module``'s tensors in place: ``init_weights()`` where defined (covering its subtree), else
    ``reset_parameters()``, from the root down."""
    if callable(getattr(module, "init_weights", None)):
        module.init_weights()
        return
    if callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()
    for child in module.children():
        initialise(child)


def materialise(module: nn.Module, device: torch.device, seed_offset: int | None = None) -> nn.Module:
    """``to_empty(device)`` then :func:`initialise`, with this rank's shard seeded apart on CPU meshes.

    Args:
        module: a (sharded) module whose tensors are on the meta device.
        device: where this rank's shards go.
        seed_offset: None (the device's DTensor RNG keeps shards distinct: CUDA), or this rank's shard
            index: the values are drawn from a forked CPU generator seeded with ``draw + seed_offset``.

    Returns:
        ``module``, materialised in place.
    """
    module.to_empty(device=device)
    with torch.no_grad():
        if seed_offset is None:
            initialise(module)
            return module
        base = int(torch.randint(0, 2 ** 31, ()))  # the same draw on every identically seeded rank
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(base + seed_offset)
            initialise(module)
    return module
