"""Precision: autocast, loss scaling and dtype casts, under Lightning's names.

- "32-true": fp32 everywhere.
- "16-mixed": autocast to float16 with a ``torch.amp.GradScaler`` (dynamic loss scaling,
  Micikevicius et al. 2018, "Mixed Precision Training"); the scaler's state is checkpointed. Where the
  ranks hold different parameters (pipeline stages), torch's ``ShardedGradScaler`` instead: its ``unscale_``
  all-reduces the inf/NaN flag over every rank, so all of them skip a step, or none.
- "bf16-mixed": autocast to bfloat16; no scaler is needed (bf16 has fp32's exponent range).
- "bf16-true": parameters and floating inputs cast to bfloat16, no autocast.
- "64-true": parameters and floating inputs cast to float64 (``module.double()``), and float64 the default dtype
  (``torch.set_default_dtype``) inside the forward context and :meth:`Precision.module_init_context`, so tensors the
  forward makes without a dtype are float64 too: Lightning's ``DoublePrecision``.

See https://pytorch.org/docs/stable/amp.html.
"""

from __future__ import annotations

import contextlib
from typing import Any, get_args

from trainscale.runtime.flags import PrecisionFlag

PRECISIONS = get_args(PrecisionFlag)  # "32-true", "16-mixed", "bf16-mixed", "bf16-true", "64-true"
# the dtype a "*-true" precision casts parameters and floating inputs to (by name: torch is imported late)
TRUE_DTYPES = {"bf16-true": "bfloat16", "64-true": "float64"}
_NO_AUTOCAST = contextlib.nullcontext()  # stateless and reentrant: one instance serves every step


def tf32_enabled() -> tuple[bool, bool]:
    """Whether float32 matmuls (cuBLAS) and cuDNN convolutions on CUDA may run on TF32 tensor cores, as
    ``(matmul, conv)``, read through torch's per-backend API where it has one (torch >= 2.9:
    ``torch.backends.cuda.matmul.fp32_precision`` and ``torch.backends.cudnn.conv.fp32_precision``, "ieee",
    "tf32", or "none" for the parent's setting). Once a user sets that API, the legacy getters
    (``torch.get_float32_matmul_precision()``, ``torch.backends.cuda.matmul.allow_tf32``,
    ``torch.backends.cudnn.allow_tf32``) raise "mix of the legacy and new APIs"; the per-backend values reflect
    the legacy setters too (``set_float32_matmul_precision("high")`` reads back as "tf32").
    https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices"""
    import torch

    matmul = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if matmul is None:  # torch < 2.9: only the legacy API exists
        return torch.get_float32_matmul_precision() != "highest", bool(torch.backends.cudnn.allow_tf32)
    return matmul not in ("ieee", "none"), torch.backends.cudnn.conv.fp32_precision not in ("ieee", "none")


def parameter_dtype(name: str) -> Any:
    """The ``torch.dtype`` a precision keeps floating parameters (and their gradients and optimizer states) in:
    bfloat16 for "bf16-true", float64 for "64-true", else float32 (mixed precisions keep fp32 weights)."""
    import torch

    return getattr(torch, TRUE_DTYPES.get(name, "float32"))


class DefaultDtype:
    """Context manager: ``torch.set_default_dtype(dtype)`` while entered, the previous default restored on exit, as
    Lightning's ``_DtypeContextManager``. The default dtype is global to the process (not per thread), so the
    replicas of ``strategy="dp"`` see it too. Not reentrant: one instance per ``with``."""

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype
        self._previous = None

    def __enter__(self) -> None:
        import torch

        self._previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc: Any) -> None:
        import torch

        torch.set_default_dtype(self._previous)


def float32_matmul_note(name: str, device_type: str, capability: tuple[int, int] | None,
                        tf32_matmul: bool) -> str | None:
    """What to tell a "32-true" run on a GPU with TF32 tensor cores (compute capability 8.0, Ampere, or
    newer) whose float32 matmuls run at full precision (``tf32_matmul`` False: PyTorch's default,
    :func:`tf32_enabled`), as Lightning does; None otherwise.
    https://pytorch.org/docs/stable/generated/torch.set_float32_matmul_precision.html"""
    if name != "32-true" or device_type != "cuda" or capability is None or capability < (8, 0) or tf32_matmul:
        return None
    return ("trainscale: float32 matmuls run at full precision on this GPU, which has TF32 tensor cores; "
            "float32_matmul_precision='high' (TF32) or 'medium' (bfloat16) trades precision for speed "
            "(torch.set_float32_matmul_precision)")


class Precision:
    """One precision setting for one device type ("cpu", "cuda", "mps").

    ``across_ranks``: under "16-mixed", whether the inf/NaN check of the gradients is agreed over all ranks
    of the default process group (``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``, one
    all-reduce of a flag per step): needed where ranks hold different parameters that no gradient reduction
    joins (pipeline stages), else one stage would step and another skip.
    """

    def __init__(self, name: str, device_type: str, across_ranks: bool = False) -> None:
        if name not in PRECISIONS:
            raise ValueError(f"unknown precision={name!r}; choose one of {', '.join(map(repr, PRECISIONS))}")
        import torch

        self.name = name
        self.device_type = device_type
        self.scaler = _grad_scaler(device_type, across_ranks) if name == "16-mixed" else None
        self._autocast_dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(name)
        self._true_dtype = getattr(torch, TRUE_DTYPES[name]) if name in TRUE_DTYPES else None
        self._default_dtype = torch.float64 if name == "64-true" else None  # of the forward and module init
        self.casts_input = self._true_dtype is not None  # whether convert_input changes a batch
        self._unscaled: set[int] = set()  # ids of optimizers unscaled since the last scaler.update()

    def convert_module(self, module):
        """Cast the module's floating parameters and buffers for "*-true" precisions (``module.to(dtype)``: under
        "64-true" what ``module.double()`` does); others leave it in fp32."""
        return module.to(self._true_dtype) if self._true_dtype is not None else module

    def convert_input(self, batch: Any) -> Any:
        """Cast floating tensors in ``batch`` to the true dtype ("bf16-true", "64-true"); integer ones stay."""
        if self._true_dtype is None:
            return batch
        from trainscale.runtime.batch import apply_to_tensors

        return apply_to_tensors(batch, lambda t: t.to(self._true_dtype) if t.is_floating_point() else t)

    def autocast(self):
        """Context manager for the forward pass (and the loss): autocast under the mixed precisions, float64 as the
        default dtype under "64-true" (:class:`DefaultDtype`), else nothing."""
        if self._default_dtype is not None:
            return DefaultDtype(self._default_dtype)
        if self._autocast_dtype is None:
            return _NO_AUTOCAST
        import torch

        return torch.autocast(self.device_type, dtype=self._autocast_dtype)

    def module_init_context(self):
        """Context manager to build a model in: float64 the default dtype under "64-true" (its parameters are
        made in float64, as under Lightning's ``trainer.init_module()``), else nothing."""
        return DefaultDtype(self._default_dtype) if self._default_dtype is not None else contextlib.nullcontext()

    def scale(self, loss):
        """``loss`` multiplied by the loss scale under "16-mixed", else ``loss`` itself."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def backward(self, loss, backward=None) -> None:
        """The backward of ``loss`` × the loss scale: ``backward(scaled)`` (a Lightning module's ``backward`` hook,
        as Lightning's precision plugins call it), by default ``scaled.backward()``."""
        scaled = self.scale(loss)
        if backward is None:
            scaled.backward()
        else:
            backward(scaled)

    def unscale_gradients(self, optimizer) -> None:
        """Divide gradients by the loss scale in place, so clipping sees true magnitudes.

        At most once per optimizer step: a second call before ``optimizer_step`` does nothing
        (``GradScaler.unscale_`` itself raises if called twice before ``update()``).
        """
        if self.scaler is not None and optimizer.param_groups and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def optimizer_step(self, optimizer, closure=None, **kwargs) -> Any:
        """Step the optimizer: ``optimizer.step(closure=closure, **kwargs)`` (without ``closure=`` when None), as
        Lightning's precision plugin calls it; under "16-mixed" the closure runs first (torch's GradScaler takes
        none; Lightning's ``MixedPrecision`` does the same) and the scaler skips steps with inf/NaN gradients.

        Returns:
            What the optimizer's step returned (the closure's result), without a host sync.

        Raises:
            ValueError: ``torch.optim.LBFGS`` under "16-mixed" (Lightning's words and condition): the GradScaler steps
                without a closure, and L-BFGS evaluates the loss again through it.
        """
        if self.scaler is None or not optimizer.param_groups:  # none: nothing to scale (GradScaler asserts on it)
            return optimizer.step(**kwargs) if closure is None else optimizer.step(closure=closure, **kwargs)
        import torch

        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("AMP and the LBFGS optimizer are not compatible: under precision='16-mixed' the "
                             "GradScaler steps the optimizer without the closure L-BFGS evaluates the loss with. Use "
                             "precision='bf16-mixed' or '32-true' with L-BFGS")
        with torch.enable_grad():  # as torch's optimizers run a closure
            result = closure() if closure is not None else None
        self.scaler.step(optimizer, **kwargs)  # unscales first unless unscale_gradients already did
        self.scaler.update()
        self._unscaled.clear()
        return result

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def _grad_scaler(device_type: str, across_ranks: bool) -> Any:
    """torch's GradScaler, or with ``across_ranks`` its ``ShardedGradScaler`` on the default process group
    (``process_group=None``: the group at the time of each all-reduce, so it may be made before the group)."""
    import torch

    if not across_ranks:
        return torch.amp.GradScaler(device_type)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device_type, process_group=None)


def check_loss_scaling(params: dict, device: Any, where: str) -> None:
    """Under "16-mixed", the parameters of each rank must be of one kind: all plain tensors, or all DTensors on
    one mesh. torch 2.13's GradScaler (and its ``ShardedGradScaler``) unscales the gradients of one device and
    dtype in one ``torch._amp_foreach_non_finite_check_and_unscale_`` call, which DTensor refuses for a mix ("got
    mixed torch.Tensor and DTensor"): e.g. a ``tp_plan`` that leaves a norm or an embedding out, or the built-in
    GPT plan without sequence parallelism (its norms stay plain). Agreed over all ranks (one all-reduce of a
    flag, at set-up), so that every rank raises, or none. ``params``: ``{name: parameter}`` of this rank;
    ``where``: the layout, for the message ("pipeline stages", "tensor parallelism").

    Raises:
        ValueError: some rank mixes them (the message names this rank's plain parameters, if any).
    """
    import torch
    import torch.distributed as dist

    kinds = {getattr(p, "device_mesh", None) for p in params.values()}
    mixed = torch.tensor(float(len(kinds) > 1), device=device)
    dist.all_reduce(mixed, op=dist.ReduceOp.MAX)
    if mixed.item():
        plain = [name for name, p in params.items() if not hasattr(p, "device_mesh")]
        raise ValueError(f"precision='16-mixed' under {where} needs each rank's parameters all split by tensor "
                         "parallelism (DTensors on one mesh) or all plain: torch's GradScaler unscales them in one "
                         f"call, which refuses a mix, and some rank mixes them (plain on this rank: {plain[:6]}); "
                         "put every parameter in tp_plan/parallelize (e.g. an embedding "
                         "RowwiseParallel(input_layouts=Replicate()), a norm SequenceParallel()), keep the built-in "
                         "GPT plan's sequence parallelism on, or pass precision='bf16-mixed' (no loss scaling)")
