"""plan: will my model fit, and how fast will it be? Predictions before the GPU hours are spent.

    from trainscale.plan import plan
    result = plan(entry="mypkg.work:build", devices=[1, 8, 64], batch_sizes=[32],
                             device_memory="80GB", link="400GB/s,latency=10us")
    print(result.table())

Memory per device without allocating the model (:mod:`~trainscale.plan.memory`), time from one
measured device plus a communication model (:mod:`~trainscale.plan.comm`, :mod:`~trainscale.plan.probe`).
Guide and formulas: docs/plan.md. Importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names of __all__, for type checkers and the API reference (docs/api.md)
    from trainscale.plan.planner import PlanResult, PlanRow, Workload, plan

__all__ = ["plan", "PlanResult", "PlanRow", "Workload"]


def __getattr__(name: str):
    if name in __all__:
        from trainscale.plan import planner

        return getattr(planner, name)
    raise AttributeError(f"module 'trainscale.plan' has no attribute {name!r}")
