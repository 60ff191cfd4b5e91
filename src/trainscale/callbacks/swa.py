"""Lightning's ``StochasticWeightAveraging``: an equal average of the weights of the last epochs, on torch's
``swa_utils`` (Izmailov et al., "Averaging Weights Leads to Wider Optima and Better Generalization", UAI 2018)."""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

from trainscale.callbacks.base import Callback
from trainscale.utilities.rank_zero import log_info
from trainscale.utilities.types import LRSchedulerConfig

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer

_STRATEGIES = ("single", "ddp", "dp")  # one whole replica per process (Lightning: all but FSDP and DeepSpeed)
_log = logging.getLogger(__name__)

class StochasticWeightAveraging(Callback):
    """``StochasticWeightAveraging(swa_lrs, swa_epoch_start=0.8, annealing_epochs=10, annealing_strategy="cos",
    avg_fn=None, device=torch.device("cpu"))``, as Lightning's ``callbacks.StochasticWeightAveraging``.

    From epoch ``swa_epoch_start`` (an int >= 1, counted from 1, or a fraction of ``max_epochs``: ``int(0.8 *
    max_epochs)``), at each epoch start up to the last epoch the weights are folded into torch's ``AveragedModel``
    (equal weights, or ``avg_fn(averaged, current, n_averaged)``), kept on ``device`` (None: the model's), and the
    optimizer's learning rate follows torch's ``SWALR`` towards ``swa_lrs`` (one float, or one per parameter group)
    over ``annealing_epochs`` ("cos" or "linear"), which replaces the module's scheduler, stepped every epoch. When
    the fit has run all its epochs (or runs without ``max_epochs``) the average is copied into the model at
    ``on_train_end``; a fit stopped earlier keeps its own weights, as Lightning's. ``n_averaged``: the updates so far
    (a tensor; None before the first). The average, the update count and the scheduler's state are saved in
    checkpoints (Lightning's keys) and restored on resume.

    Difference from Lightning: a module with BatchNorm layers gets its statistics recomputed by torch's ``update_bn``
    over the training loader at ``on_train_end`` (one pass of ``forward(batch[0])``, or ``forward(batch)`` for a
    batch that is not a list or tuple), where Lightning runs one extra epoch of ``training_step`` without backward;
    ``trainer.current_epoch`` stays ``max_epochs``.

    Raises:
        ValueError: ``swa_epoch_start``, ``swa_lrs``, ``avg_fn`` or ``device`` out of Lightning's ranges (its
            messages; Lightning: ``MisconfigurationException``); at ``setup``, a strategy other than "single", "ddp"
            or "dp" (sharded or split parameters: Lightning refuses FSDP and DeepSpeed); at ``on_fit_start``, more
            than one optimizer or scheduler, or a fractional ``swa_epoch_start`` without ``max_epochs``.
    """

    def __init__(self, swa_lrs: float | list[float], swa_epoch_start: int | float = 0.8, annealing_epochs: int = 10,
                 annealing_strategy: str = "cos", avg_fn: Callable[..., torch.Tensor] | None = None,
                 device: torch.device | str | None = torch.device("cpu")) -> None:
        _check_arguments(swa_lrs, swa_epoch_start, avg_fn, device)
        self._swa_epoch_start = swa_epoch_start
        self._swa_lrs = swa_lrs
        self._annealing_epochs = annealing_epochs
        self._annealing_strategy = annealing_strategy
        self._avg_fn = avg_fn
        self._device = device
        self._average: AveragedModel | None = None
        self._swa_scheduler: SWALR | None = None
        self._restored: dict | None = None  # a checkpoint's state, applied when the average is built
        self._latest_update_epoch = -1
        self._max_epochs = -1

    @property
    def n_averaged(self) -> torch.Tensor | None:
        """The updates folded into the average so far (a long tensor); None before the first."""
        return None if self._average is None else self._average.n_averaged

    @property
    def swa_start(self) -> int:
        """The first averaged epoch, 0-based (resolved at ``on_fit_start``)."""
        return max(int(self._swa_epoch_start) - 1, 0)

    @property
    def swa_end(self) -> float:
        """The last averaged epoch, 0-based (inf without ``max_epochs``)."""
        return float("inf") if self._max_epochs == -1 else self._max_epochs - 1

    @staticmethod
    def pl_module_contains_batch_norm(pl_module: nn.Module) -> bool:
        """Whether ``pl_module`` holds a BatchNorm layer, whose statistics ``on_train_end`` recomputes for the
        averaged weights (``torch.optim.swa_utils.update_bn``), as Lightning's."""
        return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in pl_module.modules())

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        rt = trainer.runtime
        name = rt.strategy.name if rt.strategy is not None else rt.config.strategy
        if name not in _STRATEGIES + ("auto", "ddp_spawn", "ddp_notebook"):
            raise ValueError(f"StochasticWeightAveraging does not support strategy={name!r}: its average is one whole "
                             f"copy of the model, which sharded or split parameters do not give; use one of "
                             f"{list(_STRATEGIES)} (Lightning: SWA does not currently support sharded models)")

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError("SWA currently works with 1 `optimizer`.")
        if len(trainer.lr_scheduler_configs) > 1:
            raise ValueError("SWA currently not supported for more than 1 `lr_scheduler`.")
        max_epochs = -1 if trainer.max_epochs is None else trainer.max_epochs
        if isinstance(self._swa_epoch_start, float):
            if max_epochs == -1:
                raise ValueError("SWA with `swa_epoch_start` as a float is not supported when `max_epochs=-1`. "
                                 "Please provide `swa_epoch_start` as an integer.")
            self._swa_epoch_start = int(max_epochs * self._swa_epoch_start)
        self._max_epochs = max_epochs

    def on_train_epoch_start(self, trainer: Trainer, pl_module: Any) -> None:
        epoch = trainer.current_epoch
        if not self.swa_start <= epoch <= self.swa_end:
            return
        if self._average is None:
            self._start(trainer, pl_module)
        if epoch > self._latest_update_epoch:
            self._average.update_parameters(pl_module)
            self._latest_update_epoch = epoch

    def _start(self, trainer: Trainer, pl_module: Any) -> None:
        """The average (a copy of the module on ``device``) and SWALR in place of the module's scheduler."""
        device = self._device or next(pl_module.parameters()).device
        # AveragedModel deep-copies the module, without its Trainer (TrainingModule.__getstate__)
        self._average = AveragedModel(pl_module, device=device, avg_fn=self._avg_fn)
        optimizer = trainer.optimizers[0]
        lrs = self._swa_lrs if isinstance(self._swa_lrs, list) else [self._swa_lrs] * len(optimizer.param_groups)
        for lr, group in zip(lrs, optimizer.param_groups):
            group["initial_lr"] = lr
        self._swa_scheduler = SWALR(optimizer, swa_lr=lrs, anneal_epochs=self._annealing_epochs,
                                    anneal_strategy=self._annealing_strategy,
                                    last_epoch=trainer.max_epochs if self._annealing_strategy == "cos" else -1)
        if self._restored is not None:
            self._average.module.load_state_dict(self._restored["average_model_state"])
            self._average.n_averaged.fill_(self._restored["n_averaged"])
            if self._restored["scheduler_state"] is not None:
                self._swa_scheduler.load_state_dict(self._restored["scheduler_state"])
        elif trainer.current_epoch != self.swa_start:
            warnings.warn("SWA is initializing after swa_start without any checkpoint data.", stacklevel=2)
        swa = LRSchedulerConfig(self._swa_scheduler)  # after every epoch, as Lightning's
        if trainer.schedulers:
            own = trainer.schedulers[0]
            if own.interval != "epoch" or own.frequency != 1:
                warnings.warn(f"SWA is currently only supported every epoch. Found {own}", stacklevel=2)
            if trainer.runtime.is_rank_zero:  # Lightning's rank_zero_info
                log_info(_log, f"Swapping scheduler `{type(own.scheduler).__name__}` for `SWALR`")
            trainer.schedulers[0] = swa
        else:
            trainer.schedulers.append(swa)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        if self._average is None or not (trainer.current_epoch - 1 == self.swa_end or self._max_epochs == -1):
            return
        for averaged, own in zip(self._average.module.parameters(), pl_module.parameters()):
            own.detach().copy_(averaged.to(own.device))
        if self.pl_module_contains_batch_norm(pl_module):
            device = next(pl_module.parameters()).device
            update_bn(trainer._fit.train_loader, pl_module, device=device)

    def state_dict(self) -> dict:
        return {"n_averaged": 0 if self.n_averaged is None else int(self.n_averaged),
                "latest_update_epoch": self._latest_update_epoch,
                "scheduler_state": None if self._swa_scheduler is None else self._swa_scheduler.state_dict(),
                "average_model_state": None if self._average is None else self._average.module.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._latest_update_epoch = state["latest_update_epoch"]
        self._restored = state if state["average_model_state"] is not None else None


def _check_arguments(swa_lrs: Any, swa_epoch_start: Any, avg_fn: Any, device: Any) -> None:
    """Lightning's checks of the constructor's arguments, with its messages."""
    if (isinstance(swa_epoch_start, int) and swa_epoch_start < 1) or (
            isinstance(swa_epoch_start, float) and not 0 <= swa_epoch_start <= 1):
        raise ValueError("swa_epoch_start should be a >0 integer or a float between 0 and 1.")
    lrs = swa_lrs if isinstance(swa_lrs, list) else [swa_lrs]
    if not all(isinstance(lr, float) and lr > 0 for lr in lrs):
        raise ValueError("The `swa_lrs` should a positive float, or a list of positive floats")
    if avg_fn is not None and not callable(avg_fn):
        raise ValueError("The `avg_fn` should be callable.")
    if device is not None and not isinstance(device, (torch.device, str)):
        raise ValueError(f"device is expected to be a torch.device or a str. Found {device}")
