"""One process, one device: no wrapper, no communication."""

from __future__ import annotations

from typing import Any

from trainscale.runtime import checkpoint_io
from trainscale.runtime.strategies import SYNC, check_async_save, clip_grad_norm
from trainscale.runtime.strategies.dcp_checkpoint import load_whole
from trainscale.runtime.world import World


class SingleDeviceStrategy:
    name = "single"
    checkpoint_suffix = ".pt"
    forward_communicates = False
    materialises_meta = False  # a model on the meta device is refused by Runtime.setup
    pipelined = False

    def __init__(self, device: Any, world: World) -> None:
        self.device = device
        self.world = world

    def setup_module(self, module):
        return module.to(self.device)

    def setup_optimizer(self, optimizer):
        return optimizer

    def unwrap(self, module):
        return module

    def no_backward_sync(self, module, enabled: bool):
        return SYNC

    def clip_gradients_norm(self, module, max_norm: float, norm_type: float = 2.0):
        return clip_grad_norm(module, max_norm, norm_type)

    def time_allreduce(self, module, clock, record) -> bool:
        return False  # one process: no all-reduce

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
