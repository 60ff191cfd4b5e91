"""Lightning's ``BackboneFinetuning``: a frozen ``backbone`` unfrozen at an epoch, its learning rate then raised."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from trainscale.utilities.rank_zero import log_info
from trainscale.callbacks.finetuning import BaseFinetuning

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer

log = logging.getLogger(__name__)


def multiplicative(epoch: int) -> float:
    """Lightning's default ``lambda_func``: the backbone's learning rate doubles every epoch."""
    return 2.0


class BackboneFinetuning(BaseFinetuning):
    """``BackboneFinetuning(unfreeze_backbone_at_epoch=10, lambda_func=multiplicative, backbone_initial_ratio_lr=0.1,
    backbone_initial_lr=None, should_align=True, initial_denom_lr=10.0, train_bn=True, verbose=False, rounding=12)``,
    as Lightning's ``callbacks.BackboneFinetuning``, for a module with an ``nn.Module`` attribute ``backbone``.

    The backbone is frozen before ``configure_optimizers`` (build the optimizer from the parameters that require
    gradients). At epoch ``unfreeze_backbone_at_epoch`` (0-based) it is unfrozen into a new parameter group at
    ``backbone_initial_lr`` (None: the first group's learning rate × ``backbone_initial_ratio_lr``); at each later
    epoch start that group's learning rate is multiplied by ``lambda_func(epoch + 1)``, and, with ``should_align``,
    held at the first group's once it would pass it. ``train_bn=False`` keeps the backbone's BatchNorm layers
    frozen. With ``verbose`` the two learning rates (rounded to ``rounding`` digits) are said at each step, at INFO
    through the ``trainscale.callbacks.backbone_finetuning`` logger where logging shows INFO, printed otherwise.
    ``initial_denom_lr`` is passed to ``unfreeze_and_add_param_group``, which, as Lightning's, uses it only without
    a learning rate. ``previous_backbone_lr`` is saved in checkpoints; the limits of ``BaseFinetuning`` hold (one
    data-parallel rank; a fit resumed after the unfreeze fails in the optimizer's ``load_state_dict``).

    Raises:
        ValueError: the module has no ``nn.Module`` ``backbone`` (Lightning's message; Lightning:
            ``MisconfigurationException``), at ``setup``, where the freeze happens.
    """

    def __init__(self, unfreeze_backbone_at_epoch: int = 10, lambda_func: Callable[[int], float] = multiplicative,
                 backbone_initial_ratio_lr: float = 10e-2, backbone_initial_lr: float | None = None,
                 should_align: bool = True, initial_denom_lr: float = 10.0, train_bn: bool = True,
                 verbose: bool = False, rounding: int = 12) -> None:
        self.unfreeze_backbone_at_epoch, self.train_bn = unfreeze_backbone_at_epoch, train_bn  # when, and what
        # the backbone's learning rate: where it starts, how it grows, where it stops
        self.backbone_initial_lr, self.backbone_initial_ratio_lr = backbone_initial_lr, backbone_initial_ratio_lr
        self.lambda_func, self.should_align, self.initial_denom_lr = lambda_func, should_align, initial_denom_lr
        self.verbose, self.rounding = verbose, rounding
        self.previous_backbone_lr: float | None = None

    def state_dict(self) -> dict:
        return {"previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state: dict) -> None:
        self.previous_backbone_lr = state["previous_backbone_lr"]

    def setup(self, trainer: Trainer, module: Any, stage: str) -> None:
        if not isinstance(getattr(module, "backbone", None), nn.Module):
            raise ValueError("The LightningModule should have a nn.Module `backbone` attribute")
        super().setup(trainer, module, stage)

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        """Unfreeze the backbone at ``unfreeze_backbone_at_epoch``; raise its learning rate at each later epoch."""
        current_lr = optimizer.param_groups[0]["lr"]
        if epoch == self.unfreeze_backbone_at_epoch:
            backbone_lr = (self.backbone_initial_lr if self.backbone_initial_lr is not None
                           else current_lr * self.backbone_initial_ratio_lr)
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, backbone_lr, train_bn=self.train_bn,
                                              initial_denom_lr=self.initial_denom_lr)
        elif epoch > self.unfreeze_backbone_at_epoch:
            backbone_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and backbone_lr > current_lr:
                backbone_lr = current_lr
            optimizer.param_groups[-1]["lr"] = backbone_lr
        else:
            return
        self.previous_backbone_lr = backbone_lr
        if self.verbose:
            log_info(log, f"Current lr: {round(current_lr, self.rounding)}, "
                          f"Backbone lr: {round(backbone_lr, self.rounding)}")
