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
import warnings
from typing import Iterator

# Dense (no sparsity) peak tensor-core FLOP/s by GPU and compute dtype, from NVIDIA's data sheets.
# "fp32" is the plain FP32 rate: PyTorch keeps TF32 off for matmuls by default
# (torch.backends.cuda.matmul.allow_tf32 = False), so "32-true" runs at that rate.
#   V100 SXM2: https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
#   T4:        https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf
#   A10:       https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf
#   A100:      https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
#   L4:        https://www.nvidia.com/en-us/data-center/l4/  (data sheet: 242 TFLOPS bf16 "with sparsity")
#   H100:      https://www.nvidia.com/en-us/data-center/h100/ (data sheet figures "with sparsity" halved)
# Keys are matched as substrings of torch.cuda.get_device_name(), most specific first.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},  # SXM
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},  # after "A100": "A10" matches both
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
}

_PRECISION_DTYPE = {"32-true": "fp32", "16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}


def peak_flops_per_s(device_name: str | None, precision: str) -> float | None:
    """Peak dense FLOP/s of one device for a precision ("32-true", "bf16-mixed", ...).

    Returns:
        FLOP/s, or None for a device not in :data:`PEAK_FLOPS` (CPUs, unknown GPUs) or a dtype the
        device lacks (bf16 on V100/T4).
    """
    if not device_name:
        return None
    for key, peaks in PEAK_FLOPS.items():
        if key in device_name:
            return peaks.get(_PRECISION_DTYPE.get(precision, "fp32"))
    return None


def mfu(achieved_flops_per_s: float | None, peak_per_device: float | None, devices: int) -> float | None:
    """Model FLOPs utilization: total achieved FLOP/s over ``devices`` × peak (None if either is unknown)."""
    if achieved_flops_per_s is None or not peak_per_device:
        return None
    return achieved_flops_per_s / (peak_per_device * devices)


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

    def _fall_back(self, why: str, samples: int, tokens: int | None) -> None:
        """Analytic estimate or None, one warning, and compiled code forgotten: higher-order operators
        (``while_loop``, ``flex_attention``) compile themselves on first use, and what was traced or
        skipped under the counter's dispatch mode fails later, uncounted calls (seen with torch 2.13 on
        both); ``torch.compiler.reset()`` makes the next call compile afresh."""
        import torch

        torch.compiler.reset()
        per_sample = tokens / samples if tokens and samples > 0 else None
        self.value = analytic_flops_per_sample(self.parameters, per_sample)
        self.method = "analytic (6N per token)" if self.value is not None else None
        if self.warn:
            instead = (f"the analytic estimate 6·N·tokens = {self.value:.4g} FLOPs per sample" if self.value is not None
                       else "no FLOPs per sample (no MFU)")
            warnings.warn(f"trainscale: FLOP counting failed: {why}; training goes on with {instead}",
                          RuntimeWarning, stacklevel=3)
