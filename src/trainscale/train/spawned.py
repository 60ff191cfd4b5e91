"""What one "ddp_spawn" rank runs: a Trainer rebuilt from the parent's flags."""

from __future__ import annotations

from typing import Any

from torch import nn


def spawned_call(trainer_flags: dict, method: str, model: nn.Module, **kwargs: Any) -> dict:
    """Run ``Trainer(**trainer_flags).<method>(model, **kwargs)``; rank 0's result, trained weights (on
    CPU) and training state go back to the parent."""
    from trainscale.train.trainer import Trainer

    trainer = Trainer(**trainer_flags)
    try:
        result = getattr(trainer, method)(model, **kwargs)
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        model.__dict__.pop("_trainer", None)
        return {"result": result, "state_dict": state, "state": trainer.state,
                "run_dir": str(trainer.run_dir) if trainer.run_dir else None}
    finally:
        trainer.runtime.teardown()


def run_spawned(trainer_flags: dict, nprocs: int, start_method: str, method: str, model: nn.Module,
                **kwargs: Any) -> dict:
    """Start ``nprocs`` ranks (``start_method`` "spawn" or "fork") that each run :func:`spawned_call`; load
    rank 0's weights into ``model`` and return its answer (``result``, ``state``, ``run_dir``)."""
    from trainscale.runtime import spawn

    out = spawn.run(spawned_call, {"trainer_flags": trainer_flags, "method": method, "model": model, **kwargs},
                    nprocs, start_method)
    model.load_state_dict(out["state_dict"])
    return out
