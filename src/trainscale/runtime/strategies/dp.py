"""DataParallel: one process drives several GPUs of one machine (``torch.nn.DataParallel``).

Every step, DataParallel copies the module from GPU 0 to each GPU (replicate), splits the batch
along dimension 0 (scatter), runs the replicas in threads, and gathers their outputs on GPU 0;
gradients of the replicas are summed into GPU 0's parameters in backward. Hence its limits: one
Python process (the GIL) for all GPUs, a full replication every step, outputs and the optimizer
on GPU 0 (which uses more memory than the others), one machine only. PyTorch recommends
``DistributedDataParallel`` instead (https://pytorch.org/docs/stable/notes/cuda.html#cuda-nn-ddp-instead).

The resolver refuses ``dp`` without 2 or more CUDA GPUs: without CUDA, ``nn.DataParallel``
silently calls the module directly, with no parallelism at all.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainscale.runtime.strategies.base import Strategy
from trainscale.runtime.world import World

_SCALAR = "__trainscale_dp_scalar__"
DP_COMPILE_ERROR = ("strategy='dp' cannot run a compiled module: nn.DataParallel copies the compiled forward into "
                    "every replica, and each copy calls GPU 0's module with GPU 0's weights. Pass strategy='ddp' "
                    "(one process per GPU, each compiling its own module) or compile=False")


class _ScalarsAsVectors(nn.Module):
    """Replica side: a 0-d output (a loss) is returned as ``{_SCALAR: (1,)}`` so that the gather
    on GPU 0 can tell "one loss per replica" from a batch output, and average it.

    It also runs the replica under the caller's autocast dtype. DataParallel runs each replica in a
    thread, where autocast state is thread-local, and ``parallel_apply`` re-enters autocast with the
    enabled flag only (torch/nn/parallel/parallel_apply.py: ``torch.amp.autocast(device_type,
    enabled=autocast_enabled)``), so the replicas ran at autocast's default dtype: "bf16-mixed" ran
    float16, without a GradScaler. ``autocast_dtype`` is set by :class:`DataParallelModule` before each
    call and copied into the replicas with the module's attributes.
    """

    def __init__(self, module: nn.Module, device_type: str = "cuda") -> None:
        super().__init__()
        self.module = module
        self.device_type = device_type
        self.autocast_dtype: torch.dtype | None = None  # the caller's, or None when autocast is off

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.autocast_dtype is not None:
            with torch.autocast(self.device_type, dtype=self.autocast_dtype):
                out = self.module(*args, **kwargs)
        else:
            out = self.module(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.ndim == 0:
            return {_SCALAR: out.unsqueeze(0)}
        return out


def _is_compiled(module: nn.Module) -> bool:
    """``Module.compile()`` sets ``_compiled_call_impl``; ``torch.compile(module)`` returns a wrapper with ``_orig_mod``."""
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")


class DataParallelModule(nn.Module):
    """``nn.DataParallel`` whose scalar outputs (per-replica mean losses) come back as their mean.

    The mean of per-replica means equals the batch mean when the batch size is a multiple of the
    number of GPUs (DataParallel splits the batch with ``torch.chunk``); otherwise the last, smaller
    chunk weighs a little more. Batch outputs ``(B, ...)`` are gathered unchanged on GPU 0.
    """

    def __init__(self, module: nn.Module, device_ids: list[int]) -> None:
        super().__init__()
        self.parallel = nn.DataParallel(_ScalarsAsVectors(module), device_ids=device_ids)

    @property
    def module(self) -> nn.Module:
        return self.parallel.module.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        replica = self.parallel.module
        enabled = torch.is_autocast_enabled(replica.device_type)
        replica.autocast_dtype = torch.get_autocast_dtype(replica.device_type) if enabled else None
        out = self.parallel(*args, **kwargs)
        if isinstance(out, dict) and _SCALAR in out:
            return out[_SCALAR].mean()
        return out


class DataParallelStrategy(Strategy):
    """Wrap the module in ``nn.DataParallel`` over ``device_ids`` (GPU-only; one process).

    The data loader is not sharded: its ``batch_size`` is the batch of the whole step, split
    across the GPUs. There is no gradient all-reduce, so ``no_backward_sync`` is a no-op.

    Args:
        device: GPU 0 of ``device_ids`` (parameters, outputs and the optimizer live there).
        world: a world of one process.
        precision: the run's ``Precision`` (its autocast is re-entered in each replica by :class:`DataParallelModule`).
        device_ids: the CUDA device indices to use (the Runtime passes ``range(devices)``).
    """

    name = "dp"
    drives_all_devices = True  # one process for all the GPUs of one machine
    manual_optimization_refusal = "DataParallel's per-device replicas"  # training_step would run in their threads

    def __init__(self, device: Any, world: World, precision: Any = None, device_ids: list[int] | None = None) -> None:
        super().__init__(device, world, precision)
        self.device_ids = list(device_ids) if device_ids is not None else list(range(torch.cuda.device_count()))

    def setup_module(self, module):
        """Wrap ``module`` (moved to GPU 0) in :class:`DataParallelModule`.

        Raises:
            ValueError: ``module`` is compiled (``Module.compile()`` or ``torch.compile``): DataParallel's
                replicas would all call the compiled code of GPU 0's module, with GPU 0's weights.
        """
        if _is_compiled(module):
            raise ValueError(DP_COMPILE_ERROR)
        return DataParallelModule(module.to(self.device), self.device_ids)

    @classmethod
    def check_run(cls, *, accelerator: str, devices: int, num_nodes: int, cuda_count: int, compiled: bool) -> None:
        """Raises ``ValueError`` without 2 or more CUDA GPUs on one machine (without CUDA, ``nn.DataParallel``
        silently calls the module directly: no parallelism at all), or with ``compile``."""
        if accelerator != "cuda" or cuda_count < 2 or devices < 2 or num_nodes > 1:
            raise ValueError(f"strategy='dp' (nn.DataParallel) drives 2 or more CUDA GPUs from one process on one "
                             f"machine, but here accelerator={accelerator!r}, {cuda_count} CUDA device(s) visible, "
                             f"devices={devices}, num_nodes={num_nodes}; pass strategy='ddp' (one process per "
                             "device, faster than dp on GPUs and also runs on CPU)")
        if compiled:
            raise ValueError(DP_COMPILE_ERROR)

    @classmethod
    def options_from(cls, options, config, flags) -> dict:
        """The user's options, with ``device_ids`` all the node's ``devices`` unless given."""
        return {"device_ids": list(range(config.devices)), **(options or {})}

    def unwrap(self, module):
        return module.module if isinstance(module, DataParallelModule) else module
