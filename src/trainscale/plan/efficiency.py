"""The efficiency constants of the GPU time model: each one named, with its interval and its source.

A prediction for a GPU you are not on is made twice, once with every constant at the favourable end of its
interval ("fast") and once at the other ("slow"): the step time is reported as that interval, the middle as its
geometric mean. The constants come from their sources and were not fitted to the published rows the model is
held against (``benchmarks/published.py``); the figures are as the sources publish them, written down without web
access here (so not re-checked against the live pages), and ``benchmarks/gpu_check.py`` on a lent GPU is where
they get measured.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Constant:
    """A named efficiency with its interval ``(low, high)`` (fractions of a peak, or seconds) and source; ``faster``
    says which end gives the shorter time ("high" for a fraction of a peak, "low" for an overhead)."""

    name: str
    low: float
    high: float
    unit: str
    source: str
    faster: str = "high"

    def at(self, scenario: str) -> float:
        """The value in ``scenario`` "fast", "slow" or "mid" (the geometric mean of the ends)."""
        if scenario == "mid":
            return (self.low * self.high) ** 0.5
        fast = self.high if self.faster == "high" else self.low
        slow = self.low if self.faster == "high" else self.high
        return fast if scenario == "fast" else slow

    def __str__(self) -> str:
        scale, fmt = (1e6, "{:.3g} µs") if self.unit == "s" else (1, "{:.2f}")
        span = f"{fmt.format(self.low * scale)}–{fmt.format(self.high * scale)}"
        return f"{self.name} = {span}: {self.source}"


GEMM = Constant(
    "gemm_fraction", 0.70, 0.85, "of dense peak",
    "the fraction of the Tensor Core peak a cuBLAS GEMM with full tiles and waves reaches, for a part without a "
    "published measurement: NVIDIA, 'Matrix Multiplication Background User's Guide' (docs.nvidia.com/deeplearning/"
    "performance), large fp16 GEMMs at 80-90 % of peak. Smaller GEMMs lose tile and wave quantization on top (same "
    "guide), and below the ridge point they are bandwidth-bound (roofline, Williams et al. 2009)")
_MAMF = ("S. Bekman, 'Machine Learning Engineering', compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS "
         "comparison table' (github.com/stas00/ml-engineering; mamf-finder.py, torch.matmul, mean of 100 iterations "
         "at the best shape found): {}. That best shape is the high end; the low end is {:.0%} of it, the relative "
         "width of NVIDIA's 80-90 %-of-peak range less the same source's 5 % and more between GPUs of one node (a "
         "synchronous job runs at its slowest GPU's pace)")
_LOW = 0.82


def _mamf(name: str, high: float, measured: str) -> Constant:
    return Constant(f"gemm_fraction[{name}]", round(high * _LOW, 3), high, "of dense peak",
                    _MAMF.format(measured, _LOW))


# (architecture, dtype class) -> the GEMM constant; the 16-bit class (bf16, fp16) also stands for tf32, which no
# published table measures
GEMMS = {
    ("ampere", "16-bit"): _mamf("ampere", 0.869, "A100 SXM bf16 271.2 of 312 TFLOP/s"),
    ("hopper", "16-bit"): _mamf("hopper", 0.803, "H100 SXM bf16 794.5 of 989 TFLOP/s (H200 the same)"),
    ("hopper", "fp8"): _mamf("hopper,fp8", 0.709, "H100 SXM float8_e4m3fn 1,402.6 of 1,979 TFLOP/s"),
    ("blackwell", "16-bit"): _mamf("blackwell", 0.776, "B200 SXM bf16 1,745 of 2,250 TFLOP/s"),
    ("blackwell", "fp8"): _mamf("blackwell,fp8", 0.763, "B200 SXM float8_e4m3fn 3,432.5 of 4,500 TFLOP/s"),
    ("cdna3", "16-bit"): _mamf("cdna3", 0.514, "MI300X bf16 668.4 of 1,300 TFLOP/s, PYTORCH_TUNABLEOP_ENABLED=1"),
}
ATTENTION = {
    "ampere": Constant("attention_fraction[ampere]", 0.45, 0.70, "of dense peak",
                       "FlashAttention-2 (Dao 2023, §4.1): 50-73 % of A100's peak in forward, 45-63 % forward and "
                       "backward together"),
    "hopper": Constant("attention_fraction[hopper]", 0.30, 0.40, "of dense peak",
                       "FlashAttention-2 on H100: 35 % of the bf16 peak (Shah et al. 2024, 'FlashAttention-3', "
                       "abstract and §1), ±5 points between forward and its slower backward. It is what "
                       "torch.nn.functional.scaled_dot_product_attention runs on Hopper: its flash backend is "
                       "FlashAttention-2, and cuDNN attention is opt-in below cuDNN 9.15.1 (pytorch/pytorch#138522, "
                       "check_prefer_cudnn_attention in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp)"),
}
TILE = (128, 128)  # the output tile of cuBLAS's large-GEMM kernels (NVIDIA, 'Matrix Multiplication Background')
HBM = Constant(
    "hbm_fraction", 0.70, 0.90, "of peak bandwidth",
    "the fraction of the data sheet's memory bandwidth an element-wise kernel sustains: STREAM-like copy and "
    "triad kernels reach 85-92 % on A100 and H100 (BabelStream, Deakin et al. 2018, published GPU results); "
    "PyTorch's eager element-wise and reduction kernels the lower end")
LAUNCH = Constant(
    "kernel_gap", 2e-6, 6e-6, "s", "the gap between two dependent kernels (launch latency on the GPU, a few µs: "
    "NVIDIA CUDA C++ Best Practices Guide; Horace He, 'Making Deep Learning Go Brrrr From First Principles', 2022)",
    faster="low")
NVLINK = Constant(
    "nvlink_busbw_fraction", 0.70, 0.90, "of one direction's bandwidth",
    "nccl-tests (doc/PERFORMANCE.md) all_reduce bus bandwidth within an NVLink node over the link's one-way rate: "
    "about 230 of 300 GB/s on DGX A100 and 360-450 of 450 GB/s on DGX H100 in NVIDIA's published runs")
NETWORK = Constant(
    "network_busbw_fraction", 0.80, 0.95, "of the port rate",
    "nccl-tests bus bandwidth across nodes over the NICs' line rate (NCCL over InfiniBand/RoCE: 80-95 %, e.g. "
    "about 185 GB/s of DGX A100's 8 × 200 Gb/s)")
LATENCY = Constant("ring_step_latency", 5e-6, 15e-6, "s",
                   "latency of one ring step of an NCCL collective (nccl-tests small-message times: 10-30 µs for "
                   "an all-reduce within a node)", faster="low")

ALL = (GEMM, *GEMMS.values(), *ATTENTION.values(), HBM, LAUNCH, NVLINK, NETWORK, LATENCY)


def gemm(arch: str, dtype: str) -> Constant:
    """The GEMM constant of a GPU architecture for a matmul in ``dtype`` ("fp32", "tf32", "bf16", "fp16", "fp8"):
    the measured one where :data:`GEMMS` has it, else :data:`GEMM`."""
    return GEMMS.get((arch, "fp8" if dtype == "fp8" else "16-bit"), GEMM)


def attention(arch: str) -> Constant:
    """The attention kernels' constant for a GPU architecture (other architectures: Ampere's, FlashAttention-2's)."""
    return ATTENTION.get(arch, ATTENTION["ampere"])
