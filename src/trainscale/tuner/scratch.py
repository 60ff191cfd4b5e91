"""The throwaway fits the Tuner trains with: short runs of the user's own ``Trainer`` flags on its Runtime, that write
nothing into the user's runs and leave the model as they found it.

Each run is a fresh :class:`~trainscale.loop.trainer.Trainer` built from ``trainer.flags`` with the overrides of
:data:`QUIET` (no checkpoints, loggers, progress bar, model summary, telemetry, signal handlers or sanity check; no
epoch limit) and the tuner's own (``max_steps``, its callback), on the user's Runtime (the same devices, strategy and
precision). Its run directory lies in a hidden temporary directory inside ``default_root_dir``
(``.tuner-XXXXXXXX``), removed at the end. The model is set up once (``Trainer.last_setup`` is handed from the user's
trainer to each run and back), so a later ``trainer.fit(model)`` reuses the same wrapper. What a run prints to stdout
(the Trainer's header and epoch lines, and your own prints) is not shown; warnings and errors are. After the runs the random
state and the GradScaler's state are put back, ``model.trainer`` is the user's trainer again, and
:class:`StateKeeper` puts back the weights and the optimizer's state that training changed.
"""

from __future__ import annotations

import contextlib
import copy
import io
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from trainscale.callbacks.base import Callback
from trainscale.checkpointing.rng import rng_state, set_rng_state
from trainscale.lightning.module import attach_trainer

# The user's flags that would write, print, wait or search inside a throwaway run, turned off.
QUIET = dict(logger=False, profiler=None, enable_checkpointing=False, checkpoint_every_n_steps=None,
             checkpoint_async=False, enable_progress_bar=False, enable_model_summary=False, enable_telemetry=False,
             count_flops=False, tensorboard=False, handle_signals=False, batch_size=None, max_memory=None,
             num_sanity_val_steps=0, max_epochs=-1, min_epochs=None, min_steps=None, max_time=None,
             val_check_interval=None, check_val_every_n_epoch=1, fast_dev_run=False)


def to_cpu(obj: Any) -> Any:
    """A copy of a state dict, its plain tensors on the CPU (the saved state costs no device memory)."""
    if type(obj) is torch.Tensor:
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


class StateKeeper(Callback):
    """Saves the module's and the optimizers' state at the first ``on_fit_start`` it sees (after the model is set
    up, before the first step) and puts them back on :meth:`restore`, as Lightning's tuner restores the checkpoint it
    saved first."""

    def __init__(self) -> None:
        self.saved: tuple | None = None  # (module, its state, [(optimizer, its state)])

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.saved is None:
            self.saved = (pl_module, to_cpu(pl_module.state_dict()),
                          [(opt, to_cpu(opt.state_dict())) for opt in trainer.optimizers])

    def restore(self) -> None:
        """The saved state back (nothing when no fit got as far as ``on_fit_start``)."""
        if self.saved is None:
            return
        module, state, optimizers = self.saved
        module.load_state_dict(state)
        for optimizer, opt_state in optimizers:
            optimizer.load_state_dict(opt_state)  # its param groups as saved (no "initial_lr" left behind)
        module.zero_grad(set_to_none=True)


class Scratch:
    """``with Scratch(trainer, model) as scratch: scratch.run("fit", {"max_steps": 3}, [callback], ...)``: throwaway
    runs of ``trainer``'s flags (see the module docstring).

    Raises:
        ValueError: ``trainer`` starts its processes itself ("ddp_spawn"/"ddp_notebook"): a throwaway run would
            start them again and lose the state the tuner reads.
    """

    def __init__(self, trainer: Any, model: Any) -> None:
        if trainer.runtime.spawns:
            raise ValueError(f"the Tuner cannot run under strategy={trainer.runtime.config.strategy!r}, whose fit starts "
                             "new processes: tune with devices=1, or launch the script with torchrun and "
                             "strategy='ddp'")
        self.trainer, self.model = trainer, model
        self.setup = trainer.last_setup
        self.root: Path | None = None

    def __enter__(self) -> Scratch:
        rt = self.trainer.runtime
        self._rng, self._precision = rng_state(), copy.deepcopy(rt.precision.state_dict())
        root = Path(self.trainer.config.default_root_dir)
        made = None
        if rt.is_rank_zero:
            root.mkdir(parents=True, exist_ok=True)
            made = tempfile.mkdtemp(prefix=".tuner-", dir=root)  # a new name: no other run's file is touched
        self.root = Path(rt.broadcast_object(made))
        return self

    def run(self, method: str, overrides: dict, callbacks: list, *args: Any, **kwargs: Any) -> Any:
        """``Trainer(**flags).<method>(self.model, *args, **kwargs)`` on a throwaway Trainer: ``trainer.flags``
        with :data:`QUIET`, ``overrides`` and ``callbacks``."""
        from trainscale.loop.trainer import Trainer

        flags = {**self.trainer.flags, **QUIET, "default_root_dir": self.root, **overrides, "callbacks": callbacks}
        with contextlib.redirect_stdout(io.StringIO()):  # its notes, header and epoch lines (Lightning prints none)
            temp = Trainer(runtime=self.trainer.runtime, **flags)
            temp.last_setup = self.setup  # set up once: the same wrapper for every run and the user's later fit
            try:
                return getattr(temp, method)(self.model, *args, **kwargs)
            finally:
                if temp.last_setup is not None and temp.last_setup[0] is self.model:
                    self.setup = temp.last_setup

    def __exit__(self, *exc: Any) -> None:
        rt = self.trainer.runtime
        if self.setup is not None and self.setup[0] is self.model:
            self.trainer.last_setup = self.setup
        attach_trainer(self.model, self.trainer)  # model.trainer: the user's again
        rt.precision.load_state_dict(self._precision)
        set_rng_state(self._rng)
        rt.barrier()
        if rt.is_rank_zero and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
