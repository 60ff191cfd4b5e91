"""One process, one device: no wrapper, no communication."""

from __future__ import annotations

from typing import Any

from trainscale.runtime import checkpoint_io
from trainscale.runtime.strategies import SYNC
from trainscale.runtime.world import World


class SingleDeviceStrategy:
    name = "single"

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

    def save_checkpoint(self, path, state: dict) -> None:
        checkpoint_io.save_replicated(path, state, self.world, self.unwrap)

    def load_checkpoint(self, path, state: dict, verify: bool = True) -> dict:
        return checkpoint_io.load_replicated(path, state, self.unwrap, verify)

    def teardown(self) -> None:
        pass
