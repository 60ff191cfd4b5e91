"""``apply_fsdp``: FSDP2 ``fully_shard`` over a 1-D (FSDP) or 2-D (HSDP) device mesh, units first.

Shared by the ``fsdp`` strategy (a 1-D mesh of all ranks) and ``model_parallel`` (the data-parallel
dimensions of its mesh; torchtitan v0.1.0 ``models/llama3/infra/parallelize.py::apply_fsdp``). Given a
2-D mesh ``(replicate, shard)``, ``fully_shard`` shards within each row and all-reduces gradients across
rows: hybrid sharding (HSDP; https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from trainscale.runtime import hf


def mixed_precision_policy(precision: str):
    """FSDP2's ``MixedPrecisionPolicy`` for a precision flag.

    "bf16-mixed"/"16-mixed": parameters all-gathered and computed in bf16/fp16, gradients
    reduce-scattered in fp32 (torchtitan's default: low-precision reductions lose accuracy
    with many ranks). Sharded parameters and optimizer states stay fp32. Other precisions:
    no casting ("bf16-true" parameters are already bf16).
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def full_precision_norms(module: Any, precision: str) -> list:
    """The batch-norm layers of ``module`` that must stay in full precision under a mixed policy.

    FSDP2's ``MixedPrecisionPolicy`` casts every parameter a unit gathers to bf16/fp16, but a BatchNorm's
    running statistics are buffers, which it leaves in fp32; on a CPU ``batch_norm`` then fails with
    "expected scalar type BFloat16 but found Float" (torch 2.13). FSDP1 kept BatchNorm out of low precision
    for this reason (``MixedPrecision._module_classes_to_ignore = (_BatchNorm,)``); with FSDP2 each such layer
    becomes its own unit with a full-precision policy (:func:`apply_fsdp`). Layers without parameters or
    statistics compute in any dtype and are left out.
    """
    from torch.nn.modules.batchnorm import _BatchNorm

    if precision not in ("bf16-mixed", "16-mixed"):
        return []
    return [m for m in module.modules() if m is not module and isinstance(m, _BatchNorm)
            and next(iter(m.state_dict().values()), None) is not None]


def _norm_policy(norm: Any, precision: str):
    """A BatchNorm unit's policy: parameters, statistics and gradient reduction in the layer's own (full)
    precision, inputs cast up to it, the output cast back to the compute dtype the rest of the model uses."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    full = next(iter(norm.state_dict().values())).dtype
    return MixedPrecisionPolicy(param_dtype=full, reduce_dtype=full,
                                output_dtype=mixed_precision_policy(precision).param_dtype)


def fsdp_units(module: Any, policy: tuple, strategy: str) -> list:
    """The submodules of ``module`` that become FSDP units, in pre-order: instances of a ``policy`` class or of
    a class ``policy`` names (a string), and those ``module`` names in its attribute ``shard_units``: the
    submodules a training step calls itself rather than through the root's forward (the Trainer's module under
    manual optimization: a GAN's generator and discriminator). Each of those must be a unit, so that calling it
    gathers its parameters and its backward reduce-scatters its gradients.

    An empty ``policy`` on a Hugging Face model means its ``_no_split_modules`` (its decoder layers; Accelerate's
    ``TRANSFORMER_BASED_WRAP``, ``trainscale.runtime.hf.no_split_modules``); on any other model, no unit but the
    root.

    Raises:
        ValueError: ``module`` has no parameters, or a policy class does not occur in it (the message
            lists the classes present).
    """
    if next(iter(module.parameters()), None) is None:
        raise ValueError(f"strategy={strategy!r} got a model with no parameters ({type(module).__name__}); "
                         "there is nothing to shard: check the model, or use strategy='ddp'")
    classes, names = _policy(module, policy)
    units = [m for m in module.modules() if m is not module and hf.class_matches(m, classes, names)]
    found = {type(m) for m in units}
    missing = [c.__name__ for c in classes if not any(issubclass(f, c) for f in found)]
    missing += sorted(names - {f.__name__ for f in found})
    if missing:
        present = sorted({type(m).__name__ for m in module.modules()})
        raise ValueError(f"auto_wrap_policy class(es) {', '.join(missing)} do not occur in the model; "
                         f"its module classes are: {', '.join(present)}")
    chosen = set(units) | set(getattr(module, "shard_units", ()))
    return [m for m in module.modules() if m in chosen]


def _policy(module: Any, policy: tuple) -> tuple[tuple, frozenset]:
    """``(classes, names)`` of a policy; of an empty one, the names of a Hugging Face model's ``_no_split_modules``."""
    if not policy:
        return (), frozenset(hf.no_split_modules(module))
    return tuple(c for c in policy if isinstance(c, type)), frozenset(c for c in policy if isinstance(c, str))


def apply_fsdp(module: Any, units: list, mesh: Any, *, precision: str, reshard_after_forward: Any = None,
               cpu_offload: bool = False) -> Any:
    """``fully_shard`` each of ``units`` (innermost first), then the root; return ``module`` (in place).
    Under a mixed precision, the batch-norm layers become units of their own first, kept in full precision
    (:func:`full_precision_norms`).

    The root is ``module.shard_root`` where ``module`` names one (the Trainer's loop module names the user's
    model, which then stays callable on its own after ``fit``, as under Lightning and torchtitan), else
    ``module``. A ``shard_root`` below ``module`` also runs each method ``module.forward_methods`` names (the
    Lightning steps, e.g. ``training_step``) as a forward (:func:`register_step_method`): FSDP's root
    hooks gather the root's own parameters around it and reduce-scatter their gradients in backward.

    Args:
        module: the module to shard; ``units``: from :func:`fsdp_units`.
        mesh: a 1-D ``DeviceMesh`` (FSDP) or 2-D ``(replicate, shard)`` one (HSDP).
        precision: the precision flag (:func:`mixed_precision_policy`).
        reshard_after_forward, cpu_offload: see ``FSDPStrategy``.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mixed_precision_policy(precision),
                  offload_policy=CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload
                  else OffloadPolicy())
    norms = full_precision_norms(module, precision)
    for norm in norms:  # leaves: before any unit that holds them
        fully_shard(norm, **{**kwargs, "mp_policy": _norm_policy(norm, precision)})
    root = getattr(module, "shard_root", module)
    for unit in reversed(units):  # modules() is pre-order: reversed, every child precedes its parent
        if unit not in norms and unit is not root:
            fully_shard(unit, **kwargs)
    fully_shard(root, **kwargs)
    for name in getattr(module, "forward_methods", ()) if root is not module else ():
        register_step_method(root, name)
    return module


def register_step_method(root: Any, name: str) -> None:
    """Run ``root.<name>`` (a step, e.g. ``training_step``) as a forward of the FSDP module ``root``, as FSDP2's
    ``register_fsdp_forward_method`` does: the root's pre-forward hook gathers its own parameters before the step
    (which may use them outside ``forward``: ``self.head(x)``), its post-forward hook registers the pre-backward
    hook on the step's output.

    A step that calls the root itself (``self(x)``, the Lightning pattern) would run the root's hooks twice, one
    pass nested in the other. The nested post-forward hook ends FSDP's forward pass (state back to idle), and the
    outer one then finds the pass over and reshards the root's parameters (``FSDPParamGroup.reshard`` outside a
    forward frees them whatever ``reshard_after_forward`` says), so that backward all-gathers them again: one
    extra all-gather of the root's parameters per micro-batch, and, in evaluation, one per batch. Here the outer
    post-forward hook runs only when the step did not call the root: a step that does is exactly one root
    forward, as a plain ``model(x)`` is (torch 2.13: ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``
    ``_pre_forward``/``_post_forward``, ``_fully_shard.py::register_fsdp_forward_method``).
    """
    state = root._get_fsdp_state()
    method = getattr(root, name)
    root_calls = 0

    def count_root_call(*_: Any) -> None:
        nonlocal root_calls
        root_calls += 1

    root.register_forward_pre_hook(count_root_call)

    @functools.wraps(method)
    def step(*args: Any, **kwargs: Any) -> Any:
        before = root_calls
        args, kwargs = state._pre_forward(root, args, kwargs)
        out = method(*args, **kwargs)
        return out if root_calls != before else state._post_forward(root, args, out)

    setattr(root, name, step)


def reshard(roots: list) -> None:
    """Register the sharded parameters again on every FSDP module under ``roots``. A root keeps its
    gathered parameters after a forward without backward (evaluation; FSDP2 does not reshard the root
    after forward), and state dicts and optimizers must see the sharded ones."""
    from torch.distributed.fsdp import FSDPModule

    for root in roots:
        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def no_gradient_sync(module: Any):
    """FSDP2's ``set_requires_gradient_sync(False)`` on the FSDP root in ``module`` (``module`` itself or its
    ``shard_root``, from :func:`apply_fsdp`) as a context: gradients accumulate unsharded on each rank, with no
    reduce-scatter, until it exits.

    Raises:
        TypeError: ``module`` holds no FSDP module (not the one ``Runtime.setup`` returned).
    """
    from torch.distributed.fsdp import FSDPModule

    root = next((m for m in module.modules() if isinstance(m, FSDPModule)), None)
    if root is None:
        raise TypeError("no_backward_sync needs the module returned by Runtime.setup (an FSDP module)")
    return _no_sync(root)


@contextlib.contextmanager
def _no_sync(module: Any):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


@contextlib.contextmanager
def gradient_sync_for(module: Any, params: Any, enabled: bool):
    """Within the block, only the FSDP modules under ``module`` that hold one of ``params`` reduce-scatter
    their gradients in backward, and none when not ``enabled`` (FSDP2's ``set_requires_gradient_sync``, set
    per module); on exit every one does again. The others keep accumulating unsharded gradients until a
    backward that syncs them: under manual optimization with two optimizers (a GAN), the generator's
    gradients held back over the micro-batches are then reduce-scattered in the generator's step only,
    once, rather than also in the discriminator's step that precedes it.
    """
    from torch.distributed.fsdp import FSDPModule

    own = {id(p) for p in params}
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_requires_gradient_sync(enabled and any(id(p) in own for p in unit.parameters()), recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)
