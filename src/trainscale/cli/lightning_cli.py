"""``LightningCLI``: a command line for your own module and data module, with Lightning's names and semantics,
built on jsonargparse (the library Lightning's own ``LightningCLI`` uses).

    # train.py
    from trainscale.cli import LightningCLI
    LightningCLI(MyModule, MyDataModule)

    python train.py fit --config config.yaml --trainer.max_epochs 3 --model.lr 0.01
    python train.py fit --print_config > config.yaml     # every option with its value, as YAML
    python train.py validate --config config.yaml --ckpt_path last

``--model.*`` are your module's ``__init__`` parameters, ``--data.*`` your data module's, ``--trainer.*`` the
Trainer's flags (taken from their declarations, :mod:`trainscale.cli.flags`, with their types and descriptions),
``--config`` a YAML or JSON file of the same keys (``trainer: {devices: 2}``); the subcommands ``fit``, ``validate``,
``test`` and ``predict`` call the Trainer's method of that name with the method's own options (``--ckpt_path``).
A script that asks for several devices (``trainer: {devices: 2}``) is started again under torchrun by the Trainer,
which parses the same command line on every rank. Guide: docs/lightning.md ("A command line for your modules").
"""

from __future__ import annotations

import functools
import importlib
import types
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any

from trainscale.callbacks.base import Callback
from trainscale.cli import flags as declared

# The Trainer's parameters that are not flags of a declaration: objects from the config as class_path/init_args.
TRAINER_OBJECTS = ("callbacks", "logger")
# Each subcommand: the Trainer method's parameters the CLI fills itself (not options).
SUBCOMMANDS = {
    "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule", "loss_fn", "optimizer"},
    "validate": {"model", "dataloaders", "datamodule", "loss_fn"},
    "test": {"model", "dataloaders", "datamodule", "loss_fn"},
    "predict": {"model", "dataloaders", "datamodule"},
}


class SaveConfigCallback(Callback):
    """Writes the parsed configuration as ``config.yaml`` into the run directory when ``fit`` starts, on rank zero,
    as Lightning's ``SaveConfigCallback`` (``python script.py fit --config runs/version_0/config.yaml`` repeats the
    run).

    Args:
        parser, config: the parser and the configuration it parsed.
        config_filename: the file's name in the run directory.
        overwrite: replace a file of that name (a run resumed in its own directory has one).
        multifile: also write each sub-configuration that came from a file of its own, as jsonargparse's ``save``.

    Raises:
        RuntimeError: the file exists and ``overwrite`` is False (on every rank).
    """

    def __init__(self, parser, config, config_filename: str = "config.yaml", overwrite: bool = False,
                 multifile: bool = False) -> None:
        self.parser, self.config, self.config_filename = parser, config, config_filename
        self.overwrite, self.multifile, self.already_saved = overwrite, multifile, False

    def on_fit_start(self, trainer, module) -> None:
        if self.already_saved or trainer.run_dir is None:
            return
        path = Path(trainer.run_dir) / self.config_filename
        if not self.overwrite and trainer.runtime.broadcast_object(path.exists()):
            raise RuntimeError(f"{path} exists: SaveConfigCallback does not replace it; pass "
                               "save_config_kwargs={'overwrite': True} to LightningCLI, or save_config_callback=None")
        if trainer.is_global_zero:
            self.parser.save(self.config, path, skip_unset=False, overwrite=self.overwrite, multifile=self.multifile)
        self.already_saved = True


class LightningCLI:
    """Parse the command line (and ``--config`` files) into your module, data module and a Trainer, then run the
    subcommand, as Lightning's ``LightningCLI``.

    Args:
        model_class: your module's class (a ``TrainingModule``/``LightningModule`` subclass or any ``nn.Module``);
            None: any module, named on the command line (``--model my_pkg.MyModule``).
        datamodule_class: your data module's class; None: ``--data`` is optional (a module with its own
            ``train_dataloader()``) and may name any data module class.
        save_config_callback: the callback that writes the configuration into the run directory when ``fit``
            starts (:class:`SaveConfigCallback`: ``config.yaml``); None: none (nor under ``fast_dev_run``).
        save_config_kwargs: its keyword arguments (``{"overwrite": True}``, ``config_filename``, ``multifile``).
        trainer_class: the Trainer class (default ``trainscale.Trainer``) or a subclass.
        trainer_defaults: Trainer flags that replace the declared defaults (the command line and config still
            override them); ``callbacks`` here are always added, after those of the config.
        seed_everything_default: ``--seed_everything``'s default: an int seeds Python, numpy and torch with it before
            the classes are built and becomes the Trainer's ``seed`` (which seeds each ``fit``); True: the Trainer's
            ``seed`` (``--trainer.seed``, else ``PL_GLOBAL_SEED``, else 0, as Lightning's); False: no
            seeding before the classes are built.
        parser_kwargs: keyword arguments of each jsonargparse ``ArgumentParser``; a key that is a subcommand's
            name holds that subcommand parser's (``{"fit": {"default_config_files": ["fit.yaml"]}}``).
        subclass_mode_model: ``--model`` takes any subclass of ``model_class`` (``class_path``/``init_args``).
        subclass_mode_data: ``--data`` takes any subclass of ``datamodule_class``.
        args: the arguments to parse instead of ``sys.argv[1:]``: a list of strings, or a dict of the config.
        run: False: no subcommands; the classes are built (``cli.model``, ``cli.datamodule``, ``cli.trainer``) and
            you call the Trainer yourself.
        auto_configure_optimizers: add ``--optimizer`` (any ``torch.optim.Optimizer``: ``--optimizer Adam
            --optimizer.lr 0.01``) and ``--lr_scheduler`` (any ``LRScheduler``); given, they replace the module's
            ``configure_optimizers`` (with a warning when it has one), built from its parameters when the Trainer
            asks, after the strategy set them up.

    Attributes after construction: ``parser``, ``config`` (the parsed namespace), ``subcommand``, ``config_init``
    (with the classes built), ``model``, ``datamodule``, ``trainer``.

    Raises:
        SystemExit: an unknown option, a value of the wrong type or a missing required one (the parser's message,
            exit status 2), and after ``--help`` or ``--print_config``.
    """

    def __init__(self, model_class: type | None = None, datamodule_class: type | None = None,
                 save_config_callback: type | None = SaveConfigCallback, save_config_kwargs: dict | None = None,
                 trainer_class: type | None = None, trainer_defaults: dict[str, Any] | None = None,
                 seed_everything_default: bool | int = True, parser_kwargs: dict[str, Any] | None = None,
                 subclass_mode_model: bool = False, subclass_mode_data: bool = False,
                 args: list[str] | dict | None = None, run: bool = True, auto_configure_optimizers: bool = True) -> None:
        import torch

        from trainscale.lightning.data_sources import DataModule
        from trainscale.loop.trainer import Trainer

        self.save_config_callback, self.save_config_kwargs = save_config_callback, dict(save_config_kwargs or {})
        self.trainer_class = trainer_class or Trainer
        self.trainer_defaults = dict(trainer_defaults or {})
        self.seed_everything_default = seed_everything_default
        self.auto_configure_optimizers = auto_configure_optimizers
        self.model_class = model_class or torch.nn.Module
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.datamodule_class = datamodule_class
        self._data_base = datamodule_class or DataModule
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data
        parser_kwargs = dict(parser_kwargs or {})
        sub_kwargs = {name: parser_kwargs.pop(name) for name in self.subcommands() if name in parser_kwargs}
        self.parser = self.init_parser(**parser_kwargs)
        self._method_options: dict[str, list[str]] = {}
        if run:
            self._add_subcommands(sub_kwargs)
        else:
            self._add_arguments(self.parser)
        self.config = self.parser.parse_object(args) if isinstance(args, dict) else self.parser.parse_args(args)
        self.subcommand = self.config.get("subcommand") if run else None
        self._set_seed()
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    # -- the parser ----------------------------------------------------------------------------------
    def init_parser(self, **kwargs: Any):
        """A :class:`LightningArgumentParser` (jsonargparse's ``ArgumentParser`` with Lightning's
        ``add_lightning_class_args``) with ``-c/--config`` (and jsonargparse's ``--print_config``)."""
        from jsonargparse import ActionConfigFile

        parser = lightning_argument_parser()(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile,
                            help="a configuration file in YAML or JSON, with the keys of the options below")
        return parser

    def add_arguments_to_parser(self, parser) -> None:
        """Override to add your own options or ``parser.link_arguments(...)``, as in Lightning."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The subcommands, each with the parameters of its Trainer method that are not options."""
        return {name: set(skip) for name, skip in SUBCOMMANDS.items()}

    def _add_subcommands(self, sub_kwargs: dict) -> None:
        subcommands = self.parser.add_subcommands()
        self._subcommand_parsers = {}
        for name, skip in self.subcommands().items():
            method = getattr(self.trainer_class, name)
            summary = (method.__doc__ or name).strip().splitlines()[0]
            parser = self.init_parser(**{"description": summary, **sub_kwargs.get(name, {})})
            self._add_arguments(parser)
            self._method_options[name] = parser.add_method_arguments(self.trainer_class, name, skip=skip,
                                                                     fail_untyped=False)
            self._subcommand_parsers[name] = parser
            subcommands.add_subcommand(name, parser, help=summary)

    def _add_arguments(self, parser) -> None:
        parser.add_argument("--seed_everything", type=bool | int, default=self.seed_everything_default,
                            help="an int seeds Python, numpy and torch with it before the classes are built and "
                                 "becomes the Trainer's seed; True: seed with the Trainer's seed; False: no seeding "
                                 "before the classes are built")
        self.add_trainer_arguments(parser)
        if self.subclass_mode_model:
            parser.add_subclass_arguments(self.model_class, "model", fail_untyped=False, required=True)
        else:
            parser.add_class_arguments(self.model_class, "model", fail_untyped=False)
        if self.subclass_mode_data:
            parser.add_subclass_arguments(self._data_base, "data", fail_untyped=False,
                                          required=self.datamodule_class is not None)
        else:
            parser.add_class_arguments(self._data_base, "data", fail_untyped=False)
        self.add_arguments_to_parser(parser)
        if self.auto_configure_optimizers:
            from torch.optim import Optimizer
            from torch.optim.lr_scheduler import LRScheduler

            taken = {action.dest.split(".")[0] for action in parser._actions}  # added by add_arguments_to_parser
            for key, base, first in (("optimizer", Optimizer, "params"), ("lr_scheduler", LRScheduler, "optimizer")):
                if key not in taken:
                    parser.add_subclass_arguments(base, key, skip={first}, instantiate=False, required=False,
                                                  fail_untyped=False)

    def add_trainer_arguments(self, parser) -> None:
        """``--trainer.*``: each flag of the declarations (:data:`trainscale.cli.flags.DECLARATIONS`) with its type
        and description, then the Trainer's ``callbacks`` and ``logger`` (class_path/init_args, as Lightning)."""
        flags = {f.name for cls in declared.DECLARATIONS for f in fields(cls)}
        own = set(_init_parameters(self.trainer_class)) - flags - set(TRAINER_OBJECTS)
        parser.add_class_arguments(self.trainer_class, "trainer", skip=flags | own, instantiate=False,
                                   fail_untyped=False, sub_configs=True)
        declared.add_trainer_flags(parser, nested_key="trainer")
        defaults = {f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"}
        if defaults:
            parser.set_defaults(defaults)

    # -- building and running ------------------------------------------------------------------------
    def _get(self, config, key: str, default: Any = None) -> Any:
        section = config.get(self.subcommand, config) if self.subcommand else config
        return section.get(key, default)

    def _set_seed(self) -> None:
        from trainscale.checkpointing.rng import fit_seed, seed_everything

        seed = self._get(self.config, "seed_everything")
        if seed is False:
            return
        trainer = self._get(self.config, "trainer")
        if seed is True:
            seed = fit_seed(trainer.seed)  # --trainer.seed, else PL_GLOBAL_SEED, else 0
        trainer.seed = seed_everything(seed)  # the Trainer seeds each fit with it again

    def before_instantiate_classes(self) -> None:
        """Override to run code before the classes are built."""

    def after_instantiate_classes(self) -> None:
        """Override to run code after the classes are built."""

    def instantiate_classes(self) -> None:
        """Build the data module, the module (and the callbacks and logger of the config), then the Trainer."""
        self.config_init = self.parser.instantiate(self.config)
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        self._add_configure_optimizers()
        self.trainer = self.instantiate_trainer()

    def _add_configure_optimizers(self) -> None:
        from torch.optim.lr_scheduler import ReduceLROnPlateau

        optimizer, scheduler = self._get(self.config_init, "optimizer"), self._get(self.config_init, "lr_scheduler")
        if not self.auto_configure_optimizers or not optimizer:
            return
        if scheduler and issubclass(_class(scheduler), ReduceLROnPlateau):
            raise ValueError(f"--lr_scheduler {scheduler.class_path} needs the metric it monitors, which this option "
                             "has no place for: return it from configure_optimizers as {'optimizer': opt, "
                             "'lr_scheduler': {'scheduler': sched, 'monitor': 'val_loss'}}")
        if "configure_optimizers" in _defined_below(type(self.model)):
            warnings.warn(f"{type(self.model).__name__}.configure_optimizers is replaced by --optimizer "
                          f"{optimizer.class_path} (Lightning's LightningCLI does the same)", UserWarning, stacklevel=2)

        def configure_optimizers(module):
            built = _build(optimizer, module.parameters())
            return {"optimizer": built, "lr_scheduler": _build(scheduler, built)} if scheduler else built

        self.model.configure_optimizers = types.MethodType(configure_optimizers, self.model)

    def instantiate_trainer(self, **kwargs: Any):
        """The Trainer of the parsed ``--trainer.*`` flags, ``kwargs`` over them; the callbacks of the config, then
        those added with ``parser.add_lightning_class_args(SomeCallback, key)``, then ``trainer_defaults``'."""
        config = {**self._get(self.config_init, "trainer").as_dict(), **kwargs}
        callbacks = config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        parser = self._subcommand_parsers[self.subcommand] if self.subcommand else self.parser
        callbacks += [self._get(self.config_init, key) for key in parser.callback_keys]
        extra = self.trainer_defaults.get("callbacks") or []
        config["callbacks"] = callbacks + (list(extra) if isinstance(extra, (list, tuple)) else [extra])
        if self.save_config_callback is not None and not config.get("fast_dev_run"):
            section = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
            config["callbacks"].append(self.save_config_callback(parser, section, **self.save_config_kwargs))
        return self.trainer_class(**config)

    def _run_subcommand(self, subcommand: str) -> Any:
        before = getattr(self, f"before_{subcommand}", None)
        if callable(before):
            before()
        options = self.config_init[subcommand]
        kwargs = {name: options[name] for name in self._method_options[subcommand] if name in options}
        kwargs["model"] = self.model
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        result = getattr(self, subcommand, getattr(self.trainer, subcommand))(**kwargs)
        after = getattr(self, f"after_{subcommand}", None)
        if callable(after):
            after()
        return result


@functools.cache
def lightning_argument_parser() -> type:
    """Lightning's ``LightningArgumentParser``: jsonargparse's ``ArgumentParser`` (imported here, on first use)
    with ``add_lightning_class_args``; ``trainscale.cli.LightningArgumentParser`` is this class."""
    from jsonargparse import ArgumentParser

    class LightningArgumentParser(ArgumentParser):
        """jsonargparse's ``ArgumentParser`` with Lightning's ``add_lightning_class_args``: a callback's, module's or
        data module's ``__init__`` parameters as ``--KEY.*`` options (a callback so added is built and given to the
        Trainer, after the config's ``callbacks``), as in ``add_arguments_to_parser``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.callback_keys: list[str] = []

        def add_lightning_class_args(self, lightning_class: type, nested_key: str, subclass_mode: bool = False,
                                     required: bool = True) -> list[str]:
            """``lightning_class``'s ``__init__`` parameters under ``--NESTED_KEY.*`` (``subclass_mode``: any
            subclass, as ``class_path``/``init_args``); a :class:`~trainscale.callbacks.Callback` subclass is
            also added to the Trainer's callbacks. Returns the options added.

            Raises:
                ValueError: a class that is not a callback, ``nn.Module`` or data module (Lightning:
                    ``MisconfigurationException``)."""
            import torch

            from trainscale.lightning.data_sources import DataModule

            if not (isinstance(lightning_class, type)
                    and issubclass(lightning_class, (Callback, torch.nn.Module, DataModule))):
                raise ValueError(f"Cannot add arguments from: {lightning_class}. You should provide either a callable "
                                 "or a subclass of: Trainer, LightningModule, LightningDataModule, or Callback.")
            if issubclass(lightning_class, Callback):
                self.callback_keys.append(nested_key)
            if subclass_mode:
                return self.add_subclass_arguments(lightning_class, nested_key, fail_untyped=False, required=required)
            return self.add_class_arguments(lightning_class, nested_key, fail_untyped=False, sub_configs=True)

    return LightningArgumentParser


def __getattr__(name: str) -> Any:
    if name == "LightningArgumentParser":  # jsonargparse is imported on first use
        return lightning_argument_parser()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cli_lightning_logo() -> None:
    """Lightning's ``cli_lightning_logo()``, which its example scripts call first: prints one line naming trainscale
    and its version, on global rank zero only (the ``RANK`` a launcher sets; Lightning prints its logo in every
    process)."""
    import os

    from trainscale import __version__

    if os.environ.get("RANK", "0") == "0":
        print(f"trainscale {__version__}", flush=True)


def _class(spec) -> type:
    module, name = spec.class_path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _build(spec, first: Any) -> Any:
    """``class_path(first, **init_args)`` of an ``--optimizer``/``--lr_scheduler`` value."""
    init_args = spec.get("init_args")
    return _class(spec)(first, **(init_args.as_dict() if init_args else {}))


def _defined_below(cls: type) -> set[str]:
    """The names ``cls`` and its bases define below trainscale's ``TrainingModule`` (and ``nn.Module``)."""
    from torch import nn

    from trainscale.lightning.module import TrainingModule

    return {name for klass in cls.__mro__ if klass not in (TrainingModule, nn.Module, object) for name in vars(klass)}


def _init_parameters(cls: type) -> list[str]:
    import inspect

    return [p.name for p in inspect.signature(cls).parameters.values() if p.kind is not p.VAR_KEYWORD]

