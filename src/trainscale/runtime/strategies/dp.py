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

from trainscale.runtime import checkpoint_io
from trainscale.runtime.connector import DP_COMPILE_ERROR
from trainscale.runtime.strategies import SYNC, check_async_save, clip_grad_norm
from trainscale.runtime.strategies.dcp_checkpoint import load_whole
from trainscale.runtime.world import World

_SCALAR = "__trainscale_dp_scalar__"


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


class DataParallelStrategy:
    """Wrap the module in ``nn.DataParallel`` over ``device_ids`` (GPU-only; one process).

    The data loader is not sharded: its ``batch_size`` is the batch of the whole step, split
    across the GPUs. There is no gradient all-reduce, so ``no_backward_sync`` is a no-op.

    Args:
        device: GPU 0 of ``device_ids`` (parameters, outputs and the optimizer live there).
        world: a world of one process.
        device_ids: the CUDA device indices to use (the Runtime passes ``range(devices)``).
    """

    name = "dp"
    checkpoint_suffix = ".pt"
    forward_communicates = False
    materialises_meta = False  # a model on the meta device is refused by Runtime.setup
    pipelined = False

    def __init__(self, device: Any, world: World, device_ids: list[int] | None = None) -> None:
        self.device = device
        self.world = world
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

    def setup_optimizer(self, optimizer):
        return optimizer

    def unwrap(self, module):
        return module.module if isinstance(module, DataParallelModule) else module

    def no_backward_sync(self, module, enabled: bool):
        return SYNC

    def clip_gradients_norm(self, module, max_norm: float, norm_type: float = 2.0):
        return clip_grad_norm(module, max_norm, norm_type)  # the replicas' gradients are summed on GPU 0

    def time_allreduce(self, module, clock, record) -> bool:
        return False  # no all-reduce: backward sums the replicas' gradients into GPU 0's parameters

    def save_checkpoint(self, path, state: dict, async_group=None) -> None:
        if async_group is not None:
            check_async_save(self.name)  # one file from rank zero: never in the background
        checkpoint_io.save_replicated(path, state, self.world, self.unwrap)

    def load_checkpoint(self, path, state: dict, verify: bool = True) -> dict:
        return load_whole(path, state, self.world.rank, self.name, self.unwrap, verify)  # a file or a DCP directory

    def data_world(self, world: World) -> World:
        return world  # every rank reads different data

    def teardown(self) -> None:
        pass
