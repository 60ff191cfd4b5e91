"""What one "ddp_spawn"/"ddp_notebook" rank runs: a Trainer rebuilt from the parent's flags, on the Runtime that
``Runtime.launch`` made for the rank (the one spawn path of trainscale)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainscale.loggers.log_dirs import VersionedDir

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer
    from trainscale.runtime.runtime import Runtime


def spawned_call(runtime: Runtime, trainer_flags: dict, method: str, model: nn.Module, **kwargs: Any) -> dict:
    """On one rank: ``Trainer(**trainer_flags).<method>(model, **kwargs)`` on ``runtime``; rank 0's result, trained
    weights (on CPU), training state, callback states and ``callback_metrics`` go back to the parent."""
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(**trainer_flags, runtime=runtime)
    result = getattr(trainer, method)(model, **kwargs)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    model.__dict__.pop("_trainer", None)
    return {"result": result, "state_dict": state, "state": trainer.state,
            "run_dir": str(trainer.run_dir) if trainer.run_dir else None,
            "logger_versions": [getattr(lg, "version", None) for lg in trainer.loggers],
            "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
            "callback_metrics": {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                                 for k, v in trainer.callback_metrics.items()}}


def run_spawned(trainer: Trainer, method: str, model: nn.Module, **kwargs: Any) -> Any:
    """Run ``trainer.<method>`` in ranks started here through ``Runtime.launch`` (``ddp_spawn``: "spawn",
    ``ddp_notebook``: "fork"), each running :func:`spawned_call`; load rank 0's weights into ``model``, take its
    loop state, run directory, metrics, callback states (a ``ModelCheckpoint``'s ``best_model_path``, as
    Lightning's ddp_spawn returns it) and the loggers' versions into ``trainer``, and return its result."""
    out = trainer.runtime.launch(spawned_call, trainer_flags=trainer.flags, method=method, model=model, **kwargs)
    model.load_state_dict(out["state_dict"])
    trainer.state, trainer.run_dir = out["state"], Path(out["run_dir"]) if out["run_dir"] else None
    if method == "fit":  # trainer.max_epochs as the ranks' fit resolved it; the model for test() without one
        trainer._max_epochs, trainer.fitted_module = trainer.config.max_epochs, model
    for lg, version in zip(trainer.loggers, out["logger_versions"]):  # trainer.log_dir names rank 0's directory
        if isinstance(lg, VersionedDir) and trainer.run_dir is not None:
            lg.adopt(trainer.run_dir, version)
    trainer.callback_metrics = out["callback_metrics"]
    for cb in trainer.callbacks:
        cb.load_state_dict(out["callbacks"][cb.state_key])
    return out["result"]
