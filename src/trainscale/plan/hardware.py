"""The hardware catalogue: GPUs and the links between them, as data with the document each number comes from.

``trainscale plan --gpu h100-sxm --nodes 16 --gpus-per-node 8 --interconnect ib-400`` reads it. Dense peaks
(FLOP/s, no 2:4 sparsity) for fp32, tf32, bf16/fp16 come from ``trainscale.telemetry.flops.PEAK_FLOPS`` (one
table, the one every MFU divides by; its sources are listed there), fp8 and the memory and link figures from the
data sheets named per entry. A figure a document does not pin down is an interval ``(low, high)``: the H100 part
torchtitan's published runs used (96 GB HBM2e, 500 W) has a peak "between SXM and NVL" by its authors' own words.

Bandwidths are bytes/s. ``nvlink`` is the data sheet's per-GPU NVLink (or Infinity Fabric) figure, which adds
both directions; a ring collective moves data one way per link, so :func:`GPU.link_per_direction` halves it.
``pcie`` likewise (both directions). Interconnects across nodes are per GPU (one NIC per GPU, as on DGX/HGX
systems), per direction: a 400 Gb/s NDR InfiniBand port is 50e9 bytes/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainscale.telemetry.flops import PEAK_FLOPS

Interval = tuple  # (low, high)


@dataclass(frozen=True)
class GPU:
    """One accelerator: ``flops`` dtype → dense peak FLOP/s (a number, or ``(low, high)`` where the source gives a
    range); ``hbm_bytes`` (bytes), ``hbm_bandwidth`` (bytes/s), ``nvlink`` and ``pcie`` (bytes/s, both directions
    added, as data sheets print them; ``nvlink`` 0: none), ``sms`` (streaming multiprocessors or compute units: the
    width of a wave of GEMM tiles), ``arch`` (for the attention kernels' efficiency), ``source``."""

    name: str
    flops: dict
    hbm_bytes: float
    hbm_bandwidth: float
    nvlink: float
    pcie: float
    sms: int
    arch: str
    source: str

    def peak(self, dtype: str) -> Interval:
        """``(low, high)`` dense peak FLOP/s for ``dtype`` ("fp32", "tf32", "bf16", "fp16", "fp8").

        Raises:
            ValueError: the GPU has no such rate (V100: no bf16, tf32 or fp8), naming those it has."""
        value = self.flops.get(dtype)
        if value is None:
            raise ValueError(f"{self.name} has no {dtype} rate in its data sheet; it has {', '.join(self.flops)}")
        return tuple(value) if isinstance(value, tuple) else (value, value)

    def link_per_direction(self) -> float:
        """Bytes/s one GPU sends to its peers in one direction: half the data sheet's NVLink (or, with none, PCIe)."""
        return (self.nvlink or self.pcie) / 2


@dataclass(frozen=True)
class Interconnect:
    """A network between nodes: ``bandwidth`` bytes/s per GPU per direction (one NIC per GPU), ``source``."""

    name: str
    bandwidth: float
    source: str = ""


def _with(base: str, **extra) -> dict:
    return {**PEAK_FLOPS[base], **extra}


_NV = "NVIDIA data sheet "
_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (H100 data sheet: "
GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("a100-40gb", _with("A100"), 40e9, 1555e9, 600e9, 64e9, 108, "ampere",
        _NV + "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf: A100 40GB SXM, HBM2 1,555 GB/s, NVLink 600 GB/s, "
        "PCIe Gen4 64 GB/s; 108 SMs (NVIDIA A100 Tensor Core GPU Architecture whitepaper)"),
    GPU("a100-80gb", _with("A100"), 80e9, 2039e9, 600e9, 64e9, 108, "ampere",
        _NV + "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf: A100 80GB SXM, HBM2e 2,039 GB/s, NVLink 600 GB/s"),
    GPU("h100-sxm", _with("H100 SXM", fp8=1979e12), 80e9, 3.35e12, 900e9, 128e9, 132, "hopper",
        _H100 + "SXM5 80 GB HBM3 3.35 TB/s, FP8 3,958 TFLOPS with sparsity, NVLink 900 GB/s, PCIe Gen5 128 GB/s); "
        "132 SMs (NVIDIA H100 Tensor Core GPU Architecture whitepaper)"),
    GPU("h100-pcie", _with("H100 PCIe", fp8=1513e12), 80e9, 2.0e12, 600e9, 128e9, 114, "hopper",
        _H100 + "PCIe 80 GB HBM2e 2 TB/s, FP8 3,026 TFLOPS with sparsity, NVLink bridge 600 GB/s); 114 SMs"),
    GPU("h100-hbm2e-500w",
        {k: (PEAK_FLOPS["H100 NVL"][k], PEAK_FLOPS["H100 SXM"][k]) for k in PEAK_FLOPS["H100 SXM"]}
        | {"fp8": (1671e12, 1979e12)}, 96e9, 2.4e12, 900e9, 128e9, 132, "hopper",
        "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton: 96 GB HBM2e, 2.4 TB/s, "
        "500 W, NVLink within the host, 400 Gb/s RDMA per GPU; 'the actual peak TFLOPs number is between SXM and "
        "NVL': the interval H100 NVL .. H100 SXM)"),
    GPU("h200", _with("H200 SXM", fp8=1979e12), 141e9, 4.8e12, 900e9, 128e9, 132, "hopper",
        "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s; "
        "the H100 SXM's compute)"),
    GPU("b200", _with("B200", fp8=4500e12), 180e9, 7.7e12, 1800e9, 128e9, 148, "blackwell",
        "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 per GPU: 180 GB HBM3e, 7.7 TB/s, FP8 9 PFLOPS "
        "with sparsity, NVLink 5 1.8 TB/s); 148 SMs"),
    GPU("l4", _with("L4", fp8=242.5e12), 24e9, 300e9, 0.0, 64e9, 58, "ada",
        "https://www.nvidia.com/en-us/data-center/l4/ (24 GB GDDR6, 300 GB/s, FP8 485 TFLOPS with sparsity, "
        "PCIe Gen4 x16 64 GB/s, no NVLink); 58 SMs"),
    GPU("mi300x", {"fp32": 163.4e12, "tf32": 653.7e12, "bf16": 1307.4e12, "fp16": 1307.4e12, "fp8": 2614.9e12},
        192e9, 5.3e12, 896e9, 128e9, 304, "cdna3",
        "AMD Instinct MI300X data sheet (amd.com/en/products/accelerators/instinct/mi300/mi300x.html: 192 GB "
        "HBM3, 5.3 TB/s, dense FP32 matrix 163.4, TF32 653.7, BF16 1,307.4, FP8 2,614.9 TFLOPS, Infinity Fabric "
        "896 GB/s peak aggregate, PCIe Gen5); 304 compute units"),
    GPU("v100", _with("V100 SXM"), 32e9, 900e9, 300e9, 32e9, 80, "volta",
        "https://images.nvidia.com/content/technologies/volta/pdf/"
        "volta-v100-datasheet-update-us-1165301-r5.pdf (V100 SXM2 32 GB: HBM2 900 GB/s, NVLink 300 GB/s, "
        "PCIe Gen3 32 GB/s; 125 TFLOPS fp16 tensor, no bf16 or tf32); 80 SMs"),
)}

_IB = ("InfiniBand Trade Association link rates (EDR 100, HDR 200, NDR 400 Gb/s per port); one port per GPU, "
       "as DGX A100 (8 × HDR 200) and DGX H100 (8 × NDR 400) are built")
_ROCE = "Ethernet port rate (RoCE v2), one port per GPU"
INTERCONNECTS: dict[str, Interconnect] = {i.name: i for i in (
    Interconnect("ib-100", 100e9 / 8, _IB), Interconnect("ib-200", 200e9 / 8, _IB),
    Interconnect("ib-400", 400e9 / 8, _IB), Interconnect("roce-100", 100e9 / 8, _ROCE),
    Interconnect("roce-200", 200e9 / 8, _ROCE), Interconnect("roce-400", 400e9 / 8, _ROCE),
)}


@dataclass(frozen=True)
class Cluster:
    """``nodes`` × ``gpus_per_node`` of ``gpu``, NVLink (or PCIe) within a node, ``interconnect`` across nodes
    (None: a single node)."""

    gpu: GPU
    nodes: int = 1
    gpus_per_node: int = 8
    interconnect: Interconnect | None = None

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node


def gpu(name: str | GPU) -> GPU:
    """The catalogue's GPU called ``name`` (a :class:`GPU` is returned as is).

    Raises:
        ValueError: an unknown name, listing the catalogue."""
    if isinstance(name, GPU):
        return name
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; the catalogue has {', '.join(GPUS)} (or give --device-flops)") \
            from None


def interconnect(name: str | Interconnect | None) -> Interconnect | None:
    """The catalogue's interconnect called ``name`` (None stays None).

    Raises:
        ValueError: an unknown name, listing the catalogue."""
    if name is None or isinstance(name, Interconnect):
        return name
    try:
        return INTERCONNECTS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown interconnect {name!r}; the catalogue has {', '.join(INTERCONNECTS)}") from None


def cluster(gpu_name: str | GPU, nodes: int = 1, gpus_per_node: int = 8,
            interconnect_name: str | Interconnect | None = None) -> Cluster:
    """A :class:`Cluster` from catalogue names.

    Raises:
        ValueError: unknown names; nodes or gpus_per_node below 1; several nodes and no interconnect."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"nodes={nodes} and gpus_per_node={gpus_per_node} must be at least 1")
    link = interconnect(interconnect_name)
    if nodes > 1 and link is None:
        raise ValueError(f"{nodes} nodes need an interconnect between them, e.g. --interconnect ib-400 "
                         f"(the catalogue has {', '.join(INTERCONNECTS)})")
    return Cluster(gpu(gpu_name), nodes, gpus_per_node, link)
