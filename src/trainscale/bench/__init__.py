"""bench: the scaling experiment as one command (``trainscale bench``) or one call.

    from trainscale.bench import sweep
    result = sweep("mypkg.workload:build", devices=[1, 2], batch_sizes=[32, 128], steps=100)

Each cell (devices × batch size × strategy × precision) is a fresh torchrun job
(:mod:`trainscale.bench.cell`); rows go to ``results.jsonl`` as cells finish; the table, gain,
scaling efficiency, plots and advice are computed from the measured times
(:mod:`~trainscale.bench.analysis`, :mod:`~trainscale.bench.advice`, :mod:`~trainscale.bench.report`).
The workload contract is in :mod:`trainscale.jobs.workload`. Importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names of __all__, for type checkers and the API reference (docs/api.md)
    from trainscale.bench.runner import BenchResult, sweep

__all__ = ["sweep", "BenchResult"]


def __getattr__(name: str):
    if name in __all__:
        from trainscale.bench import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'trainscale.bench' has no attribute {name!r}")
