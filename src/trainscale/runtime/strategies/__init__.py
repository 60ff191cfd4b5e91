"""Strategies: how a model is replicated or sharded across processes. One file each, each a subclass of the
small :class:`~trainscale.runtime.strategies.base.Strategy` base, which holds the defaults, or of its
``ParallelStrategy`` (one process per device: ddp, fsdp, model_parallel, pp), which adds Lightning's counts and no
behaviour, so that Lightning's ``isinstance(trainer.strategy, ParallelStrategy)`` holds; they share helpers by
composition (``trainscale.runtime.checkpoint_io``, ``apply_fsdp``, ``dcp_checkpoint``), never by inheriting from
one another. :data:`STRATEGY_CLASSES` registers them by import: the flag's name → the class.
"""

from __future__ import annotations

from typing import Any

from trainscale.runtime.strategies.base import SYNC, ParallelStrategy, Strategy, clip_grad_norm
from trainscale.runtime.strategies.ddp import DDPStrategy
from trainscale.runtime.strategies.dp import DataParallelStrategy
from trainscale.runtime.strategies.fsdp import FSDPStrategy
from trainscale.runtime.strategies.model_parallel import ModelParallelStrategy
from trainscale.runtime.strategies.pipeline import PipelineStrategy
from trainscale.runtime.strategies.single import SingleDeviceStrategy

__all__ = ["SYNC", "STRATEGIES", "STRATEGY_CLASSES", "ParallelStrategy", "Strategy", "clip_grad_norm",
           "create_strategy"]

# "auto" is resolved by trainscale.runtime.connector, and so are "ddp_spawn" and "ddp_notebook": ddp with the
# processes started by torch.multiprocessing (a start method, runtime/spawn.py).
STRATEGY_CLASSES: dict[str, type[Strategy]] = {
    "single": SingleDeviceStrategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "dp": DataParallelStrategy,
    # one strategy on one device mesh; "hsdp" and "tp" are layouts of it (parallel_dims.resolve_parallel)
    "model_parallel": ModelParallelStrategy,
    "hsdp": ModelParallelStrategy,
    "tp": ModelParallelStrategy,
    # pipeline stages (parallel={"pp": P}); the resolver also maps "model_parallel" with pp > 1 here
    "pp": PipelineStrategy,
}
STRATEGIES = ("auto", *STRATEGY_CLASSES)


def create_strategy(name: str, *, device: Any, world: Any, precision: Any = None, **options: Any) -> Strategy:
    """Instantiate strategy ``name`` on ``device``/``world`` with the run's ``Precision`` and the strategy's
    ``options``.

    Raises:
        ValueError: unknown name (lists the valid ones), or an option the strategy does not
            take (lists the ones it takes).
    """
    if name not in STRATEGY_CLASSES:
        raise ValueError(f"unknown strategy={name!r}; choose one of {', '.join(map(repr, STRATEGIES))}")
    cls = STRATEGY_CLASSES[name]
    cls.check_options(options, name)
    return cls(device=device, world=world, precision=precision, **options)
