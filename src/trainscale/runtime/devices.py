"""Which accelerator, how many, which device a rank owns, and which c10d backend it talks over.

Backends follow PyTorch's recommendation: NCCL for CUDA tensors, gloo for CPU tensors
(https://pytorch.org/docs/stable/distributed.html#which-backend-to-use).
"""

from __future__ import annotations

ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps")


def cuda_device_count() -> int:
    """Number of visible CUDA devices (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def mps_available() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def detect_accelerator(cuda_count: int, has_mps: bool) -> str:
    """The accelerator "auto" means: cuda when present, else mps, else cpu."""
    if cuda_count > 0:
        return "cuda"
    if has_mps:
        return "mps"
    return "cpu"


def backend_for(accelerator: str) -> str:
    """c10d backend: "nccl" for cuda, "gloo" otherwise."""
    return "nccl" if accelerator == "cuda" else "gloo"


def device_for(accelerator: str, local_rank: int):
    """The ``torch.device`` that the rank with ``local_rank`` owns on this node."""
    import torch

    if accelerator == "cuda":
        return torch.device("cuda", local_rank)
    if accelerator == "mps":
        return torch.device("mps")
    return torch.device("cpu")
