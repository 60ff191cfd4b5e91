"""``BaseFinetuning``: freeze modules before training and unfreeze them later into new parameter groups, with the
API of Lightning's ``lightning/pytorch/callbacks/finetuning.py``."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Iterator, Union

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from trainscale.callbacks.base import Callback

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer

Modules = Union[nn.Module, Iterable]  # a module, or (nested) iterables of modules


class BaseFinetuning(Callback):
    """Subclass it and override :meth:`freeze_before_training` (called in :meth:`setup`, before the model is wrapped
    and before ``configure_optimizers``: build the optimizer from ``filter(lambda p: p.requires_grad,
    self.parameters())``) and :meth:`finetune_function` (called at every ``on_train_epoch_start`` with each
    optimizer; unfreeze there with :meth:`unfreeze_and_add_param_group`)::

        class Unfreeze(BaseFinetuning):
            def freeze_before_training(self, pl_module):
                self.freeze(pl_module.backbone)

            def finetune_function(self, pl_module, current_epoch, optimizer):
                if current_epoch == 2:
                    self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, train_bn=True)

    One data-parallel rank only: torch's DDP registers the parameters that require gradients when it wraps the
    model, so parameters unfrozen later would never be all-reduced and each rank would train its own copy (refused
    in :meth:`setup`, naming the workaround). A fit resumed after the unfreeze fails in the optimizer's
    ``load_state_dict`` (torch refuses a different number of parameter groups): the checkpoint's optimizer state is
    loaded before the callbacks run, where Lightning rebuilds the groups first.
    """

    def setup(self, trainer: Trainer, module: Any, stage: str) -> None:
        """Freeze (:meth:`freeze_before_training`), in every stage as Lightning's; a ``fit`` on one data-parallel
        rank only.

        Raises:
            ValueError: a ``fit`` on more than one data-parallel rank."""
        if stage == "fit" and trainer.runtime.data_parallel_size > 1:
            raise ValueError(f"{type(self).__name__} on {trainer.runtime.data_parallel_size} data-parallel ranks: DDP "
                             "registers the parameters that require gradients when it wraps the model, so the ones "
                             "unfrozen later would never be averaged across ranks; run it on one device, or set "
                             "requires_grad in your module before fit and train the stages as separate fits")
        self.freeze_before_training(module)

    def on_train_epoch_start(self, trainer: Trainer, module: Any) -> None:
        for optimizer in trainer.optimizers:
            self.finetune_function(module, trainer.current_epoch, optimizer)

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        """Override: unfreeze what epoch ``epoch`` trains (called at each epoch start, for each optimizer)."""
        raise NotImplementedError

    def freeze_before_training(self, pl_module: Any) -> None:
        """Override: freeze what the first epochs do not train."""
        raise NotImplementedError

    @staticmethod
    def flatten_modules(modules: Modules) -> list[nn.Module]:
        """The leaf modules of ``modules`` (and those holding parameters themselves)."""
        if isinstance(modules, nn.ModuleDict):
            modules = modules.values()
        if isinstance(modules, Iterable):
            every = [m for sub in modules for m in BaseFinetuning.flatten_modules(sub)]
        else:
            every = list(modules.modules())
        return [m for m in every if not list(m.children()) or m._parameters]

    @staticmethod
    def filter_params(modules: Modules, train_bn: bool = True, requires_grad: bool = True) -> Iterator[nn.Parameter]:
        """The parameters of ``modules`` whose ``requires_grad`` is ``requires_grad`` (BatchNorm's skipped with
        ``train_bn=False``)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and not train_bn:
                continue
            for param in module.parameters(recurse=False):
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Unfreeze ``modules`` (BatchNorm layers track running statistics again)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for param in module.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        """Freeze one module's own parameters (a BatchNorm stops tracking running statistics)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze ``modules``; with ``train_bn`` their BatchNorm layers stay trainable."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(module)
            else:
                BaseFinetuning.freeze_module(module)

    @staticmethod
    def filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable) -> list:
        """``params`` without those ``optimizer`` already holds (with a warning naming the usual cause)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = list(params)
        kept = [p for p in params if id(p) not in held]
        if len(kept) < len(params):
            warnings.warn("The provided params to be frozen already exist within another group of this optimizer. "
                          "Those parameters will be skipped.\nHINT: Did you init your optimizer in "
                          "`configure_optimizer` as such:\n"
                          f" {type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) ",
                          stacklevel=2)  # Lightning's words
        return kept

    @staticmethod
    def unfreeze_and_add_param_group(modules: Modules, optimizer: torch.optim.Optimizer, lr: float | None = None,
                                     initial_denom_lr: float = 10.0, train_bn: bool = True) -> None:
        """Unfreeze ``modules`` and add their parameters to ``optimizer`` as a new group, at ``lr`` or (None) the
        first group's learning rate ÷ ``initial_denom_lr``."""
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_on_optimizer(
            optimizer, BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True))
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom})

