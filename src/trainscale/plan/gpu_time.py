"""Seconds of a training step on a GPU you are not on, operator by operator, from the fake-tensor trace.

Each operator the traced step runs (:mod:`trainscale.plan.op_trace`) costs, on a catalogue GPU
(:mod:`trainscale.plan.hardware`), with the named constants of :mod:`trainscale.plan.efficiency`:

- a matmul or convolution: ``max(FLOPs / (peak[dtype] · gemm_fraction · quantization), bytes / bandwidth)``, the
  roofline (Williams et al. 2009) with the Tensor Core peak of its dtype (tf32 for fp32 matmuls when allowed, fp8
  under float8 training) and tile and wave quantization of its output (NVIDIA, 'Matrix Multiplication Background':
  a 128 × 128 tile grid, padded, in waves of one tile per SM), so small and odd shapes fall below the large-GEMM
  fraction;
- fused attention: ``FLOPs / (peak · attention_fraction[arch])`` (FlashAttention's FLOP count);
- every other operator: ``bytes / (HBM bandwidth · hbm_fraction)``; a normalization (batch or layer norm, forward
  and backward) reads its input twice, once for the statistics and once to normalize (Ioffe & Szegedy 2015,
  Algorithm 1: the mean and variance over the batch come before any output), a tensor too large for the cache;
- every kernel: plus ``kernel_gap``;
- a Tensor Core convolution on NCHW tensors (PyTorch's default layout): plus a transpose of its operands into NHWC
  and back, each read and written once more (NVIDIA, 'Convolutional Layers User's Guide': Tensor Core convolutions
  run in NHWC, and cuDNN transposes NCHW tensors around them); none with ``channels_last``.

Float8 training (torchao's dynamic tensorwise scaling, as torchtitan's float8 converter applies it to ``nn.Linear``)
runs the linear layers' matmuls at the fp8 peak (with the fp8 GEMM constant) and adds, before a matmul, the scaling
kernels of each operand not cast before in the step: reading the bf16 operand twice (its absolute maximum, then the
cast) and writing its fp8 copy, 2.5 × its bf16 bytes, or 1.5 × under torch.compile when a kernel of the step produced
it (Inductor computes the maximum in that kernel); these are kernels of their own, added to the matmul's time, not
hidden under it (:func:`cast_bytes`). ``compile=True`` costs Inductor's fused kernels instead of the eager operators
(:func:`trainscale.plan.op_trace.fused`).

Activation checkpointing recomputes in backward: "full" the whole forward; "selective" (torchtitan's per-op policy,
``_save_list`` in its ``parallelize_llama.py``: ``aten.mm`` outputs saved except every other one, attention saved)
the memory-bound forward operators and half the forward matmuls (under float8 too: torchao's linear calls
``torch.mm`` on its float8 tensor subclass, which the policy sees as ``aten.mm``). The optimizer step is traced too (its second step, with the state present):
memory-bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from trainscale.plan import efficiency as eff
from trainscale.plan.hardware import GPU
from trainscale.plan.op_trace import Op, fused

SCENARIOS = ("fast", "mid", "slow")


@dataclass(frozen=True)
class Phases:
    """Seconds of one traced step's phases on one GPU in one scenario, and its kernel count."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    kernels: int

    def scaled(self, k: float) -> "Phases":
        return Phases(self.forward_s * k, self.backward_s * k, self.optimizer_s * k, round(self.kernels * k))

    def __add__(self, other: "Phases") -> "Phases":
        return Phases(self.forward_s + other.forward_s, self.backward_s + other.backward_s,
                      self.optimizer_s + other.optimizer_s, self.kernels + other.kernels)


def quantization(gemm: tuple, gpu: GPU) -> float:
    """Share of a GEMM's issued tile work that is useful: the output ``(M, N, batch)`` padded to whole 128 × 128
    tiles, the tiles run in whole waves of one per SM (NVIDIA, 'Matrix Multiplication Background': tile and wave
    quantization). 1 for shapes that fill both."""
    m, n, b = gemm
    tm, tn = eff.TILE
    tiles = math.ceil(m / tm) * math.ceil(n / tn) * b
    if tiles == 0:
        return 1.0
    waves = math.ceil(tiles / gpu.sms)
    return (m * n * b) / (tiles * tm * tn) * tiles / (waves * gpu.sms)


def _peak(gpu: GPU, dtype: str, scenario: str) -> float:
    low, high = gpu.peak(dtype)
    return high if scenario == "fast" else low if scenario == "slow" else (low * high) ** 0.5


def op_seconds(op: Op, gpu: GPU, scenario: str, tf32: bool = True, float8: bool = False,
               channels_last: bool = False, cast_bytes: float | None = None) -> float:
    """Seconds of one operator (see the module's docstring). ``tf32``: fp32 matmuls on TF32 Tensor Cores (what
    NVIDIA's examples and ``torch.backends.cuda.matmul.allow_tf32`` give); ``float8``: matmuls in fp8;
    ``channels_last``: convolutions get NHWC tensors (else each Tensor Core convolution transposes its operands);
    ``cast_bytes``: under ``float8``, the bytes the scaling kernels before it move (None: 2.5 × its operands' bytes,
    see :func:`cast_bytes`)."""
    memory_s = (op.nbytes + op.second_pass) / (gpu.hbm_bandwidth * eff.HBM.at(scenario))
    gap = eff.LAUNCH.at(scenario)
    if op.kind == "memory":
        return memory_s + gap
    dtype = "tf32" if op.dtype == "fp32" and tf32 and "tf32" in gpu.flops else op.dtype
    if op.kind == "attention":
        return max(op.flops / (_peak(gpu, dtype, scenario) * eff.attention(gpu.arch).at(scenario)), memory_s) + gap
    casts = 0.0
    if float8:
        dtype = "fp8"
        moved = EAGER_CAST * sum(b for _, b in op.reads) if cast_bytes is None else cast_bytes
        casts = moved / (gpu.hbm_bandwidth * eff.HBM.at(scenario)) + gap * (moved > 0)
    fraction = eff.gemm(gpu.arch, dtype).at(scenario) * quantization(op.gemm, gpu)
    transposes = 0.0
    if "convolution" in op.name and not channels_last and dtype != "fp32":
        transposes = 2 * op.nbytes / (gpu.hbm_bandwidth * eff.HBM.at(scenario)) + 2 * gap
    return max(op.flops / (_peak(gpu, dtype, scenario) * fraction), memory_s) + gap + transposes + casts


EAGER_CAST = 2.5  # per bf16 byte of an operand: read for its absolute maximum, read again to cast, fp8 written
FUSED_CAST = 1.5  # the maximum taken in the kernel that produced the operand (Inductor): read once, fp8 written


def cast_bytes(op: Op, cast: set, produced: set, compile: bool, weights_fp8: bool = False) -> float:
    """Bytes torchao's dynamic (tensorwise) float8 scaling moves before the matmul ``op``: each operand not cast
    before in the step (``cast``: storage keys already cast, updated; a cast made in forward is saved for backward,
    and torch.compile's common-subexpression elimination casts an input shared by several matmuls once) costs
    :data:`EAGER_CAST` × its bf16 bytes, or under ``compile`` :data:`FUSED_CAST` when another kernel of the step
    produced it (``produced``: keys written so far); a weight (an operand nothing produced) gathered in fp8 by FSDP
    (``weights_fp8``) costs nothing."""
    total = 0.0
    for key, nbytes in op.reads:
        if key in cast:
            continue
        cast.add(key)
        if key not in produced:
            total += 0.0 if weights_fp8 else EAGER_CAST * nbytes
        else:
            total += (FUSED_CAST if compile else EAGER_CAST) * nbytes
    return total


def phases(ops: list[Op], gpu: GPU, scenario: str, *, tf32: bool = True, float8: bool = False,
           compile: bool = False, recompute: str | None = None, channels_last: bool = False,
           weights_fp8: bool = False) -> Phases:
    """Seconds of ``ops`` by phase ("forward", "backward", "optimizer"); ``recompute`` None, "full" or
    "selective" adds the recomputed forward to backward (see the module's docstring).

    Raises:
        ValueError: an unknown ``recompute``."""
    if recompute not in (None, "full", "selective"):
        raise ValueError(f"recompute={recompute!r}: None, 'full' or 'selective'")
    kernels = fused(ops) if compile else ops
    seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    recomputed, matmuls = 0.0, 0
    cast, produced = set(), set()
    for op in kernels:
        in_fp8 = float8 and op.kind == "matmul" and op.phase != "optimizer"
        moved = cast_bytes(op, cast, produced, compile, weights_fp8) if in_fp8 else None
        t = op_seconds(op, gpu, scenario, tf32, in_fp8, channels_last, moved)
        produced.update(key for key, _ in op.writes)
        seconds[op.phase] = seconds.get(op.phase, 0.0) + t
        if op.phase == "forward" and recompute:
            matmuls += op.kind == "matmul"
            if recompute == "full" or op.kind == "memory" or (op.kind == "matmul" and matmuls % 2 == 0):
                recomputed += t
    count = sum(op.phase in seconds for op in kernels)
    return Phases(seconds["forward"], seconds["backward"] + recomputed, seconds["optimizer"], count)


def trace_step(meta_model, sample: tuple, batch_size: int, loss_fn: Callable, optimizer_fn: Callable | None,
               precision: str) -> list[Op]:
    """The operators of one training step of ``meta_model`` at ``batch_size`` samples like ``sample``, on fake
    tensors (nothing allocated): forward under the precision's autocast, backward, and the optimizer's second step
    (the first creates its state) when ``optimizer_fn`` is given."""
    from trainscale.plan import memory
    from trainscale.plan.op_trace import OpLog
    from trainscale.runtime.precision import Precision

    prec = Precision(precision, "cpu")
    with memory._fake_mode():
        model = memory._fake_copy(meta_model, precision)
        x, y = prec.convert_input(memory._fake_batch(sample, batch_size))
        optimizer = optimizer_fn(model.parameters()) if optimizer_fn else None
        with OpLog() as log:
            with prec.autocast():
                loss = loss_fn(model(x), y)
            log.phase = "backward"
            loss.backward()
            if optimizer is not None:
                log.phase = "optimizer-first"
                optimizer.step()
                log.phase = "optimizer"
                optimizer.step()
    return [op for op in log.ops if op.phase != "optimizer-first"]


def interval(ops: list[Op], gpu: GPU, **options) -> dict[str, Phases]:
    """:func:`phases` in each scenario: ``{"fast", "mid", "slow"}``."""
    return {s: phases(ops, gpu, s, **options) for s in SCENARIOS}
