"""The operators of a training step, recorded on fake tensors: what each one computes and moves.

:class:`OpLog`, a ``TorchDispatchMode``, sees every ATen operator a traced step runs (the fake-tensor trace of
:mod:`trainscale.plan.memory`: shapes and dtypes, no storage) and keeps, per operator, its kind ("matmul",
"attention" or "memory"), its FLOPs, the bytes it reads and writes, the GEMM shape that decides its efficiency on
a GPU, and which storages it reads and writes (for :func:`fused`, torch.compile's fusion). Views and aliases
(``view``, ``t``, ``expand``, ``detach``, …) move nothing and are not kept.

FLOPs: ``torch.utils.flop_counter``'s formulas (matmuls, convolutions and their backward); attention counted as
FlashAttention counts it (Dao 2023, §3: forward 4·B·H·Tq·Tk·d, backward 2.5 × forward, since its backward
recomputes the scores), halved for a causal mask (the kernel skips the masked blocks). Bytes: each tensor
argument's bytes read (a broadcast input's storage once), each output's bytes written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward", "_convolution", "linear"}
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "detach", "alias",
         "lift_fresh", "_local_scalar_dense", "set_", "resize_", "_to_copy_meta", "sym_size", "sym_stride", "is_same_size"}
_TWO_PASS = {"native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
             "native_batch_norm_backward", "cudnn_batch_norm", "cudnn_batch_norm_backward", "native_layer_norm",
             "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward"}
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


@dataclass(frozen=True)
class Op:
    """One recorded operator. ``kind``: "matmul", "attention" or "memory"; ``flops``: its FLOPs (0 for memory
    ops); ``nbytes``: bytes read plus written; ``dtype``: the inputs' floating dtype ("fp32", "bf16", …);
    ``gemm``: ``(M, N, batch)`` of a matmul's output tiles (None otherwise); ``phase``: the label the log had when it
    ran ("forward", "backward", "optimizer"); ``reads``/``writes``: ``{storage key: bytes}``; ``second_pass``: bytes a normalization reads a second time."""

    name: str
    kind: str
    flops: float
    nbytes: float
    dtype: str
    gemm: tuple | None
    phase: str
    reads: tuple = ()
    writes: tuple = ()
    second_pass: float = 0.0  # bytes read again: a normalization's input (statistics, then the normalization)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches of ``t``: its elements, or its storage when smaller (a broadcast view)."""
    dense = t.numel() * t.element_size()
    try:
        return min(dense, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return dense


def _arguments(func, args, kwargs) -> dict:
    out = {}
    for i, a in enumerate(func._schema.arguments):
        out[a.name] = args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
    return out


def attention_flops(func, args, kwargs) -> float:
    """FLOPs of a fused attention kernel, FlashAttention's count (see the module's docstring)."""
    named = _arguments(func, args, kwargs)
    q, k = named["query"], named["key"]
    b, h, tq, d = q.shape
    flops = 4.0 * b * h * tq * k.shape[-2] * d
    if "backward" in func.__name__:
        flops *= 2.5
    return flops / 2 if named.get("is_causal") else flops


def _gemm_shape(name: str, out, args) -> tuple:
    """``(M, N, batch)`` of the output tiles: mm/addmm (M, N), bmm (M, N, B), a convolution as an implicit GEMM
    (M = batch × output pixels, N = output channels)."""
    first = out[0] if isinstance(out, (tuple, list)) else out
    if name.startswith("convolution") or name == "_convolution":
        grad_or_out = args[0] if name == "convolution_backward" else first
        channels = grad_or_out.shape[1]
        return grad_or_out.numel() // max(1, channels), channels, 1
    if first.dim() == 3:
        return first.shape[1], first.shape[2], first.shape[0]
    return first.shape[-2] if first.dim() > 1 else 1, first.shape[-1], 1


class OpLog(TorchDispatchMode):
    """``with OpLog() as log: ...`` records ``log.ops``; set ``log.phase`` between the parts of a step. The
    log keeps every tensor it saw alive, so that storage keys stay unique for its lifetime (fake tensors: no memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.phase = "forward"
        self._alive: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if not _moves_nothing(func, name):
            inputs, outputs = _tensors((args, kwargs)), _tensors(out)
            if name.endswith("_") and not outputs:  # in-place foreach ops return nothing: they write their first argument
                outputs = _tensors(args[0])
            self._alive.extend(inputs + outputs)
            self.ops.append(_record(func, name, args, kwargs, out, inputs, outputs, self.phase))
        return out


def _tensors(tree) -> list:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _record(func, name: str, args, kwargs, out, inputs: list, outputs: list, phase: str) -> Op:
    floating = next((t.dtype for t in inputs if t.is_floating_point()), torch.float32)
    kind, flops, gemm = _compute(func, name, args, kwargs, out)
    reads = tuple({_key(t): _bytes(t) for t in inputs}.items())
    writes = tuple({_key(t): _bytes(t) for t in outputs}.items())
    nbytes = sum(b for _, b in reads) + sum(b for _, b in writes)
    again = max((b for _, b in reads), default=0) if name in _TWO_PASS else 0
    return Op(name, kind, flops, float(nbytes), _DTYPES.get(floating, "fp32"), gemm, phase, reads, writes, float(again))


def _moves_nothing(func, name: str) -> bool:
    """Views, aliases, allocations without a write, and ops that are neither ATen's nor its primitives' (the prims a
    decomposed graph runs, such as ``prims.convert_element_type``): no kernel that moves data."""
    returns = func._schema.returns
    aliases = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    return func.namespace not in ("aten", "prims") or name in _FREE or func.is_view or aliases


def _compute(func, name: str, args, kwargs, out) -> tuple:
    """``(kind, FLOPs, GEMM shape)`` of an operator."""
    if any(a in name for a in _ATTENTION):
        return "attention", attention_flops(func, args, kwargs), None
    if name in _MATMUL:
        from torch.utils.flop_counter import flop_registry

        counter = flop_registry.get(func._overloadpacket)
        flops = float(counter(*args, **kwargs, out_val=out)) if counter else 0.0
        return "matmul", flops, _gemm_shape(name, out, args)
    return "memory", 0.0, None


def fused(ops: list[Op]) -> list[Op]:
    """The kernels torch.compile (Inductor) runs for ``ops``: each run of consecutive memory-bound operators between
    two extern kernels (matmuls and attention stay library calls) becomes one kernel that reads what the run takes
    from outside it and writes what is read after it (or never read again: results such as gradients). Ansel et
    al. 2024, "PyTorch 2", §4.3: Inductor fuses pointwise and reduction operators into generated kernels and calls
    extern libraries for matrix multiplication and convolution."""
    later_reads: dict[int, int] = {}  # storage key -> index of its last read
    for i, op in enumerate(ops):
        for key, _ in op.reads:
            later_reads[key] = i
    out: list[Op] = []
    run: list[tuple[int, Op]] = []

    def close() -> None:
        if not run:
            return
        written: dict = {}
        read: dict = {}
        for _, op in run:
            for key, b in op.reads:
                if key not in written:
                    read[key] = max(read.get(key, 0), b)
            for key, b in op.writes:
                written[key] = max(written.get(key, 0), b)
        end = run[-1][0]
        kept = {k: b for k, b in written.items() if later_reads.get(k, -1) > end or later_reads.get(k, -1) < run[0][0]}
        first = run[0][1]
        again = max((op.second_pass for _, op in run), default=0.0)  # a fused normalization still passes twice
        out.append(Op("fused", "memory", 0.0, float(sum(read.values()) + sum(kept.values())), first.dtype, None,
                      first.phase, tuple(read.items()), tuple(kept.items()), again))
        run.clear()

    for i, op in enumerate(ops):
        if op.kind == "memory" and (not run or run[-1][1].phase == op.phase):
            run.append((i, op))
            continue
        close()
        if op.kind == "memory":
            run.append((i, op))
        else:
            out.append(op)
    close()
    return out


def lifetimes(ops: list[Op]) -> dict[int, tuple[int, int, float]]:
    """``{storage key: (first write, last use, bytes)}`` (operator indices) of each storage an operator of ``ops``
    writes: it lives from its first write to its last read (to its write when never read), which is when a tensor is
    freed at its last use; storages nothing here writes (parameters, the inputs) are left out."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    size: dict[int, float] = {}
    for i, op in enumerate(ops):
        for key, _ in op.reads:
            if key in first:
                last[key] = i
        for key, nbytes in op.writes:
            first.setdefault(key, i)
            last[key] = max(last.get(key, i), i)
            size[key] = max(size.get(key, 0.0), float(nbytes))
    return {key: (first[key], last[key], size[key]) for key in first}


def allocation_events(ops: list[Op], tag=None, held=frozenset(), skip=frozenset()) -> list[tuple]:
    """``ops``' storages as allocator events in program order (:func:`trainscale.plan.allocator.replay`): each one's
    ``("malloc", (tag, key), bytes)`` before the operator that first writes it, ``("free", (tag, key))`` after its
    last use (:func:`lifetimes`). Storages in ``held`` are not freed here (the caller frees them later); storages in
    ``skip`` are neither allocated nor freed (they exist already)."""
    spans = lifetimes(ops)
    starts: dict[int, list] = {}
    ends: dict[int, list] = {}
    for key, (first, last, nbytes) in spans.items():
        if key in skip:
            continue
        starts.setdefault(first, []).append(("malloc", (tag, key), int(nbytes)))
        if key not in held:
            ends.setdefault(last, []).append(("free", (tag, key)))
    events: list[tuple] = []
    for i in range(len(ops)):
        events += starts.get(i, []) + ends.get(i, [])
    return events


def live_peak(ops: list[Op]) -> float:
    """The most bytes alive at once over ``ops`` (bytes), each storage alive over its :func:`lifetimes`, which is what
    the caching allocator holds when every tensor is freed at its last use."""
    change = [0.0] * (len(ops) + 1)
    for first, last, nbytes in lifetimes(ops).values():
        change[first] += nbytes
        change[last + 1] -= nbytes
    peak = alive = 0.0
    for c in change:
        alive += c
        peak = max(peak, alive)
    return peak


def saved_bytes(ops: list[Op], recompute: str | None) -> float:
    """Bytes a traced forward keeps for its backward (bytes), besides the region's input: the sum of
    :func:`saved_storages`.

    Raises:
        ValueError: an unknown ``recompute``."""
    return float(sum(saved_storages(ops, recompute).values()))


def saved_storages(ops: list[Op], recompute: str | None) -> dict[int, float]:
    """``{storage key: bytes}`` a traced forward keeps for its backward, besides the region's input: with ``recompute``
    None every storage forward writes and backward reads; "full" none; "selective" what torchtitan's per-op policy
    saves (its ``_save_list``): the outputs of ``aten.mm`` except every other one (torchao's float8 linear calls
    ``torch.mm`` on its float8 tensor subclass: the same) and of fused attention.

    Raises:
        ValueError: an unknown ``recompute``."""
    if recompute not in (None, "full", "selective"):
        raise ValueError(f"recompute={recompute!r}: None, 'full' or 'selective'")
    if recompute == "full":
        return {}
    forward = [op for op in ops if op.phase == "forward"]
    if recompute is None:
        read_later = {key for op in ops if op.phase == "backward" for key, _ in op.reads}
        return {key: float(b) for op in forward for key, b in op.writes if key in read_later}
    return _policy_saved(forward)


def _policy_saved(forward: list[Op]) -> dict[int, float]:
    saved, matmuls = {}, 0
    for op in forward:
        matmuls += op.name == "mm"
        if op.kind == "attention" or (op.name == "mm" and matmuls % 2 == 1):
            saved.update((key, float(b)) for key, b in op.writes)
    return saved
