"""Profilers with Lightning's names and API (``lightning.pytorch.profilers``): ``Trainer(profiler="simple" |
"advanced" | "pytorch")`` or one of these objects; every region is a ``with trainer.profiler.profile(name):``
line of ``Trainer.train_step`` (docs/lightning.md, "Profilers").

    from trainscale import Trainer
    from trainscale.profilers import PyTorchProfiler

    trainer = Trainer(profiler="pytorch")  # a Chrome/Perfetto trace per rank and an operator table in the run dir
    trainer = Trainer(profiler=PyTorchProfiler(row_limit=10, record_shapes=True))

Nothing here is imported by ``import trainscale``'s Trainer until a profiler is asked for, and torch is imported only
by :class:`PyTorchProfiler`.
"""

from __future__ import annotations

from trainscale.profilers.advanced import AdvancedProfiler
from trainscale.profilers.base import PassThroughProfiler, Profiler
from trainscale.profilers.pytorch import PyTorchProfiler
from trainscale.profilers.simple import SimpleProfiler

__all__ = ["AdvancedProfiler", "PassThroughProfiler", "Profiler", "PyTorchProfiler", "SimpleProfiler",
           "resolve_profiler"]

PROFILERS = {"simple": SimpleProfiler, "advanced": AdvancedProfiler, "pytorch": PyTorchProfiler}


def resolve_profiler(profiler: Profiler | str | None) -> Profiler:
    """The Trainer's ``profiler`` flag as an object (Lightning's ``_init_profiler``): a name (any case) → that
    profiler with its defaults, None → :class:`PassThroughProfiler` (no cost), a :class:`Profiler` → itself.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        TypeError: neither a name, None nor a :class:`Profiler`.
    """
    if profiler is None:
        return PassThroughProfiler()
    if isinstance(profiler, str):
        if profiler.lower() not in PROFILERS:
            raise ValueError(f"profiler={profiler!r} is not a profiler name; pass one of {sorted(PROFILERS)} or a "
                             "trainscale.profilers.Profiler")
        return PROFILERS[profiler.lower()]()
    if not isinstance(profiler, Profiler):
        raise TypeError(f"profiler={type(profiler).__name__} is not a profiler; pass one of {sorted(PROFILERS)} or a "
                        "trainscale.profilers.Profiler")
    return profiler
