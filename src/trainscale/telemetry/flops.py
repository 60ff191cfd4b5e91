"""FLOPs per sample (counted once), peak FLOP/s of common GPUs, and MFU.

FLOPs are counted, not estimated: one training micro-batch (forward, loss and backward) runs
under ``torch.utils.flop_counter.FlopCounterMode``, which adds the FLOPs of every matmul,
convolution and attention op PyTorch dispatches (a multiply-add counts as 2 FLOPs), and the
total is divided by the micro-batch's samples. Elementwise ops are not counted, as in the
usual analytic formulas. https://pytorch.org/docs/stable/torch.utils.flop_counter.html (source:
torch/utils/flop_counter.py)

Model FLOPs utilization (PaLM, Chowdhery et al. 2022, Appendix B; nanoGPT ``estimate_mfu``)::

    MFU = achieved FLOP/s per device / peak FLOP/s per device
        = flops_per_sample × samples/s per device / peak

Because the FLOPs are counted on the real step, recomputation by activation checkpointing is
counted too (strictly, that is hardware FLOPs utilization).

When to count (:func:`resolve_count_flops`): by default on CUDA devices only. The counted micro-batch
runs every op through a Python ``TorchDispatchMode``, a path of PyTorch's dispatcher that a plain
loop never takes: measured here, that first use brings ~1.5 MiB of libtorch's code pages into the
process (resident, shared with every process using the same PyTorch). On a GPU that is nothing next
to the CUDA context and MFU needs the count; on a CPU there is no peak FLOP/s to give an MFU, and
the 1.5 MiB is ~0.5 % of a small training process (docs/performance.md), so it is counted on request
(``count_flops=True``). Never under ``torch.compile``: a forward under a dispatch mode makes dynamo
skip the model's frame for good, so counting would silently turn compilation off (torch 2.13).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Callable, Iterator

# Dense (no sparsity) peak FLOP/s per GPU by compute dtype: "bf16"/"fp16"/"tf32" on tensor cores, "fp32"
# the plain (non-tensor) FP32 rate. NVIDIA quotes tensor-core figures "with sparsity" (2:4 structured);
# those are halved here. Sources (NVIDIA data sheets and product pages; the figures as these documents publish
# them, written down without web access on 2026-11-23, so not re-checked against the live pages):
#   V100:  https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
#          (SXM2: 125 TFLOPS tensor, 15.7 FP32; PCIe: 112, 14)
#   T4:    https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf
#   A10:   https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf
#          (BF16 250*, TF32 125*, FP32 31.2; * with sparsity)
#   A100:  https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
#          (BF16 312, TF32 156, FP32 19.5; SXM and PCIe alike)
#   A800:  https://www.nvidia.cn/data-center/a800/ (the A100's compute with less NVLink bandwidth)
#   L4:    https://www.nvidia.com/en-us/data-center/l4/ (BF16 242*, TF32 120*, FP32 30.3)
#   L40S:  https://www.nvidia.com/en-us/data-center/l40s/ (BF16 733*, TF32 366*, FP32 91.6)
#   H100:  https://www.nvidia.com/en-us/data-center/h100/ (SXM: BF16 1,979*, TF32 989*, FP32 67;
#          PCIe: 1,513*, 756*, 51; NVL: 1,671*, 835*, 60)
#   H800:  https://www.nvidia.cn/data-center/h800/ (the H100's compute with less NVLink bandwidth)
#   H200:  https://www.nvidia.com/en-us/data-center/h200/ (SXM: BF16 1,979*, TF32 989*, FP32 67;
#          NVL: 1,671*, 835*, 60)
#   GH200: https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/ (its Hopper GPU: as H100 SXM)
#   B200:  https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 per GPU: BF16 4.5 PF*, TF32 2.2 PF*, FP32 75 TF)
_H100_SXM = {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12}
_H100_PCIE = {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}
_HOPPER_NVL = {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12}
_A100 = {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}
# Keys: the product token of torch.cuda.get_device_name() (see product_key), with its form factor.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "V100 SXM": {"fp16": 125e12, "fp32": 15.7e12},
    "V100 PCIe": {"fp16": 112e12, "fp32": 14e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "A100": _A100,
    "A800": _A100,
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "L40S": {"bf16": 366e12, "fp16": 366e12, "tf32": 183e12, "fp32": 91.6e12},
    "H100 SXM": _H100_SXM, "H100 PCIe": _H100_PCIE, "H100 NVL": _HOPPER_NVL,
    "H800 SXM": _H100_SXM, "H800 PCIe": _H100_PCIE,
    "H200 SXM": _H100_SXM, "H200 NVL": _HOPPER_NVL,
    "GH200": _H100_SXM,
    "B200": {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 75e12},
}

# "64-true": no device here lists an fp64 rate, so its peak (and MFU) is unknown rather than fp32's
_PRECISION_DTYPE = {"32-true": "fp32", "16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16", "64-true": "fp64"}
_VENDOR = {"NVIDIA", "TESLA"}


def product_key(device_name: str) -> str:
    """The product of a CUDA device name, matched exactly, token by token (never as a substring):
    ``"NVIDIA A100-SXM4-80GB"`` → ``"A100 SXM"``, ``"NVIDIA H100 PCIe"`` → ``"H100 PCIe"``,
    ``"NVIDIA L40S"`` → ``"L40S SXM"`` (looked up as ``"L40S"``), ``"NVIDIA RTX A1000"`` → ``"RTX SXM"`` (unknown).
    The form factor is "PCIe" or "NVL" when a token says so, else "SXM"."""
    tokens = [t for t in device_name.replace("-", " ").replace("_", " ").split() if t.upper() not in _VENDOR]
    if not tokens:
        return ""
    upper = {t.upper() for t in tokens[1:]}
    form = "PCIe" if any(t.startswith("PCIE") for t in upper) else "NVL" if "NVL" in upper else "SXM"
    return f"{tokens[0].upper()} {form}"


def _peaks(device_name: str | None) -> dict[str, float] | None:
    if not device_name:
        return None
    key = product_key(device_name)
    return PEAK_FLOPS.get(key) or PEAK_FLOPS.get(key.split(" ")[0])


def peak_flops_per_s(device_name: str | None, precision: str, *, tf32_matmul: bool = False,
                     tf32_conv: bool = False, conv_share: float = 0.0) -> float | None:
    """Peak dense FLOP/s of one device for a precision ("32-true", "bf16-mixed", ...).

    Under "32-true" float32 matmuls and convolutions run on TF32 tensor cores when enabled
    (``trainscale.runtime.precision.tf32_enabled``: matmuls off by default, cuDNN convolutions on), else at
    the FP32 rate. The peak of the step is then the rate at which its FLOPs could run
    at best: ``1 / (conv_share / conv_peak + (1 - conv_share) / matmul_peak)``.

    Args:
        device_name: ``torch.cuda.get_device_name()``, or None.
        precision: the precision flag.
        tf32_matmul, tf32_conv: whether TF32 is enabled for float32 matmuls / cuDNN convolutions.
        conv_share: the fraction (0..1) of the step's FLOPs in convolutions.

    Returns:
        FLOP/s, or None for a device not in :data:`PEAK_FLOPS` (CPUs, unknown GPUs) or a dtype the
        device lacks (bf16 on V100/T4; fp64, "64-true", on all of them: the table holds no float64 rates).
    """
    peaks = _peaks(device_name)
    if peaks is None:
        return None
    dtype = _PRECISION_DTYPE.get(precision, "fp32")
    if dtype != "fp32":
        return peaks.get(dtype)
    # devices before Ampere have no TF32: their float32 ops run at the FP32 rate whatever the flags say
    conv, matmul = (peaks.get("tf32", peaks["fp32"]) if tf32 else peaks["fp32"] for tf32 in (tf32_conv, tf32_matmul))
    if conv == matmul or conv_share <= 0:
        return matmul
    return 1.0 / (conv_share / conv + (1.0 - conv_share) / matmul)


def mfu(achieved_flops_per_s: float | None, peak_per_device: float | None, devices: int) -> float | None:
    """Model FLOPs utilization: total achieved FLOP/s over ``devices`` × peak (None if either is unknown).
    A value over 1 cannot be: it means a wrong peak or a wrong FLOP count (:data:`MFU_ERROR`)."""
    if achieved_flops_per_s is None or not peak_per_device:
        return None
    return achieved_flops_per_s / (peak_per_device * devices)


MFU_ERROR = ("MFU > 1 is a measurement error: the peak FLOP/s is too low for what ran (e.g. TF32 or sparse "
             "tensor cores, a device missing from the table) or the FLOP count is too high; pass the device's "
             "peak as peak_flops= (FLOP/s per device)")


def resolve_count_flops(count_flops: bool | None, device_type: str, compiled: bool) -> bool:
    """Whether to count FLOPs: ``None`` means on CUDA devices, without ``torch.compile``.

    Args:
        count_flops: True, False or None (automatic, see the module docstring).
        device_type: "cuda", "cpu", "mps", ...
        compiled: the model runs under ``torch.compile``.

    Raises:
        ValueError: ``count_flops=True`` with ``compiled`` (counting would turn compilation off), or a
            value that is not a bool or None.
    """
    if count_flops is not None and not isinstance(count_flops, bool):
        raise ValueError(f"count_flops={count_flops!r}; choose True, False or None (count on CUDA devices only)")
    if count_flops and compiled:
        raise ValueError("count_flops=True cannot be combined with compile: a forward under FlopCounterMode makes "
                         "torch.compile skip the model for good; pass count_flops=None (or False) to compile")
    return (device_type == "cuda" and not compiled) if count_flops is None else count_flops


class FlopCountError(RuntimeError):
    """The micro-batch counted under ``FlopCounterMode`` raised. Raised from the original error (its
    ``__cause__``): run the micro-batch again without counting; a model that fails only while counted
    (e.g. one with a compiled region such as eager ``flex_attention``) then trains. ``count_flops=False``
    avoids the count altogether."""


def analytic_flops_per_sample(parameters: int | None, tokens_per_sample: float | None) -> float | None:
    """``6 · N`` FLOPs per token times tokens per sample: forward (2N) and backward (4N) of the dense
    layers of a model with N parameters, attention left out (Kaplan et al. 2020, "Scaling Laws for Neural
    Language Models", section 2.1; nanoGPT ``estimate_mfu`` adds attention). None without tokens: for
    other models (convolutions reuse weights across positions) the parameter count gives no estimate."""
    if not parameters or not tokens_per_sample:
        return None
    return 6.0 * parameters * tokens_per_sample


ANALYTIC = "analytic (6N per token)"
DECLARED = "declared (the model's flops_per_token)"


def declared_flops_per_token(module) -> Callable[[int], float] | None:
    """``tokens_per_sample -> FLOPs per token`` from the ``flops_per_token`` method of the outermost submodule of
    ``module`` that has one (``trainscale.models.GPT``'s, found inside DDP's and the loop's wrappers), or None.

    The method is the model's own training FLOPs per token (forward and backward), as torchtitan's models give
    theirs (``components/metrics.py``). Called with the sequence length when it takes an argument
    (``GPT.flops_per_token(context_length)``: the attention term grows with it), else with none."""
    for sub in module.modules():
        method = getattr(sub, "flops_per_token", None)
        if callable(method):
            break
    else:
        return None
    try:
        takes_length = bool(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        takes_length = False
    return (lambda length: float(method(length))) if takes_length else (lambda length: float(method()))


class FlopsPerSample:
    """Count the FLOPs of one training micro-batch, once; counting never changes what the step computes.

        counter = FlopsPerSample()
        with counter.measure(samples=len(x)):   # the first call counts; later calls cost nothing
            loss_fn(model(x), y).backward()
        counter.value                           # FLOPs per sample, or None
        counter.method                          # "counted", "analytic (6N per token)" or None

    When counting fails (a FLOP formula or an operator the counter cannot handle, see
    ``trainscale.telemetry.counting``), the step still runs, one ``RuntimeWarning`` says why (only with
    ``warn=True``: the Telemetry passes it on rank zero), and ``value`` falls back to
    :func:`analytic_flops_per_sample` with ``parameters`` (set it before measuring) and the tokens of the
    micro-batch, else None. An error of the counted step itself becomes :class:`FlopCountError`.

    Args:
        warn: issue the fallback warning.
    """

    def __init__(self, warn: bool = True) -> None:
        self.value: float | None = None
        self.method: str | None = None
        self.done = False
        self.warn = warn
        self.parameters: int | None = None  # the model's parameter count, for the analytic fallback
        self.conv_share = 0.0  # the fraction of the counted FLOPs in convolutions (their TF32 setting differs)

    @contextlib.contextmanager
    def measure(self, samples: int, tokens: int | None = None) -> Iterator[None]:
        """Count the FLOPs of the block (first call only) and set ``value`` to FLOPs per sample.

        Args:
            samples: samples in the micro-batch (its leading dimension).
            tokens: tokens in the micro-batch, or None.

        Raises:
            FlopCountError: the block raised while counted (from the block's error).
        """
        if self.done:
            yield
            return
        self.done = True
        try:
            from trainscale.telemetry.counting import TolerantFlopCounter

            counter = TolerantFlopCounter()
            counter.__enter__()
        except Exception as exc:  # noqa: BLE001 - no count rather than no training
            self._fall_back(f"FlopCounterMode could not start ({type(exc).__name__}: {exc})", samples, tokens)
            yield
            return
        try:
            yield
        except Exception as exc:
            counter.__exit__(None, None, None)
            self._fall_back(f"the micro-batch raised while counted ({type(exc).__name__}: {exc})", samples, tokens)
            raise FlopCountError(f"the first micro-batch raised while its FLOPs were counted with FlopCounterMode: "
                                 f"{type(exc).__name__}: {exc}. Run it again without counting, or pass "
                                 "count_flops=False") from exc
        counter.__exit__(None, None, None)
        if counter.failures:
            self._fall_back(f"{len(counter.failures)} op(s) could not be counted, e.g. {counter.failures[0]}",
                            samples, tokens)
            return
        total = counter.get_total_flops()
        if total > 0 and samples > 0:
            self.value, self.method = total / samples, "counted"
            by_op = counter.get_flop_counts().get("Global", {})
            self.conv_share = sum(n for op, n in by_op.items() if "convolution" in str(op)) / total

    def _fall_back(self, why: str, samples: int, tokens: int | None) -> None:
        """Analytic estimate or None, one warning, and compiled code forgotten: higher-order operators
        (``while_loop``, ``flex_attention``) compile themselves on first use, and what was traced or
        skipped under the counter's dispatch mode fails later, uncounted calls (seen with torch 2.13 on
        both); ``torch.compiler.reset()`` makes the next call compile afresh."""
        import torch

        torch.compiler.reset()
        per_sample = tokens / samples if tokens and samples > 0 else None
        self.value = analytic_flops_per_sample(self.parameters, per_sample)
        self.method = ANALYTIC if self.value is not None else None
        if self.warn:
            instead = (f"the analytic estimate 6·N·tokens = {self.value:.4g} FLOPs per sample" if self.value is not None
                       else "no FLOPs per sample (no MFU)")
            warnings.warn(f"trainscale: FLOP counting failed: {why}; training goes on with {instead}",
                          RuntimeWarning, stacklevel=3)


def measure_flops(model: Any, forward_fn: Callable[[], Any], loss_fn: Callable[[Any], Any] | None = None) -> int:
    """FLOPs of one call of ``forward_fn`` (and, with ``loss_fn``, of the loss on its output and its backward), as
    counted by ``torch.utils.flop_counter.FlopCounterMode``: Lightning's ``measure_flops``
    (``lightning.fabric.utilities.throughput``). A multiply-add counts as 2 FLOPs, so a ``Linear(i, o)`` on a batch
    of ``b`` costs ``2·b·i·o`` forward and twice that again backward. Build the model on the meta device to
    count without memory or compute::

        with torch.device("meta"):
            model = Net()
            x = torch.randn(8, 32)
        fwd = measure_flops(model, lambda: model(x))
        fwd_and_bwd = measure_flops(model, lambda: model(x), lambda y: y.sum())

    The count is the one trainscale's telemetry makes of a training step (``counting.TolerantFlopCounter``).

    Args:
        model: the module measured (Lightning's argument; the count covers whatever ``forward_fn`` runs).
        forward_fn: runs the forward and returns its output.
        loss_fn: the output -> a scalar loss; given, its FLOPs and those of ``backward()`` are counted too.

    Returns:
        FLOPs (an int).

    Raises:
        RuntimeError: an op could not be counted (a FLOP formula raised, or a higher-order operator has no rule:
            Lightning's count raises torch's error there); the count would be too low.
    """
    from trainscale.telemetry.counting import TolerantFlopCounter

    with TolerantFlopCounter() as counter:
        if loss_fn is None:
            forward_fn()
        else:
            loss_fn(forward_fn()).backward()
    if counter.failures:
        raise RuntimeError(f"measure_flops could not count {len(counter.failures)} op(s), so the count would be too "
                           f"low: {'; '.join(counter.failures[:3])}")
    return int(counter.get_total_flops())


# Lightning's dtypes -> the keys of PEAK_FLOPS's entries ("fp32" becomes "tf32" when float32 matmuls may use TF32)
_DTYPE_KEYS = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float64": "fp64",
               "tfloat32": "tf32"}


def get_available_flops(device: Any, dtype: Any) -> int | None:
    """Peak dense FLOP/s of one device for ``dtype`` (a ``torch.dtype``, or ``"tfloat32"``), from :data:`PEAK_FLOPS`:
    Lightning's ``get_available_flops``, its sources in this module's table. ``torch.float32`` on a device with TF32
    counts at the TF32 rate when float32 matmuls may use it (``torch.set_float32_matmul_precision("high")``), as
    Lightning's. None on a device that is not CUDA (no peak known: no MFU), and, with Lightning's warnings, for a GPU
    missing from the table (``"FLOPs not found for 'NVIDIA ...'"``) or a dtype it has no rate for (``"'Tesla T4'
    does not support torch.bfloat16"``; no float64 rates are listed)."""
    if device.type != "cuda":
        return None
    import torch

    from trainscale.runtime.precision import tf32_enabled
    from trainscale.utilities import rank_zero_warn

    device_name = torch.cuda.get_device_name(device)
    peaks = _peaks(device_name)
    if peaks is None:
        rank_zero_warn(f"FLOPs not found for {device_name!r}")
        return None
    key = _DTYPE_KEYS.get(str(dtype))
    if key == "fp32" and "tf32" in peaks and tf32_enabled()[0]:
        key = "tf32"
    if key not in peaks:
        rank_zero_warn(f"{device_name!r} does not support {dtype}")
        return None
    return int(peaks[key])
