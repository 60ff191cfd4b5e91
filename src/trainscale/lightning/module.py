"""The model contract: a plain ``nn.Module`` + loss, or a Lightning-style :class:`TrainingModule`.

A LightningModule ports by changing its base class and import::

    from trainscale import TrainingModule          # was: from lightning import LightningModule

    class LitMNIST(TrainingModule):
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss, prog_bar=True)
            return loss                                 # or {"loss": loss, ...}

:class:`LoopModule` puts the step inside ``forward`` so that DDP and FSDP see the whole training
step, whichever kind the user gave.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from trainscale.runtime import hf
from trainscale.runtime.batch import batch_size, to_device
from trainscale.lightning.hparams import HyperparametersMixin, checkpoint_init_kwargs
from trainscale.lightning.metrics import check_loggable, is_metric
from trainscale.lightning.optimizers import lr_scheduler_step

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer
    from trainscale.runtime.runtime import Runtime


# Lightning's LightningModule hooks the Trainer calls (``lightning.pytorch.core.hooks.ModelHooks``, and the
# checkpoint hooks of ``CheckpointHooks``), each right after the callbacks' hook of the same name.
MODULE_HOOKS = (
    "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end",
    "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad",
    *(f"on_{stage}_{point}" for stage in ("validation", "test", "predict")
      for point in ("start", "end", "epoch_start", "epoch_end", "batch_start", "batch_end")),
    "on_save_checkpoint", "on_load_checkpoint",
)
# Lightning's hooks that move each batch to the device (``core/hooks.py`` ``DataHooks``), in the order it calls them
# (``LightningModule._on_before_batch_transfer``, ``_apply_batch_transfer_handler``); a data module's own win
BATCH_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
# Lightning's hooks that set the module's mode for an evaluation, by stage: (before it, after it); predict has no
# "after" hook (its modes are always put back)
MODE_HOOKS = {"validation": ("on_validation_model_eval", "on_validation_model_train"),
              "test": ("on_test_model_eval", "on_test_model_train"), "predict": ("on_predict_model_eval", None)}
# Every hook of Lightning 2.6's LightningModule that a user may override: ``core/hooks.py`` (``ModelHooks``,
# ``DataHooks``, ``CheckpointHooks``) and the overridable methods of ``core/module.py``
LIGHTNING_HOOKS = (
    *MODULE_HOOKS, "on_validation_model_zero_grad", *(h for pair in MODE_HOOKS.values() for h in pair if h),
    "configure_sharded_model", "configure_model", "prepare_data", "setup", "teardown", "train_dataloader",
    "val_dataloader", "test_dataloader", "predict_dataloader", *BATCH_TRANSFER_HOOKS,
    "training_step", "validation_step", "test_step", "predict_step", "configure_callbacks", "configure_optimizers",
    "backward", "configure_gradient_clipping", "lr_scheduler_step", "optimizer_step", "optimizer_zero_grad",
)
# The one list of those trainscale calls: a module overriding any other hook is warned (``uncalled_hooks``). It holds
# all of them; a hook added to LIGHTNING_HOOKS without a call in the loops is warned of until one is written
CALLED_HOOKS = frozenset(LIGHTNING_HOOKS)


class TrainingModule(HyperparametersMixin, nn.Module):
    """Optional base class with Lightning's ``LightningModule`` API (the parts trainscale runs).

    Define ``training_step(batch, batch_idx)`` (returning the loss, or a dict with ``"loss"``),
    ``configure_optimizers()`` (any of Lightning's return forms, see ``trainscale.lightning.optimizers``)
    and optionally ``validation_step``/``test_step``/``predict_step(batch, batch_idx)``. Set
    ``automatic_optimization = False`` to step optimizers yourself (``self.optimizers()``,
    ``self.manual_backward(loss)``). Attributes set by the Trainer during ``fit``: ``trainer``,
    ``global_rank``, ``current_epoch``, ``global_step``, ``device``, ``logger``, ``loggers``. ``self.save_hyperparameters()`` in
    ``__init__`` keeps its arguments in ``self.hparams`` (``trainscale.lightning.hparams``).

    Lightning's hooks (``on_fit_start``, ``on_train_batch_end(outputs, batch, batch_idx)``,
    ``on_before_optimizer_step(optimizer)``, ``on_validation_epoch_end``, ``on_save_checkpoint(checkpoint)``, ...:
    :data:`MODULE_HOOKS`) are called where and in the order Lightning calls them, after the callbacks' hook of
    the same name (docs/lightning.md). Only hooks the module defines are called.
    """

    automatic_optimization: bool = True
    _jit_is_scripting = False  # True inside to_torchscript: ``trainer`` is then None on a detached module

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError("define training_step(self, batch, batch_idx) returning the loss")

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's output on the whole batch, ``self(batch)``: Lightning's default ``predict_step`` (the batch
        is the first argument, or the ``batch=`` keyword). Override it to unpack the batch (``x, _ = batch``) or to
        predict otherwise; ``super().predict_step(batch, batch_idx)`` calls this one."""
        batch = kwargs["batch"] if "batch" in kwargs else args[0]
        return self(batch)

    def freeze(self) -> TrainingModule:
        """Every parameter ``requires_grad=False`` and the module in eval mode, for inference (Lightning's
        ``freeze``); returns the module."""
        for param in self.parameters():
            param.requires_grad = False
        return self.eval()

    def unfreeze(self) -> TrainingModule:
        """Every parameter ``requires_grad=True`` and the module in training mode (Lightning's ``unfreeze``);
        returns the module."""
        for param in self.parameters():
            param.requires_grad = True
        return self.train()

    def configure_optimizers(self) -> Any:
        raise NotImplementedError("define configure_optimizers(self) returning an optimizer (or pass optimizer=...)")

    @torch.no_grad()
    def to_torchscript(self, file_path: str | os.PathLike | None = None, method: str | None = "script",
                       example_inputs: Any = None, **kwargs: Any) -> Any:
        """The module compiled by TorchScript, in eval mode (its mode is put back after), as Lightning's
        ``to_torchscript``: ``method="script"`` (``torch.jit.script(self)``, the default) or ``"trace"``
        (``torch.jit.trace`` on ``example_inputs``, else :attr:`example_input_array`, moved to the module's device
        through the batch-transfer hooks); ``kwargs`` go to that function; ``file_path``: also written there with
        ``torch.jit.save``. TorchScript is deprecated (torch 2.13's ``torch.jit`` functions warn
        ``DeprecationWarning``; Lightning 2.7 deprecates this method): export with ``torch.export.export(model,
        args)`` where you can. The module's properties are left out of a script (:attr:`__jit_unused_properties__`).

        Returns:
            A ``torch.jit.ScriptModule``.

        Raises:
            ValueError: ``method`` is neither "script" nor "trace", or "trace" without ``example_inputs`` nor
                ``example_input_array`` (Lightning's messages).
        """
        warnings.warn("`to_torchscript` is deprecated, as Lightning's `LightningModule.to_torchscript` (in v2.7): "
                      "TorchScript is deprecated in PyTorch. Use `torch.export.export()` for model exporting "
                      "instead. See https://pytorch.org/docs/stable/export.html for more information.",
                      DeprecationWarning, stacklevel=3)  # 3: past torch.no_grad's wrapper, the caller
        if method not in ("script", "trace"):
            raise ValueError(f"The 'method' parameter only supports 'script' or 'trace', but value given was: {method}")
        if method == "trace" and example_inputs is None and self.example_input_array is None:
            raise ValueError("Choosing method=`trace` requires either `example_inputs` or `model.example_input_array` "
                             "to be defined.")
        mode = self.training
        with _jit_scripting():
            if method == "script":
                compiled = torch.jit.script(self.eval(), **kwargs)
            else:
                to_device = functools.partial(self._transferred, device=self.device)
                if kwargs.get("check_inputs") is not None:
                    kwargs["check_inputs"] = to_device(kwargs["check_inputs"])
                inputs = to_device(self.example_input_array if example_inputs is None else example_inputs)
                compiled = torch.jit.trace(func=self.eval(), example_inputs=inputs, **kwargs)
        self.train(mode)
        if file_path is not None:
            torch.jit.save(compiled, os.fspath(file_path))
        return compiled

    def _transferred(self, batch: Any, device: torch.device) -> Any:
        """``batch`` through the module's batch-transfer hooks onto ``device``, as for a loader's batch."""
        batch = self.on_before_batch_transfer(batch, 0)
        return self.on_after_batch_transfer(self.transfer_batch_to_device(batch, device, 0), 0)

    # -- Lightning's hooks with a default that does the work (the Trainer calls an override instead) -------------
    def configure_callbacks(self) -> Any:
        """Lightning's hook, at the start of every stage, before ``setup``: a callback or a list of them for this
        module. Each replaces the Trainer's callbacks of its type (or a parent type); ``ModelCheckpoint`` ones run
        last (``trainscale.callbacks.merge_model_callbacks``). Default: none."""
        return []

    def configure_model(self) -> None:
        """Lightning's hook, in every stage right after ``setup(stage)`` and before the strategy wraps or shards the
        model: build layers here (under fsdp each rank then shards them as they are made part of the model). Called
        in every stage of the same process, so make it idempotent (return when the layers exist), as Lightning asks.
        Default: nothing."""

    def prepare_data(self) -> None:
        """Lightning's hook, at the start of every stage, before ``setup``: once per node (local rank 0) while the
        other ranks wait; download or write files here, assign no state. Default: nothing."""

    def setup(self, stage: str) -> None:
        """Lightning's hook, on every rank at the start of a stage ("fit", "validate", "test" or "predict"), after the
        callbacks' ``setup`` and before ``configure_model``. Default: nothing (``super().setup(stage)`` may be
        called)."""

    def teardown(self, stage: str) -> None:
        """Lightning's hook, on every rank once a stage has ended normally, after the callbacks' ``teardown``.
        Default: nothing."""

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Lightning's hook, on every batch of every stage before it goes to the device (on the host; after the
        precision's input cast): return the batch, changed or not. Default: the batch as it is."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Lightning's hook: ``batch`` on ``device``, returned. Default: every tensor of the nested batch moved
        (``trainscale.runtime.batch.to_device``; asynchronously on CUDA). Override it for a batch type it does not
        know."""
        return to_device(batch, device, non_blocking=device.type == "cuda")

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Lightning's hook, on every batch once it is on the device, before ``on_train_batch_start`` (or the
        stage's): return the batch (a GPU augmentation here). Default: the batch as it is."""
        return batch

    def on_validation_model_zero_grad(self) -> None:
        """Lightning's hook, before each validation in ``fit``: free the gradients (the last optimizer step's, kept
        until the next step's first micro-batch, as in Lightning). Override it to keep them through validation."""
        self.zero_grad()

    def on_validation_model_eval(self) -> None:
        """Lightning's hook, before ``on_validation_start``: eval mode (the default). Override it to keep some layers
        in training mode (dropout on, for Monte Carlo dropout)."""
        self.trainer.model.eval()

    def on_validation_model_train(self) -> None:
        """Lightning's hook, after ``on_validation_end``: an override runs in place of the Trainer's default, which
        puts every submodule back in the mode it had (this method, reached through ``super()``, calls ``train()``)."""
        self.trainer.model.train()

    def on_test_model_eval(self) -> None:
        """Lightning's hook, before ``on_test_start``: eval mode (the default)."""
        self.trainer.model.eval()

    def on_test_model_train(self) -> None:
        """Lightning's hook, after ``on_test_end``; as :meth:`on_validation_model_train`."""
        self.trainer.model.train()

    def on_predict_model_eval(self) -> None:
        """Lightning's hook, before ``on_predict_start``: eval mode (the default). Each submodule's mode is put back
        after ``on_predict_end``."""
        self.trainer.model.eval()

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | os.PathLike, map_location: Any = None,
                             strict: bool | None = None, verify: bool = True, weights_only: bool | None = None,
                             **overrides: Any) -> TrainingModule:
        """The module rebuilt from a checkpoint, as Lightning's ``LightningModule.load_from_checkpoint``
        (``lightning.pytorch.core.saving._load_from_checkpoint``): ``cls(**hyper_parameters, **overrides)``, the
        hyperparameters those ``save_hyperparameters()`` kept (saved in every checkpoint under
        "hyper_parameters"; ``cls(config=hyper_parameters)`` when they came in one container, ``config``, that
        ``save_hyperparameters(config)`` kept: ``lightning.hparams.checkpoint_init_kwargs``), then its
        ``on_load_checkpoint(checkpoint)`` (the checkpoint's entries, the weights under ``state_dict``: a change
        it makes there is what is loaded, as in Lightning) and the weights.
        Works in one plain process, without a process group, on a checkpoint file of a single/ddp run and on a
        sharded (DCP) directory of an fsdp/model_parallel run, whatever its world size (every shard is read:
        ``dcp_checkpoint.read_whole``). As in Lightning, arguments ``__init__`` does not take are dropped (unless it
        takes ``**kwargs``), and the module is returned in training mode: call ``.eval()`` for inference.

        Args:
            checkpoint_path: ``<run>/checkpoints/epoch=E-step=S.ckpt`` (a file or a sharded directory) or ``last.ckpt``;
                or an ``http(s)://`` URL of a checkpoint file, downloaded into torch hub's cache as Lightning's
                (``torch.hub``'s rule: a file of that name there is read without downloading again;
                ``checkpointer.local_checkpoint``).
            map_location: where the weights go, in any form of ``torch.load``'s ``map_location`` (Lightning's
                argument): a device or its name ("cuda:0"), a dict from the locations the checkpoint was saved
                from to new ones (``{"cuda:1": "cuda:0"}``), or ``f(storage, location)`` returning a storage (or
                None: where it was saved). The module is moved to the device of its first weight, as Lightning.
                None: the CPU (Lightning keeps a GPU checkpoint on that GPU when there is one).
            strict: the weights' names must match the module's exactly (``nn.Module.load_state_dict``); None (the
                default): the module's :attr:`strict_loading` (True unless it sets it False), as Lightning's.
            verify: check the SHA-256 recorded at the save (refuses a file whose bytes differ from it; a file that
                records none, one loaded, edited and saved back with plain ``torch.save``, is read unverified with
                a warning, as Lightning reads any file).
            weights_only: Lightning's argument. trainscale's checkpoints hold only tensors, plain values and bytes,
                so they are always read with ``torch.load(weights_only=True)``, which runs no pickled code; the
                hyperparameters of other types (a module, a file system object) are kept apart, pickled into
                bytes, and ``weights_only=False`` unpickles them into ``__init__``'s arguments too, as Lightning's
                ``weights_only=False`` load: only for a checkpoint you trust. None or True: they are left out (pass
                them), as ``torch.load``'s default since torch 2.6. What an ``on_save_checkpoint`` hook or a
                callback's state saved that a weights-only load refuses is kept apart likewise: ``weights_only=False``
                unpickles it into the checkpoint ``on_load_checkpoint`` sees; without it a module that defines
                ``on_load_checkpoint`` is refused such a checkpoint (``CheckpointError``).
            overrides: arguments for ``__init__`` that replace the saved ones (or give those not saved).

        Raises:
            FileNotFoundError: no such checkpoint.
            ValueError: a URL other than ``http(s)://`` (``s3://``: copy the file and pass its local path).
            urllib.error.URLError: the download of a URL failed.
            TypeError: a ``map_location`` of another type.
            CheckpointError: not a trainscale checkpoint, a failed checksum; pickled entries for a module with
                ``on_load_checkpoint`` without ``weights_only=False``.
            TypeError: ``__init__`` needs arguments the checkpoint does not hold (named, with why).
            RuntimeError: ``strict`` and the weights' names do not match the module's.
        """
        from trainscale.checkpointing.checkpointer import read_module_checkpoint, restore_pickled

        if not (map_location is None or isinstance(map_location, (str, torch.device, dict)) or callable(map_location)):
            raise TypeError(f"map_location={map_location!r}; pass a device or its name ('cuda:0'), a dict such as "
                            "{'cuda:1': 'cuda:0'}, a function (storage, location) -> storage, or None (the CPU)")
        entries, read_model = read_module_checkpoint(checkpoint_path, verify, map_location or "cpu")
        module = cls(**checkpoint_init_kwargs(cls, entries, overrides, weights_only, checkpoint_path))
        state = read_model()
        if "on_load_checkpoint" in defined_hooks(module):  # as Lightning's: it sees, and may change, the weights
            checkpoint = {**entries, "state_dict": state}
            restore_pickled(checkpoint, weights_only, checkpoint_path)
            module.on_load_checkpoint(checkpoint)
            state = checkpoint["state_dict"]
        # Lightning (core/saving.py): the module goes where map_location put its first weight (moved before the
        # load here, so that each weight is copied once, on its device)
        device = next((t.device for t in state.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))
        module.to(device).load_state_dict(state, strict=module.strict_loading if strict is None else strict)
        return module

    # -- what the Trainer attached -------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The module's state for ``pickle``, ``torch.save(model)`` and ``copy.deepcopy`` without the Trainer it is
        attached to (as Lightning's ``LightningModule.__getstate__``): a copy or a loaded pickle is detached."""
        state = dict(self.__dict__)
        state.pop("_trainer", None)
        return state

    @property
    def trainer(self) -> Trainer:
        """The Trainer running this module (Lightning's ``self.trainer``).

        Raises:
            RuntimeError: the module is not attached to a Trainer (read it inside ``fit``/``validate``/...)."""
        trainer = self.__dict__.get("_trainer")
        if trainer is None and not self._jit_is_scripting:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer; call it inside trainer.fit()")
        return trainer

    @trainer.setter
    def trainer(self, trainer: Trainer | None) -> None:
        """Attach the module to ``trainer`` (None detaches it), as Lightning's ``model.trainer = trainer``; the
        Trainer attaches it itself in ``fit``/``validate``/``test``/``predict``."""
        if trainer is None:
            self.__dict__.pop("_trainer", None)
        else:
            self.__dict__["_trainer"] = trainer

    @property
    def strict_loading(self) -> bool:
        """Lightning's attribute: whether :meth:`load_from_checkpoint` (without ``strict=``) requires the weights'
        names to match the module's exactly; True unless set False (a module that saves only some weights, such as
        adapters, sets ``self.strict_loading = False``)."""
        return self.__dict__.get("_strict_loading") in (None, True)

    @strict_loading.setter
    def strict_loading(self, strict: bool) -> None:
        self.__dict__["_strict_loading"] = strict

    @property
    def example_input_array(self) -> Any:
        """Lightning's attribute: an example input of ``forward`` (a tensor, a tuple of positional inputs or a dict of
        keyword inputs) that the module sets for tools to use; None until set."""
        return self.__dict__.get("_example_input_array")

    @example_input_array.setter
    def example_input_array(self, example: Any) -> None:
        self.__dict__["_example_input_array"] = example

    # Lightning's: 0 when no Trainer is attached (a forward or a hook called outside fit, after load_from_checkpoint)
    @property
    def global_rank(self) -> int:
        """This process's rank in the job (0 .. world size - 1); 0 without a Trainer."""
        trainer = self.__dict__.get("_trainer")
        return trainer.runtime.rank if trainer is not None else 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (Lightning's ``self.local_rank``); 0 without a Trainer."""
        trainer = self.__dict__.get("_trainer")
        return trainer.local_rank if trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        """The Trainer's ``current_epoch``; 0 without a Trainer."""
        trainer = self.__dict__.get("_trainer")
        return trainer.current_epoch if trainer is not None else 0

    @property
    def global_step(self) -> int:
        """The Trainer's ``global_step`` (optimizer steps taken); 0 without a Trainer."""
        trainer = self.__dict__.get("_trainer")
        return trainer.global_step if trainer is not None else 0

    @property
    def device(self) -> torch.device:
        """The Trainer's device during fit/validate/test/predict; outside a Trainer (after
        ``load_from_checkpoint``), where the parameters are (the CPU without any), as Lightning's ``self.device``."""
        trainer = self.__dict__.get("_trainer")
        if trainer is not None:
            return trainer.runtime.device
        return next((p.device for p in self.parameters()), torch.device("cpu"))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the module's floating-point parameters (the first one's; ``torch.get_default_dtype()``
        without any), as Lightning's ``self.dtype`` after ``.to(dtype)``, ``.half()`` or ``.double()``."""
        return next((p.dtype for p in self.parameters() if p.is_floating_point()), torch.get_default_dtype())

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every rank's ``data`` (a tensor of the same shape on each rank, an int or float, or a dict, list or tuple
        of them, nested), each tensor stacked to shape ``(world_size, *shape)`` by ``trainer.strategy.all_gather``;
        unchanged without a process group (one process), as Lightning's ``self.all_gather``. A collective: every rank
        calls it. ``sync_grads``: the gather is differentiable (each rank's tensor gets its slice's gradients summed
        over the ranks)."""
        strategy = self.trainer.strategy
        device = self.device

        def gather(value: Any) -> Any:
            if isinstance(value, Mapping):
                gathered = {k: gather(v) for k, v in value.items()}
                return gathered if type(value) is dict else type(value)(gathered)
            if isinstance(value, (list, tuple)):
                items = [gather(v) for v in value]
                return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = torch.tensor(value, device=device)
            return strategy.all_gather(value, group, sync_grads) if isinstance(value, torch.Tensor) else value

        return gather(data)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Python's ``print(*args, **kwargs)`` on global rank zero only (also without a Trainer), as Lightning's
        ``self.print``."""
        trainer = self.__dict__.get("_trainer")
        if trainer is None or trainer.is_global_zero:
            print(*args, **kwargs)

    @property
    def on_gpu(self) -> bool:
        """True on a CUDA device (Lightning's ``on_gpu``)."""
        return self.device.type == "cuda"

    @property
    def loggers(self) -> list:
        """The Trainer's loggers (``trainscale.loggers``; empty with ``logger=False``, and on a module no Trainer is
        attached to), as Lightning's ``self.loggers``."""
        trainer = self.__dict__.get("_trainer")
        return [] if trainer is None else list(trainer.loggers)

    @property
    def logger(self) -> Any:
        """The first of :attr:`loggers`, or None (also on a module no Trainer is attached to), as Lightning's
        ``self.logger``."""
        return next(iter(self.loggers), None)

    # -- logging ---------------------------------------------------------------------------------
    def log(self, name: str, value: Any, *, on_step: bool | None = None, on_epoch: bool | None = None,
            prog_bar: bool = False, sync_dist: bool = False, reduce_fx: Any = "mean",
            batch_size: int | None = None, logger: bool = True, add_dataloader_idx: bool = True,
            metric_attribute: str | None = None) -> None:
        """Log a scalar, as Lightning's ``self.log``.

        In ``training_step`` the default is ``on_step=True, on_epoch=False``; in validation and test
        ``on_step=False, on_epoch=True``. Epoch values are always reduced over all ranks, each sample
        counted once (``reduce_fx="mean"`` weights each value by its micro-batch's sample count or
        ``batch_size``); step values are each rank's, reduced over ranks with ``reduce_fx`` with ``sync_dist=True``.
        Both on_step and on_epoch: recorded as ``name_step`` and ``name_epoch`` (``trainer.callback_metrics``
        also holds ``name``, the latest of the two, as Lightning's). ``reduce_fx``: "mean", "sum", "max", "min"
        (any case; "avg"), or ``torch.mean``/``torch.sum``/``torch.max``/``torch.min`` and the builtins ``sum``,
        ``max``, ``min``. Step values reach ``trainer.callback_metrics`` after every optimizer step (as device
        tensors; outside a fit at once); nothing is read from the device until a record is written (log intervals,
        epoch ends).
        ``value`` may be a torchmetrics ``Metric`` (extra ``metrics``), as in Lightning: the step value is its last
        ``forward``'s batch value, the epoch value its ``compute()`` over every rank, and it is reset after the
        epoch's end hooks (``reduce_fx`` and ``sync_dist`` do not apply to it). ``prog_bar=True`` puts it in
        ``trainer.progress_bar_metrics`` (and the bar), ``logger=True`` (the default) in ``trainer.logged_metrics``
        (``logger=False`` still records it in ``metrics.jsonl`` and the loggers). While one of several evaluation
        loaders runs, the name is recorded as ``name/dataloader_idx_N`` (N: the loader's index), unless
        ``add_dataloader_idx=False`` (then give each loader's values their own name), as in Lightning. Under
        ``Trainer(barebones=True)`` nothing is logged, with Lightning's warning, and so on a module no Trainer is
        attached to (a ``training_step`` called by hand in a unit test), as Lightning. A ``Metric`` must be an
        attribute of the module (a submodule, found by ``named_modules`` once), or be named by ``metric_attribute``,
        as Lightning requires.

        Raises:
            ValueError: an unknown ``reduce_fx``, a value that is not a number, a tensor or a torchmetrics
                ``Metric`` (None, a string, a list, a dict), a tensor of more than one element, a name with
                ``/dataloader_idx_`` (unless ``add_dataloader_idx=False``), one name logged with
                ``add_dataloader_idx=False`` in two evaluation loaders, a name every record holds ("step",
                "epoch", "kind", "rank", "time"); at the epoch end, names logged on some ranks only; as Lightning,
                ``on_step=False`` with ``on_epoch=False``, a call from a hook where Lightning refuses it
                (a callback's ``setup``, ``configure_optimizers``, ``on_fit_start``, ``on_train_end``,
                ``on_save_checkpoint``, the predict hooks, ...) and
                ``on_step=True`` in an epoch hook (``on_train_epoch_end``, ``on_validation_epoch_start``, ...);
                a ``Metric`` that is not one of the module's attributes, without ``metric_attribute`` (Lightning's
                words, naming the attributes that are); a name logged in one hook with other options than before.
        """
        trainer = self.__dict__.get("_trainer")
        if trainer is None:  # Lightning's rule: a step method may be tested without a Trainer
            check_loggable(name, value, add_dataloader_idx=False)
            warnings.warn("You are trying to `self.log()` but the `self.trainer` reference is not registered on the "
                          "model yet. This is most likely because the model hasn't been passed to the `Trainer`",
                          UserWarning, stacklevel=2)
            return
        if metric_attribute is None and is_metric(value):
            self._check_metric_attribute(name, value)
        if trainer.config.barebones:  # Lightning's rule: logging is off in barebones mode
            warnings.warn("You are trying to `self.log()` but `Trainer(barebones=True)` is configured. Logging can "
                          "impact raw speed so it is disabled under this setting.", UserWarning, stacklevel=2)
            return
        trainer.metric_collector.log(name, value, on_step=on_step, on_epoch=on_epoch, prog_bar=prog_bar,
                                     sync_dist=sync_dist, reduce_fx=reduce_fx, batch_size=batch_size, logger=logger,
                                     hook=trainer.running_hook, add_dataloader_idx=add_dataloader_idx)

    def _check_metric_attribute(self, name: str, metric: Any) -> None:
        """Raises Lightning's ``ValueError`` (its ``MisconfigurationException``) when ``metric`` is not one of the
        module's ``Metric`` submodules (found by ``named_modules`` and kept, as Lightning's ``_metric_attributes``;
        looked for again when ``metric`` is not among those kept)."""
        found = self.__dict__.get("_metric_attributes") or {}
        if id(metric) in found:
            return
        # not among those found before: look again (a Metric added since, a copied module)
        found = self.__dict__["_metric_attributes"] = {id(m): n for n, m in self.named_modules() if is_metric(m)}
        if not found:
            raise ValueError("Could not find the `LightningModule` attribute for the `torchmetrics.Metric` logged. "
                             "You can fix this by setting an attribute for the metric in your `LightningModule`.")
        if id(metric) not in found:
            raise ValueError("Could not find the `LightningModule` attribute for the `torchmetrics.Metric` logged. You "
                             f"can fix this by calling `self.log({name}, ..., metric_attribute=name)` where `name` is "
                             f"one of {list(found.values())}")

    def log_dict(self, metrics: Mapping[str, Any], **kwargs: Any) -> None:
        """``self.log`` for each item of ``metrics`` with the same keyword arguments. A torchmetrics
        ``MetricCollection`` is read as Lightning reads it: its metrics under their prefixed names, and with compute
        groups on, sharing one state (``items(copy_state=False)``), not each given a copy."""
        torchmetrics = sys.modules.get("torchmetrics")  # a MetricCollection exists only once it is imported
        if torchmetrics is not None and isinstance(metrics, torchmetrics.MetricCollection):
            items = metrics.items(keep_base=False, copy_state=not metrics._enable_compute_groups)
        else:
            items = metrics.items()
        for name, value in items:
            self.log(name, value, **kwargs)

    # -- manual optimization -----------------------------------------------------------------------
    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The optimizer (a list when there are several; ``[]`` before ``fit`` builds them) from
        ``configure_optimizers``, as Lightning's ``self.optimizers()``. Under manual optimization, wrapped so that
        ``step()`` synchronises gradients across ranks (``trainscale.lightning.optimizers.ManualOptimizer``;
        ``use_pl_optimizer=False``: the torch optimizer inside). Under automatic optimization, the torch optimizer
        the Trainer steps (read its ``param_groups`` or state; the Trainer steps it)."""
        manual = self.trainer.manual_optimizers
        opts = ([m if use_pl_optimizer else m.optimizer for m in manual] if manual
                else list(self.trainer.optimizers))
        return opts[0] if len(opts) == 1 else opts

    def lr_schedulers(self) -> Any:
        """The scheduler (or list of them), None when there is none; step them yourself."""
        scheds = [s.scheduler for s in self.trainer.schedulers]
        return None if not scheds else scheds[0] if len(scheds) == 1 else scheds

    def manual_backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` through the Runtime (scaled under "16-mixed"). No communication under ddp
        (gradients are averaged in ``optimizer.step()``); under fsdp each sharded submodule reduce-scatters
        its gradients in this backward unless inside ``optimizer.toggle_model(sync_grad=False)``, after the ranks
        agree that each of them runs it (``trainscale.lightning.optimizers.BackwardAgreement``: a RuntimeError on
        every rank naming those that skipped it). As in Lightning, the ``on_before_backward(loss)`` and ``on_after_backward()`` hooks run around it."""
        trainer = self.trainer
        trainer._hook("on_before_backward", loss)
        agreement = trainer.manual_optimizers[0].agreement if trainer.manual_optimizers else None
        if agreement is not None:  # fsdp on several ranks: every rank's backward reduce-scatters together
            agreement.before_backward()
        trainer.runtime.precision.backward(loss, self.backward)  # the backward hook, as Lightning's strategy calls it
        trainer._hook("on_after_backward")

    def clip_gradients(self, optimizer: Any, gradient_clip_val: float | None = None,
                       gradient_clip_algorithm: str | None = None) -> torch.Tensor | None:
        """Clip the gradients of ``optimizer``'s parameters (Lightning's ``self.clip_gradients``), after
        the ranks' gradients are averaged; by their total norm over all shards under fsdp. None for either argument:
        the Trainer's ``gradient_clip_val`` (none: no clipping) / ``gradient_clip_algorithm``, as Lightning. Under
        manual optimization ``optimizer`` is one of ``self.optimizers()``
        (``trainscale.lightning.optimizers.ManualOptimizer.clip_gradients``); under automatic optimization the one
        ``configure_gradient_clipping`` receives. Returns the norm before clipping (a 0-d tensor), None for
        ``"value"`` or without a value.

        Raises:
            ValueError: a value other than the Trainer's where both are set (Lightning's "Please use only one of
                them"), or a bad value."""
        val, algorithm = _clip_settings(self.trainer.config, gradient_clip_val, gradient_clip_algorithm)
        if val is None:
            return None
        if hasattr(optimizer, "clip_gradients"):  # a ManualOptimizer: averages the ranks' gradients first
            return optimizer.clip_gradients(val, algorithm)
        return self.trainer.clip_gradients(optimizer, val, algorithm)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Lightning's hook, under automatic optimization, before each optimizer step (after
        ``on_before_optimizer_step``, on unscaled gradients) with the Trainer's ``gradient_clip_val`` and
        ``gradient_clip_algorithm``: :meth:`clip_gradients` with them. Override it to clip your own way."""
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning's hook: the backward of the training loss (÷ ``accumulate_grad_batches``, × the loss scale under
        "16-mixed"), between ``on_before_backward`` and ``on_after_backward``; also what :meth:`manual_backward`
        calls. ``loss.backward(*args, **kwargs)``; override it to change the backward."""
        loss.backward(*args, **kwargs)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Lightning's hook, under automatic optimization, for each scheduler of ``trainer.lr_scheduler_configs`` when
        its ``interval`` and ``frequency`` say it is due: ``scheduler.step()``, or ``scheduler.step(metric)`` where
        ``metric`` is the monitored value of a ``reduce_on_plateau`` one (``ReduceLROnPlateau``; None otherwise).
        Override it to step a scheduler that does not follow torch's ``LRScheduler`` API (without an override such
        a scheduler is a ``ValueError`` at ``fit``), e.g. ``scheduler.step(epoch=self.current_epoch)``."""
        lr_scheduler_step(scheduler, metric)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any,
                       optimizer_closure: Callable[[], Any] | None = None) -> None:
        """Lightning's hook, under automatic optimization, once per optimizer step (``batch_idx``: the step's last
        micro-batch): ``optimizer.step(closure=optimizer_closure)``. Override it to act around the step (a
        learning-rate warm-up) or to skip it. The closure runs ``on_before_optimizer_step`` and
        ``configure_gradient_clipping`` and returns the loss; call it, as Lightning requires (returning without
        running it is Lightning's ``ValueError``, "The closure hasn't been executed"). One difference: the
        step's forward and backward ran before this hook (Lightning runs them inside the closure), so the closure's
        first call returns that loss; each later call (an optimizer that evaluates the loss several times per step,
        such as ``torch.optim.LBFGS``) zeroes the gradients and runs ``training_step`` and the backward again first,
        as Lightning's; ``optimizer.step(...)``: the Trainer's step (``lightning.optimizers.StepOptimizer``)."""
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """Lightning's hook, under automatic optimization, after ``on_before_zero_grad``: ``optimizer.zero_grad()``.
        trainscale calls it at each optimizer step's first micro-batch, before its forward (Lightning: after that
        forward, before its backward)."""
        optimizer.zero_grad()

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Freeze the parameters ``optimizer`` does not own until :meth:`untoggle_optimizer`. ``optimizer``: one of
        ``self.optimizers()`` or the torch optimizer inside it (Lightning takes either).

        Raises:
            ValueError: ``optimizer`` is not one of the module's optimizers under manual optimization."""
        self._manual_optimizer(optimizer, "toggle_optimizer").toggle()

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Undo :meth:`toggle_optimizer` (the same kinds of ``optimizer``)."""
        self._manual_optimizer(optimizer, "untoggle_optimizer").untoggle()

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """Lightning's context manager: :meth:`toggle_optimizer` on entry, :meth:`untoggle_optimizer` on exit (also
        on an error), as ``with self.toggled_optimizer(opt): ...`` in a manual ``training_step``.

        Raises:
            ValueError: as :meth:`toggle_optimizer`."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def _manual_optimizer(self, optimizer: Any, method: str) -> Any:
        """The ``ManualOptimizer`` that is, or wraps, ``optimizer``."""
        for manual in self.trainer.manual_optimizers:
            if optimizer is manual or optimizer is manual.optimizer:
                return manual
        raise ValueError(f"{method}({type(optimizer).__name__}) takes one of self.optimizers() under manual "
                         "optimization (self.automatic_optimization = False); under automatic optimization the "
                         "Trainer steps one optimizer, which owns the parameters it trains")


def _no_hook(self, *args: Any) -> None:
    """A hook the module does not define: never called (``defined_hooks``); here for ``super().<hook>()``."""


for _name in MODULE_HOOKS:
    setattr(TrainingModule, _name, _no_hook)
# TorchScript compiles a scripted module's properties unless they are listed here (Lightning's list, for the same
# reason): the Trainer's, the device's, the hyperparameters' are no part of a model's forward
TrainingModule.__jit_unused_properties__ = sorted(
    name for name in dir(TrainingModule) if isinstance(getattr(TrainingModule, name, None), property))


@contextlib.contextmanager
def _jit_scripting() -> Iterator[None]:
    """``TrainingModule._jit_is_scripting`` for the block (every module: a detached one's ``trainer`` is None)."""
    TrainingModule._jit_is_scripting = True
    try:
        yield
    finally:
        TrainingModule._jit_is_scripting = False

# Lightning's hooks that do the step's work, with a default that does it (TrainingModule's methods); the Trainer
# calls a module's own instead of its default (``step_hooks``)
STEP_HOOKS = ("backward", "optimizer_step", "optimizer_zero_grad", "configure_gradient_clipping", "lr_scheduler_step")


def _clip_settings(config: Any, val: float | None, algorithm: str | None) -> tuple[float | None, str]:
    """Lightning's rule for ``clip_gradients``' arguments: None takes the Trainer's flag; a value set both there and
    here must agree. Returns ``(gradient_clip_val or None, algorithm)``.

    Raises:
        ValueError: the two values differ (Lightning's ``MisconfigurationException``).
    """
    flags = {"gradient_clip_val": config.gradient_clip_val,
             # Lightning's flag defaults to None, trainscale's to "norm": it counts as set with a gradient_clip_val only
             "gradient_clip_algorithm": (config.gradient_clip_algorithm if config.gradient_clip_val is not None
                                         else None)}
    for name, given in (("gradient_clip_val", val), ("gradient_clip_algorithm", algorithm)):
        flag = flags[name]
        if given is not None and flag is not None and given != flag:
            raise ValueError(f"You have set `Trainer({name}={flag!r})` and have passed `clip_gradients({name}="
                             f"{given!r})`. Please use only one of them.")
    val = config.gradient_clip_val if val is None else val
    return (val or None), (algorithm or config.gradient_clip_algorithm or "norm")


def step_hooks(model: nn.Module) -> frozenset[str]:
    """The names of :data:`STEP_HOOKS` that a Lightning-style ``model`` (one with ``training_step``) overrides: the
    Trainer calls these; for the others it runs :class:`TrainingModule`'s default, the same, itself. A plain module's
    methods of these names are not Lightning's hooks, and none are called."""
    if getattr(model, "training_step", None) is None:
        return frozenset()
    return module_overrides(model, STEP_HOOKS)


def module_overrides(model: nn.Module, names: tuple[str, ...] = LIGHTNING_HOOKS) -> frozenset[str]:
    """The names among ``names`` (Lightning's hooks) that a Lightning-style ``model`` (one with a step method)
    defines, on its class or on the instance, other than :class:`TrainingModule`'s default: read once per stage, so
    that the loops call a hook only where it is overridden and run the default themselves otherwise (as Lightning's
    ``is_overridden``). A plain module's methods of these names are not Lightning's hooks: none."""
    if not any(getattr(model, step, None) is not None for step in STEP_METHODS):
        return frozenset()
    own = {name: model.__dict__.get(name, getattr(type(model), name, None)) for name in names}
    return frozenset(name for name, fn in own.items()
                     if callable(fn) and fn is not getattr(TrainingModule, name, None) and fn is not _no_hook)


def uncalled_hooks(model: nn.Module) -> list[str]:
    """The Lightning hooks ``model`` overrides that trainscale never calls (not in :data:`CALLED_HOOKS`), sorted: the
    Trainer warns of them at the start of each stage, since the module would run differently under Lightning."""
    return sorted(module_overrides(model) - CALLED_HOOKS)


def configure_model(model: nn.Module) -> None:
    """Lightning's ``_call_configure_model`` (``trainer/call.py``): the module's ``configure_sharded_model``
    (Lightning's older name) then ``configure_model``, each where overridden. Called in every stage right after the
    module's ``setup(stage)`` (``data_sources``), before the strategy moves, wraps or shards the model
    (``Runtime.setup``), so the layers it builds are sharded under fsdp like those built in ``__init__``."""
    for name in ("configure_sharded_model", "configure_model"):
        if name in module_overrides(model, (name,)):
            getattr(model, name)()


class BatchTransfer:
    """``__call__(batch, dataloader_idx)``: a batch on the device through Lightning's batch-transfer hooks, in its
    order (``core/module.py`` ``_on_before_batch_transfer``, ``strategy.batch_to_device``): the precision's input cast
    ("bf16-true"), ``on_before_batch_transfer``, ``transfer_batch_to_device`` (default: the Runtime's move),
    ``on_after_batch_transfer``. Built by :func:`batch_transfer` only for a module or data module that overrides one
    of them; the loops then call it where they otherwise call ``Runtime.to_device``."""

    def __init__(self, runtime: Runtime, hooks: dict[str, Callable]) -> None:
        self.device, self.precision = runtime.device, runtime.precision
        self.before, self.transfer, self.after = (hooks[name] for name in BATCH_TRANSFER_HOOKS)

    def __call__(self, batch: Any, dataloader_idx: int = 0) -> Any:
        if self.precision.casts_input:
            batch = self.precision.convert_input(batch)
        batch = self.before(batch, dataloader_idx)
        batch = self.transfer(batch, self.device, dataloader_idx)
        return self.after(batch, dataloader_idx)


def batch_transfer(runtime: Runtime, model: nn.Module, datamodule: Any = None) -> BatchTransfer | None:
    """A :class:`BatchTransfer` for ``model`` and ``datamodule`` when either overrides a hook of
    :data:`BATCH_TRANSFER_HOOKS`, else None (the loops then move batches with ``runtime.to_device``, one call per
    batch as before). Each hook is the data module's where it defines one, else the module's override, else
    :class:`TrainingModule`'s default, with Lightning's warnings (``_DataHookSelector``) where both define one or where
    the module's is used although a data module was given."""
    overridden = module_overrides(model, BATCH_TRANSFER_HOOKS)
    hooks = {}
    for name in BATCH_TRANSFER_HOOKS:
        theirs = getattr(datamodule, name, None)
        if callable(theirs):
            hooks[name] = theirs
            if name in overridden:
                warnings.warn(f"You have overridden `{name}` in both `LightningModule` and `LightningDataModule`. It "
                              "will use the implementation from `LightningDataModule` instance.", stacklevel=4)
        elif name in overridden:
            hooks[name] = getattr(model, name)
            if datamodule is not None:
                warnings.warn(f"You have overridden `{name}` in `LightningModule` but have passed in a "
                              "`LightningDataModule`. It will use the implementation from `LightningModule` "
                              "instance.", stacklevel=4)
    if not hooks:
        return None
    defaults = {name: functools.partial(getattr(TrainingModule, name), model) for name in BATCH_TRANSFER_HOOKS}
    return BatchTransfer(runtime, {**defaults, **hooks})


def defined_hooks(model: nn.Module) -> frozenset[str]:
    """The names of :data:`MODULE_HOOKS` that ``model`` defines (on its class or on the instance), read once per
    setup so that a step looks up no missing attribute."""
    return frozenset(name for name in MODULE_HOOKS
                     if callable(fn := model.__dict__.get(name, getattr(type(model), name, None))) and fn is not _no_hook)


def shard_units(model: nn.Module) -> tuple[nn.Module, ...]:
    """The submodules that a manual ``training_step`` calls itself (a GAN's generator and discriminator):
    ``model``'s children that hold parameters, each sharded apart under fsdp/hsdp/model_parallel (``apply_fsdp.fsdp_units``), so
    that each gathers its parameters and reduce-scatters its gradients around its own forward and backward.
    Empty under automatic optimization (the step runs through the root's forward)."""
    if getattr(model, "automatic_optimization", True):
        return ()
    return tuple(m for m in model.children() if next(m.parameters(), None) is not None)


def _takes_batch_idx(method: Callable) -> bool:
    params = [p for p in inspect.signature(method).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    return len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def refuse_dataloader_iter(model: nn.Module, steps: tuple[str, ...]) -> None:
    """Refuse a step of ``steps`` that takes Lightning's ``dataloader_iter`` (``training_step(self, dataloader_iter)``,
    which fetches its own batches with ``next``): trainscale's loops hand each step its batch, so it would get a
    batch where it expects an iterator.

    Raises:
        ValueError: naming the step and the form to use.
    """
    for name in steps:
        step = getattr(model, name, None)
        if step is not None and "dataloader_iter" in inspect.signature(step).parameters:
            raise ValueError(f"{type(model).__name__}.{name} takes `dataloader_iter`, Lightning's form of a step that "
                             "fetches its own batches; trainscale does not run it: its loops fetch each batch and pass "
                             f"it, so define {name}(self, batch, batch_idx) (prefetching is the loader's: num_workers, "
                             "prefetch_factor)")


class StepOutputError(TypeError, ValueError):
    """What a ``training_step`` returned that the loop cannot use: Lightning's ``MisconfigurationException`` (a
    ``ValueError`` here, as trainscale's other errors in Lightning's words) and a ``TypeError``, as a wrong type."""


def loss_of(output: Any) -> torch.Tensor:
    """The loss in what ``training_step`` returned under automatic optimization: a tensor, or a dict's ``"loss"``
    (Lightning's ``ClosureResult.from_training_step_output``; None is the caller's: a skipped batch).

    Raises:
        StepOutputError: a dict without a ``"loss"`` tensor, or anything else, in Lightning's words.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if isinstance(output, Mapping):
        raise StepOutputError("In automatic_optimization, when `training_step` returns a dict, the 'loss' key needs to "
                              f"be present (a tensor; it returned the keys {sorted(map(str, output))})")
    raise StepOutputError("In automatic optimization, `training_step` must return a Tensor, a dict, or None (where the "
                          f"step will be skipped); it returned {type(output).__name__}: return the loss tensor or a "
                          "dict with a 'loss' tensor")


def manual_loss_of(output: Any) -> torch.Tensor | None:
    """The loss, detached, in what ``training_step`` returned under manual optimization (Lightning's
    ``ManualResult``): the tensor, a dict's ``"loss"`` tensor (a dict may hold none: a GAN's two losses), else None.

    Raises:
        StepOutputError: anything but a tensor, a dict or None, in Lightning's words.
    """
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss.detach() if isinstance(loss, torch.Tensor) else None
    if output is None:
        return None
    raise StepOutputError("In manual optimization, `training_step` must either return a Tensor or have no return "
                          f"(or a dict); it returned {type(output).__name__}")


def step_metrics(output: Any) -> dict[str, Any]:
    """What of an evaluation step's return the records average over the samples (``val_<key>``): a returned tensor
    as ``loss``, or a returned dict's entries, where each is a number or a one-element tensor (made 0-d). The rest (a
    list, a string, a tensor of predictions) is only ``on_<stage>_batch_end``'s ``outputs``, as Lightning uses all
    of it."""
    returned = output if isinstance(output, Mapping) else {} if output is None else {"loss": output}
    return {key: value.reshape(()) if isinstance(value, torch.Tensor) else value for key, value in returned.items()
            if (isinstance(value, torch.Tensor) and value.numel() == 1) or isinstance(value, (int, float))}


def batch_end_outputs(output: Any, loss: torch.Tensor | None) -> dict:
    """``on_train_batch_end``'s ``outputs``, as Lightning's (``ClosureResult.asdict``, ``ManualResult``): ``{"loss":
    loss}`` (the micro-batch's detached loss; Lightning's is divided by ``accumulate_grad_batches``) with the other keys
    of a dict the ``training_step`` returned (``output``), as they are; a dict without a loss (manual optimization)
    as it is; ``{}`` when it returned None."""
    if loss is None:
        return dict(output) if isinstance(output, Mapping) else {}
    extra = {k: v for k, v in output.items() if k != "loss"} if isinstance(output, Mapping) else {}
    return {"loss": loss, **extra}


def skip_backward(world_size: int) -> None:
    """A ``training_step`` under automatic optimization returned None: no backward for that micro-batch, with
    Lightning's warning (its ``Closure``: the optimizer still steps on the gradients there are, and the step is
    counted). On several ranks that is Lightning's error: the other ranks' backward would wait for this one's
    gradients (DDP's all-reduce), so the batch cannot be skipped on one rank alone.

    Raises:
        RuntimeError: ``world_size`` > 1.
    """
    if world_size > 1:
        raise RuntimeError("Skipping the `training_step` by returning None in distributed training is not supported. "
                           "It is recommended that you rewrite your training logic to avoid having to skip the step "
                           "in the first place: return a loss on every rank (e.g. `loss * 0` for a batch to ignore).")
    warnings.warn("`training_step` returned `None`. If this was on purpose, ignore this warning...", UserWarning,
                  stacklevel=2)


def output_loss(output: Any, model: nn.Module) -> torch.Tensor:
    """The ``loss`` of a Hugging Face model called with a dict batch as keywords (its ``ModelOutput``, a mapping,
    holds one when the batch has ``labels``).

    Raises:
        TypeError: the output holds no loss tensor (names the fix).
    """
    loss = output.get("loss") if isinstance(output, Mapping) else None
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{type(model).__name__} was called with the batch's keys as keywords and returned "
                        f"{type(output).__name__} without a 'loss': put 'labels' in the batch (a Hugging Face model "
                        "computes its loss from them), or define training_step(self, batch, batch_idx)")
    return loss


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a plain model's batch.

    Raises:
        TypeError: another batch shape, naming ``training_step`` as the fix.
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    shape = (f"a dict with keys {sorted(batch)}" if isinstance(batch, Mapping) else
             f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else type(batch).__name__)
    raise TypeError(f"a plain model is fed (inputs, targets) batches, but the loader gave {shape}; define "
                    "training_step(self, batch, batch_idx) (and validation_step) on the model to unpack it "
                    "(trainscale.TrainingModule); a Hugging Face transformers model takes dict batches as they are")


STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class LoopModule(nn.Module):
    """The model and its loss in one ``forward``, for strategies to wrap.

    ``forward(batch, batch_idx)`` returns the training loss (a 0-dim tensor), or None when ``training_step`` returned
    None (the Trainer then skips the batch's backward: :func:`skip_backward`);
    ``forward(batch, batch_idx, stage="validation"|"test")`` returns ``(metrics, samples)``;
    ``stage="predict"`` the predictions; ``dataloader_idx`` (not None: one of several evaluation loaders) goes to
    the step as its third argument, as Lightning passes it.

    Raises:
        ValueError: ``loss_fn`` given together with a model that defines ``training_step``.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable | None) -> None:
        super().__init__()
        self.model = model
        self.shard_units = shard_units(model)  # read by apply_fsdp.fsdp_units
        # read by apply_fsdp.apply_fsdp: the steps run as the sharded model's forward, its root hooks around them
        self.forward_methods = tuple(name for name in STEP_METHODS if hasattr(model, name))
        self.plain_model = not self.forward_methods  # a model and a loss: no steps, no self.log
        self.is_hf_model = hf.pretrained_model(model) is model  # transformers: dict batches go in as keywords
        self.use_loss_fn(loss_fn)
        self.hooks = defined_hooks(model)  # the Lightning hooks the Trainer calls on the model
        self.step_hooks = step_hooks(model)  # the step hooks it overrides (backward, optimizer_step, ...)
        # what steps each scheduler the Trainer steps: the module's own hook, or Lightning's default
        self.lr_scheduler_step = model.lr_scheduler_step if "lr_scheduler_step" in self.step_hooks else lr_scheduler_step
        self.overrides = module_overrides(model)  # every Lightning hook it overrides (the mode hooks, ...)
        step = getattr(model, "training_step", None)
        self.has_training_step = step is not None
        # what the last training_step (its dict's other keys: batch_end_outputs) or evaluation step returned
        self.step_output: Any = None
        self.step_takes_batch_idx = step is not None and _takes_batch_idx(step)
        # whether each evaluation step takes batch_idx, read once (inspect is slow)
        # (a step set to None counts as none, as Lightning's ``is_overridden``)
        self.takes_batch_idx = {name: _takes_batch_idx(getattr(model, name)) for name in
                                ("validation_step", "test_step", "predict_step") if getattr(model, name, None) is not None}

    @property
    def shard_root(self) -> nn.Module:
        """The module fsdp/hsdp shard as FSDP's root (read by ``apply_fsdp.apply_fsdp``): the user's model, which
        then stays callable on its own, during and after ``fit`` (``model(**batch)``, ``model.generate(...)``), as
        under Lightning and torchtitan; this loop module itself when it holds parameters outside the model (a
        ``loss_fn`` module with parameters), so that those are sharded and their gradients reduced too."""
        own = {id(p) for p in self.model.parameters()}
        return self.model if all(id(p) in own for p in self.parameters()) else self

    def use_loss_fn(self, loss_fn: Callable | None) -> None:
        """Compute the loss with ``loss_fn(outputs, targets)`` from now on (None: ``F.cross_entropy``).

        Raises:
            ValueError: ``loss_fn`` given together with a model that defines ``training_step``.
        """
        if loss_fn is not None and hasattr(self.model, "training_step"):
            raise ValueError(f"loss_fn was given, but {type(self.model).__name__} defines training_step, which "
                             "computes the loss itself; drop loss_fn or the training_step")
        self.loss_fn = loss_fn if loss_fn is not None else F.cross_entropy
        self.loss_fn_given = loss_fn is not None

    def keyword_call(self, batch: Any) -> Any:
        """A Hugging Face model's output on a dict batch, its keys as keywords (``input_ids``, ``attention_mask``,
        ``labels``: ``model(**batch)``).

        Raises:
            ValueError: a ``loss_fn`` was given: with dict batches the loss is the output's own.
        """
        if self.loss_fn_given:
            raise ValueError("a dict batch is passed to the model as keywords and the loss is the one its output "
                             "holds (Hugging Face models: 'labels' in the batch); drop loss_fn, or define "
                             "training_step(self, batch, batch_idx) to compute the loss yourself")
        return self.model(**batch)

    def forward(self, batch: Any, batch_idx: int = 0, stage: str = "train", dataloader_idx: int | None = None) -> Any:
        if stage == "manual":
            return self._manual_step(batch, batch_idx)
        if stage != "train":  # through the wrapper's forward, for strategies that gather parameters there (fsdp)
            return (self.predict(batch, batch_idx, dataloader_idx) if stage == "predict"
                    else self.evaluate(batch, batch_idx, stage, dataloader_idx))
        if self.has_training_step:
            args = (batch, batch_idx) if self.step_takes_batch_idx else (batch,)
            out = self.step_output = self.model.training_step(*args)
            return None if out is None else loss_of(out)  # None: no backward for this batch (skip_backward)
        if self.is_hf_model and isinstance(batch, Mapping):
            return output_loss(self.keyword_call(batch), self.model)
        inputs, targets = split_batch(batch)
        return self.loss_fn(self.model(inputs), targets)

    def manual_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        """``training_step`` under manual optimization (it steps the optimizers itself): the loss it
        returned, detached, for the records; None when it returned nothing or a dict without ``"loss"`` (the records
        then have no ``train_loss``; :func:`manual_loss_of`). Called on the module itself
        (under ddp never through the DDP wrapper: gradients are averaged in ``ManualOptimizer.step``). Under
        fsdp the model's ``training_step`` runs as its FSDP root's forward (``apply_fsdp.apply_fsdp``): FSDP2
        takes the first module to run forward as its root, and evaluation later runs through the same one."""
        return self(batch, batch_idx, stage="manual")

    def _manual_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        args = (batch, batch_idx) if self.step_takes_batch_idx else (batch,)
        out = self.step_output = self.model.training_step(*args)
        return manual_loss_of(out)

    def _step_args(self, step: str, batch: Any, batch_idx: int, dataloader_idx: int | None) -> tuple:
        """An evaluation step's arguments as Lightning builds them (``_build_step_args_from_hook_kwargs``): the batch,
        ``batch_idx`` when the step takes it, ``dataloader_idx`` when there are several loaders."""
        args = (batch, batch_idx) if self.takes_batch_idx[step] else (batch,)
        return args if dataloader_idx is None else (*args, dataloader_idx)

    @torch.no_grad()
    def evaluate(self, batch: Any, batch_idx: int, stage: str = "validation",
                 dataloader_idx: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
        """Per-batch mean metrics and the batch's sample count (the numbers of what ``validation_step``/``test_step``
        returned: :func:`step_metrics`; or loss and accuracy for a plain classifier). What the step returned, as it returned it, is
        :attr:`step_output` until the next step (the ``outputs`` of ``on_<stage>_batch_end``, as Lightning's)."""
        step = getattr(self.model, f"{stage}_step", None)
        if step is not None:
            out = self.step_output = step(*self._step_args(f"{stage}_step", batch, batch_idx, dataloader_idx))
            return step_metrics(out), batch_size(batch)
        if self.is_hf_model and isinstance(batch, Mapping):
            return {"loss": output_loss(self.keyword_call(batch), self.model)}, batch_size(batch)
        inputs, targets = split_batch(batch)
        logits = self.model(inputs)
        metrics = {"loss": self.loss_fn(logits, targets)}
        if logits.ndim == 2 and targets.ndim == 1 and not targets.is_floating_point():
            metrics["accuracy"] = (logits.argmax(dim=1) == targets).float().mean()
        return metrics, int(targets.shape[0])

    @torch.no_grad()
    def predict(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        """``predict_step(batch, batch_idx)``, or the plain model's output on the batch's inputs (a Hugging Face
        model's on a dict batch: ``model(**batch)``'s logits)."""
        step = getattr(self.model, "predict_step", None)
        if step is not None:
            return step(*self._step_args("predict_step", batch, batch_idx, dataloader_idx))
        if isinstance(batch, Mapping) and self.is_hf_model:  # its logits
            out = self.keyword_call(batch)
            return out["logits"] if isinstance(out, Mapping) and "logits" in out else out
        inputs = split_batch(batch)[0] if isinstance(batch, (tuple, list)) else batch
        return self.model(inputs)


def attach_trainer(model: nn.Module, trainer: Trainer) -> None:
    """``model.trainer`` (TrainingModule's ``self.trainer``, ``self.log``, ...) is ``trainer`` from here on: before its
    data hooks (``setup(stage)``) run, as in Lightning. Kept out of ``nn.Module``'s submodules, and out of a pickle
    or deep copy of the module (:meth:`TrainingModule.__getstate__`). A plain ``nn.Module`` has no ``self.trainer``
    and gets nothing: ``torch.save(model)`` and ``copy.deepcopy(model)`` after ``fit`` see only the user's module."""
    if isinstance(model, TrainingModule):
        model.__dict__["_trainer"] = trainer


def set_up_model(runtime: Runtime, model: nn.Module, loss_fn: Callable | None,
                 last_setup: tuple | None) -> tuple[nn.Module, LoopModule, nn.Module]:
    """``model`` in a :class:`LoopModule` with ``loss_fn``, set up by ``runtime`` (``Runtime.setup``: the strategy's
    wrapper or in-place sharding, compile, activation checkpointing): ``(model, loop_module, wrapped)``, which the
    caller keeps and passes back as ``last_setup``.

    The model of the last ``fit``/``validate``/``test``/``predict`` (``last_setup[0]``) is set up once and reused, as
    Lightning's ``trainer.fit(model)`` then ``trainer.test(model)``: fsdp and tp shard the model in place and
    cannot shard it twice, and a second DDP wrapper would register a second set of gradient hooks.

    Raises:
        ValueError: ``loss_fn`` given together with a model that defines ``training_step``.
    """
    if last_setup is not None and last_setup[0] is model:
        last_setup[1].use_loss_fn(loss_fn)
        return last_setup
    loop_module = LoopModule(model, loss_fn)
    wrapped, _ = runtime.setup(loop_module)
    runtime.strategy.connect(model)  # trainer.strategy.lightning_module: the user's module, not the loop module
    return model, loop_module, wrapped
