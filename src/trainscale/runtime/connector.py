"""User flags become one resolved configuration, here and only here.

Pure logic: the machine's facts (CUDA device count, MPS) are arguments, so every rule is
unit-tested without hardware. Unknown or conflicting values raise ``ValueError`` naming the
valid choices or the flag to change, before any process or process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainscale.runtime.devices import ACCELERATORS, detect_accelerator
from trainscale.runtime.precision import PRECISIONS
from trainscale.runtime.strategies import STRATEGIES


@dataclass(frozen=True)
class RunConfig:
    """Resolved flags.

    Attributes:
        accelerator: "cpu", "cuda" or "mps".
        devices: processes (or GPUs) per node.
        num_nodes: number of machines.
        strategy: a key of ``STRATEGIES`` other than "auto".
        precision: a key of ``PRECISIONS``.
    """

    accelerator: str
    devices: int
    num_nodes: int
    strategy: str
    precision: str

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


def _choices(names) -> str:
    return ", ".join(repr(n) for n in names)


def resolve(
    accelerator: str = "auto",
    devices: int | str = "auto",
    strategy: str = "auto",
    num_nodes: int = 1,
    precision: str = "32-true",
    *,
    cuda_count: int = 0,
    has_mps: bool = False,
) -> RunConfig:
    """Turn user flags into a :class:`RunConfig`.

    Args:
        accelerator: one of ``ACCELERATORS``; "gpu" is an alias of "cuda".
        devices: a positive int, or "auto" (every CUDA device; one process on cpu/mps).
            On cpu, ``devices=N`` means N processes.
        strategy: one of ``STRATEGIES``; "auto" means "single" for one device in total, else "ddp".
        num_nodes: machines in the job, >= 1.
        precision: one of ``PRECISIONS``.
        cuda_count, has_mps: the machine's facts (see ``trainscale.runtime.devices``).

    Raises:
        ValueError: an unknown name (the message lists the valid ones), a non-positive count,
            more CUDA devices than exist, or a strategy that cannot run the requested world.
    """
    if not isinstance(accelerator, str) or accelerator.lower() not in ACCELERATORS:
        raise ValueError(f"unknown accelerator={accelerator!r}; choose one of {_choices(ACCELERATORS)}")
    accelerator = accelerator.lower()
    if accelerator == "gpu":
        accelerator = "cuda"
    if accelerator == "auto":
        accelerator = detect_accelerator(cuda_count, has_mps)
    if accelerator == "cuda" and cuda_count == 0:
        raise ValueError("accelerator='cuda' was asked for but no CUDA device is visible; "
                         "pass accelerator='cpu' (devices=N then means N processes)")
    if accelerator == "mps" and not has_mps:
        raise ValueError("accelerator='mps' was asked for but MPS is not available; pass accelerator='cpu'")

    if devices == "auto":
        devices = cuda_count if accelerator == "cuda" else 1
    if isinstance(devices, bool) or not isinstance(devices, int):
        raise ValueError(f"devices={devices!r} must be a positive int or 'auto'")
    if devices < 1:
        raise ValueError(f"devices={devices} must be >= 1 (the number of processes/GPUs per node), or 'auto'")
    if accelerator == "cuda" and devices > cuda_count:
        raise ValueError(f"devices={devices} asks for more CUDA devices than the {cuda_count} visible here; "
                         f"pass devices<={cuda_count} (check CUDA_VISIBLE_DEVICES)")
    if accelerator == "mps" and devices > 1:
        raise ValueError("MPS offers one device; pass devices=1, or accelerator='cpu' for several processes")

    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r} must be an int >= 1")

    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy={strategy!r}; choose one of {_choices(STRATEGIES)}")
    world_size = devices * num_nodes
    if strategy == "auto":
        strategy = "single" if world_size == 1 else "ddp"
    if strategy == "single" and world_size > 1:
        raise ValueError(f"strategy='single' runs one process but devices×num_nodes={world_size}; "
                         "pass strategy='ddp' (or devices=1)")

    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"unknown precision={precision!r}; choose one of {_choices(PRECISIONS)}")
    return RunConfig(accelerator, devices, num_nodes, strategy, precision)
