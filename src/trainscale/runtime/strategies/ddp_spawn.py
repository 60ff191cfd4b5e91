"""DDP in processes started by ``torch.multiprocessing`` (spawn) instead of a relaunched script.

For notebooks and functions, where there is no script that torchrun could start again. The
parent process stays outside the job: ``Trainer.fit`` / ``Runtime.launch(fn)`` pickle their
arguments, start ``devices`` children with ``trainscale.runtime.spawn`` (each with torchrun's
environment), and get rank 0's result back. Inside a child this strategy is plain DDP: it holds
a :class:`~trainscale.runtime.strategies.ddp.DDPStrategy` and delegates to it (composition).
"""

from __future__ import annotations

from typing import Any

from trainscale.runtime.strategies.ddp import DDPStrategy
from trainscale.runtime.world import World


class DDPSpawnStrategy:
    """DDP, with processes started by spawn. Options as :class:`DDPStrategy`.

    Args:
        device, world: this rank's device and :class:`World`.
        find_unused_parameters, static_graph, gradient_as_bucket_view, bucket_cap_mb: passed to
            ``DistributedDataParallel`` (see :class:`DDPStrategy`).
    """

    name = "ddp_spawn"

    def __init__(self, device: Any, world: World, find_unused_parameters: bool = False,
                 static_graph: bool = False, gradient_as_bucket_view: bool = False,
                 bucket_cap_mb: float | None = None) -> None:
        self._ddp = DDPStrategy(device, world, find_unused_parameters=find_unused_parameters,
                                static_graph=static_graph, gradient_as_bucket_view=gradient_as_bucket_view,
                                bucket_cap_mb=bucket_cap_mb)
        self.device = device
        self.world = world

    def setup_module(self, module):
        return self._ddp.setup_module(module)

    def setup_optimizer(self, optimizer):
        return self._ddp.setup_optimizer(optimizer)

    def unwrap(self, module):
        return self._ddp.unwrap(module)

    def no_backward_sync(self, module, enabled: bool):
        return self._ddp.no_backward_sync(module, enabled)

    def save_checkpoint(self, path, state: dict) -> None:
        self._ddp.save_checkpoint(path, state)

    def load_checkpoint(self, path, state: dict) -> dict:
        return self._ddp.load_checkpoint(path, state)

    def teardown(self) -> None:
        self._ddp.teardown()
