"""Lightning's ``lightning.pytorch.strategies`` at its path: the strategy classes, for ``from trainscale.strategies
import DDPStrategy`` in a port.

    from trainscale import Trainer
    from trainscale.strategies import DDPStrategy, ParallelStrategy

    trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(find_unused_parameters=True))
    assert isinstance(trainer.strategy, ParallelStrategy)

A strategy built with options only stands for its name and those options: the Runtime builds its own instance of
the class, bound to the run's device and world, exactly as from ``strategy="ddp", strategy_options={...}``; Lightning's
keywords that trainscale takes as flags (``timeout``, ``start_method``, ...) map to them, and the rest are refused
with what to do instead (docs/strategies.md). Imported only when asked for: ``import trainscale`` stays cheap.
"""

from trainscale.runtime.strategies import (DDPStrategy, FSDPStrategy, ModelParallelStrategy, ParallelStrategy,
                                           SingleDeviceStrategy, Strategy)

__all__ = ["DDPStrategy", "FSDPStrategy", "ModelParallelStrategy", "ParallelStrategy", "SingleDeviceStrategy",
           "Strategy"]
