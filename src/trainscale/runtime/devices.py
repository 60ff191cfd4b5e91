"""Which accelerator, how many, which device a rank owns, and which c10d backend it talks over.

Backends follow PyTorch's recommendation: NCCL for CUDA tensors, gloo for CPU tensors
(https://pytorch.org/docs/stable/distributed.html#which-backend-to-use).
"""

from __future__ import annotations

from typing import get_args

from trainscale.runtime.flags import AcceleratorFlag

ACCELERATORS = get_args(AcceleratorFlag)  # "auto", "cpu", "cuda", "gpu" (an alias of "cuda"), "mps"


def cuda_device_count() -> int:
    """Number of visible CUDA devices (0 without CUDA).

    ``torch.cuda.device_count()`` asks NVML first and leaves CUDA uninitialised when NVML answers, where
    ``torch.cuda.is_available()`` calls ``cudaGetDeviceCount`` (``cuInit``), which torch's documentation says
    poisons a later fork (unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``): the parent of "ddp_notebook" counts its
    GPUs before it forks the ranks. As Lightning's ``num_cuda_devices``."""
    import torch

    return torch.cuda.device_count()


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


def backend_for(accelerator: str, cpu_collectives: bool = False) -> str:
    """The c10d backend string of ``init_process_group``: "nccl" for cuda, "gloo" otherwise.

    With ``cpu_collectives`` on cuda: "cuda:nccl,cpu:gloo", one process group whose collectives on CPU
    tensors go through gloo (NCCL takes CUDA tensors only). FSDP's CPU offload needs it: its gradients,
    and so the gradient-norm all-reduce of clipping, the GradScaler's inf check and the full-state
    export, are CPU tensors. As torchtitan does when offloading
    (torchtitan/distributed/utils.py ``init_distributed``: ``f"{device_type}:{backend},cpu:gloo"``).
    """
    if accelerator != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"


def bound_per_task(visible: int, local_world_size: int, launcher: str) -> bool:
    """Whether the launcher bound one GPU to each of the node's processes: SLURM (``--gpus-per-task=1``,
    ``--gpu-bind=single:1`` or ``map_gpu``), LSF's jsrun (resource sets of one GPU: ``-a 1 -g 1``), Ray
    (a worker given one GPU of its own) or an MPI rank whose wrapper set CUDA_VISIBLE_DEVICES from its local
    rank: a process sees one CUDA device, its own, while the node runs several. torchrun's
    workers all inherit the agent's CUDA_VISIBLE_DEVICES, so under torchrun one visible GPU for several
    workers is a shared GPU, not a binding. (Tasks that share one GPU anyway fail in NCCL's
    "Duplicate GPU detected" check at the first collective.)"""
    return launcher in ("slurm", "lsf", "ray", "mpi") and visible == 1 and local_world_size > 1


def node_cuda_count(visible: int, local_world_size: int, launcher: str) -> int:
    """CUDA devices the node's processes own together: one per task when bound per task, else the visible ones."""
    return local_world_size if bound_per_task(visible, local_world_size, launcher) else visible


def cuda_index(local_rank: int, local_world_size: int, visible: int, launcher: str) -> int:
    """The index (among this process's visible CUDA devices) of the GPU that ``local_rank`` owns:
    ``local_rank`` when the process sees every GPU of the node (torchrun, ``srun --gpus-per-node``),
    0 when SLURM bound one GPU to each task (:func:`bound_per_task`).

    Raises:
        ValueError: the process sees fewer GPUs than the node's processes but more than one (e.g.
            ``--gpus-per-task=2``): trainscale runs one process per GPU.
    """
    if bound_per_task(visible, local_world_size, launcher):
        return 0
    if local_rank < visible:
        return local_rank
    raise ValueError(f"local rank {local_rank} of {local_world_size} processes on this node sees {visible} CUDA "
                     "device(s): trainscale runs one process per GPU. Give each task one GPU (srun --gpus-per-task=1) "
                     "or every task all of the node's GPUs (--gpus-per-node with no per-task binding); check "
                     "CUDA_VISIBLE_DEVICES")


def device_for(accelerator: str, index: int):
    """The ``torch.device`` of the accelerator with CUDA device ``index`` (see :func:`cuda_index`)."""
    import torch

    if accelerator == "cuda":
        return torch.device("cuda", index)
    if accelerator == "mps":
        return torch.device("mps")
    return torch.device("cpu")
