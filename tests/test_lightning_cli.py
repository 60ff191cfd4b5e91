"""The command lines take the Trainer's flags from their declarations (RuntimeFlags, TrainerConfig) through
jsonargparse, and LightningCLI runs a user's module and data module from a YAML file, on 2 processes too."""

from __future__ import annotations

import dataclasses
import re
import runpy
import sys
import typing
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import run_distributed
from trainscale.cli import LightningCLI, flags
from trainscale.loop.config import TrainerConfig
from trainscale.runtime.flags import RuntimeFlags

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lightning_cli.py"


def _described(cls) -> dict[str, str]:
    """``{flag: description}`` of a declaration's "Attributes" section, whitespace collapsed."""
    from docstring_parser import parse

    return {p.arg_name: " ".join(p.description.split()) for p in parse(cls.__doc__).params}


def _declared_options(parser, prefix: str = "") -> dict[str, object]:
    """The parser's options spelt as a declared Trainer flag (``--devices``, ``--trainer.max_epochs``):
    ``{flag: argparse action}``. (``--batch-size``, the loader's batch of demo and check, is their own option.)"""
    names = {f.name for cls in flags.DECLARATIONS for f in dataclasses.fields(cls)}
    return {name: a for a in parser._actions for name in names if f"--{prefix}{name}" in a.option_strings}


def _commands():
    from trainscale.cli import bench, check, demo, plan

    return {"demo": demo.build_parser(), "check": check.build_parser(), "bench": bench.build_parser(),
            "plan": plan.build_parser()}


# Options of a command spelt as a Trainer flag that mean something else (the flag: a collective's timeout).
OWN_MEANING = {("check", "timeout"): "seconds per run", ("bench", "timeout"): "seconds per cell"}


def test_each_command_option_of_a_trainer_flag_has_the_declared_description_and_type():
    described = {**_described(RuntimeFlags), **_described(TrainerConfig)}
    seen = set()
    for command, parser in _commands().items():
        for name, action in _declared_options(parser).items():
            if (command, name) in OWN_MEANING:
                assert action.help.startswith(OWN_MEANING[command, name])
                continue
            seen.add(name)
            assert " ".join(action.help.split()).endswith(described[name]), (command, name)
    assert seen == {"accelerator", "devices", "strategy", "precision", "seed"}
    demo = _commands()["demo"]  # the declared type: devices is "int | Literal['auto']"
    assert demo.parse_args(["--devices", "2"]).devices == 2
    assert demo.parse_args(["--devices", "auto"]).devices == "auto"
    assert _commands()["bench"].parse_args(["--devices", "1,2", "--strategy", "ddp,fsdp"]).strategy == ["ddp", "fsdp"]
    hints = typing.get_type_hints(RuntimeFlags)
    for name in ("accelerator", "strategy", "precision"):  # the declared Literal's values are the option's choices
        assert _declared_options(demo)[name].metavar == "{" + ",".join(typing.get_args(hints[name])) + "}"
    for bad in (["--seed", "one"], ["--devices", "two"], ["--precision", "bf16_mixed"], ["--strategy", "dpp"]):
        with pytest.raises(SystemExit):
            demo.parse_args(bad)


def test_lightning_cli_exposes_every_declared_flag_and_a_new_field_becomes_an_option(monkeypatch):
    cli_parser = LightningCLI(torch.nn.Linear, args=["--model.in_features=2", "--model.out_features=1"],
                              run=False).parser
    options = _declared_options(cli_parser, "trainer.")
    described = {**_described(RuntimeFlags), **_described(TrainerConfig)}
    assert set(options) == set(described)
    for name, action in options.items():
        assert " ".join(action.help.split()) == described[name], name

    @dataclasses.dataclass(frozen=True)
    class Extended(TrainerConfig):
        """The loop's flags and one more.

        Attributes:
            warmup_ratio: the share of the steps spent warming up.
        """

        warmup_ratio: float = 0.1

    monkeypatch.setattr(flags, "DECLARATIONS", (RuntimeFlags, Extended))
    parser = LightningCLI(torch.nn.Linear, args=["--model.in_features=2", "--model.out_features=1"],
                          trainer_class=_TrainerTakingAnyFlag, run=False).parser
    action = _declared_options(parser, "trainer.")["warmup_ratio"]
    assert action.help == "the share of the steps spent warming up."
    assert parser.parse_args(["--model.in_features=2", "--model.out_features=1",
                              "--trainer.warmup_ratio=0.25"]).trainer.warmup_ratio == 0.25
    with pytest.raises(SystemExit):
        parser.parse_args(["--model.in_features=2", "--model.out_features=1", "--trainer.warmup_ratio=much"])


class _TrainerTakingAnyFlag:
    def __init__(self, callbacks: list | None = None, logger: object = None, **flags) -> None:
        self.flags = flags


def test_config_file_command_line_and_print_config(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("trainer:\n  max_epochs: 3\n  devices: 1\n  default_root_dir: %s\nmodel:\n  hidden: 4\n"
                      "data:\n  batch_size: 8\n" % tmp_path)
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        example = runpy.run_path(str(EXAMPLE))  # the classes, without running the script's CLI
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    cli = LightningCLI(example["Regression"], example["Points"], run=False,
                       args=["--config", str(config), "--model.lr", "0.5", "--seed_everything", "5"])
    assert cli.model.hparams["hidden"] == 4 and cli.model.hparams["lr"] == 0.5  # the file, then the command line
    assert cli.datamodule.batch_size == 8 and cli.trainer.config.max_epochs == 3
    assert cli.trainer.config.seed == 5  # --seed_everything becomes the seed of each fit
    with pytest.raises(SystemExit) as exit_info:
        LightningCLI(example["Regression"], example["Points"], args=["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert re.search(r"^  max_epochs: 3$", printed, re.M) and re.search(r"^  hidden: 4$", printed, re.M)
    config.write_text("trainer:\n  max_epoch: 3\n")  # a misspelt key fails loudly, naming it
    with pytest.raises(SystemExit) as exit_info:
        LightningCLI(example["Regression"], example["Points"], args=["fit", "--config", str(config)])
    assert exit_info.value.code == 2 and "max_epoch" in capsys.readouterr().err


def _fit_from_yaml(rank: int, script: str, config: str, root: str) -> dict:
    sys.argv = [script, "fit", "--config", config, "--trainer.default_root_dir", root, "--model.hidden", "8"]
    cli = runpy.run_path(script, run_name="__main__")["cli"]
    return {"world_size": cli.trainer.world_size, "steps": cli.trainer.global_step, "hidden": cli.model.hparams.hidden,
            "callbacks": [type(c).__name__ for c in cli.trainer.callbacks], "run_dir": str(cli.trainer.run_dir),
            "weights": [p.detach().clone() for p in cli.model.parameters()]}


@pytest.mark.multiprocess
def test_a_lightning_cli_script_fits_from_yaml_on_two_processes(tmp_path):
    """examples/lightning_cli.py with its YAML (2 CPU processes, 2 epochs), each rank parsing the same command line."""
    ranks = run_distributed(_fit_from_yaml, str(EXAMPLE), str(EXAMPLE.with_suffix(".yaml")), str(tmp_path))
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["hidden"] for r in ranks] == [8, 8]  # the command line over the YAML's 16
    assert ranks[0]["steps"] == 16  # 2 epochs × 256 samples / (2 ranks × 16)
    assert "EarlyStopping" in ranks[0]["callbacks"]  # a class_path/init_args callback of the YAML
    saved = (Path(ranks[0]["run_dir"]) / "config.yaml").read_text()  # SaveConfigCallback's, by rank zero
    assert re.search(r"^  hidden: 8$", saved, re.M) and re.search(r"^  devices: 2$", saved, re.M)
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        assert torch.equal(a, b)  # one model, trained under ddp


def test_optimizer_and_lr_scheduler_options_replace_configure_optimizers(tmp_path):
    """Lightning's automatic ``--optimizer``/``--lr_scheduler``: built from the module's parameters when asked."""
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        example = runpy.run_path(str(EXAMPLE))
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    args = ["--trainer.default_root_dir", str(tmp_path), "--optimizer", "torch.optim.Adam", "--optimizer.lr", "0.02",
            "--lr_scheduler", "torch.optim.lr_scheduler.StepLR", "--lr_scheduler.step_size", "3"]
    with pytest.warns(UserWarning, match="Regression.configure_optimizers is replaced by --optimizer torch.optim.Adam"):
        cli = LightningCLI(example["Regression"], example["Points"], run=False, args=args)
    configured = cli.model.configure_optimizers()
    assert isinstance(configured["optimizer"], torch.optim.Adam)
    assert configured["optimizer"].param_groups[0]["lr"] == 0.02 and configured["lr_scheduler"].step_size == 3
    plain = LightningCLI(example["Regression"], example["Points"], run=False, args=args[:2])
    assert isinstance(plain.model.configure_optimizers(), torch.optim.SGD)  # none given: the module's own
    with pytest.raises(ValueError, match="needs the metric it monitors"):
        LightningCLI(example["Regression"], example["Points"], run=False,
                     args=[*args[:6], "--lr_scheduler", "ReduceLROnPlateau"])


def _example_classes() -> dict:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        return runpy.run_path(str(EXAMPLE))  # the classes, without running the script's CLI
    finally:
        sys.path.remove(str(EXAMPLE.parent))


@pytest.mark.timeout(60)
def test_add_lightning_class_args_adds_a_callbacks_options_and_gives_it_to_the_trainer(tmp_path):
    """Lightning's fine-tuning example: ``parser.add_lightning_class_args(SomeCallback, "finetuning")`` and
    ``parser.link_arguments`` in ``add_arguments_to_parser``, annotated with ``LightningArgumentParser``."""
    from trainscale.callbacks import EarlyStopping
    from trainscale.cli import LightningArgumentParser

    example = _example_classes()

    class MyLightningCLI(LightningCLI):
        def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
            parser.add_lightning_class_args(EarlyStopping, "early_stopping")
            parser.link_arguments("data.batch_size", "model.hidden")  # any two options of one type
            parser.set_defaults({"early_stopping.monitor": "val_loss", "early_stopping.patience": 7})

    cli = MyLightningCLI(example["Regression"], example["Points"], run=False,
                         args=["--data.batch_size", "12", "--early_stopping.patience", "3",
                               f"--trainer.default_root_dir={tmp_path}"])
    stops = [cb for cb in cli.trainer.callbacks if isinstance(cb, EarlyStopping)]
    assert len(stops) == 1 and (stops[0].monitor, stops[0].patience) == ("val_loss", 3)
    assert cli.model.hparams["hidden"] == 12  # linked from --data.batch_size
    assert isinstance(cli.parser, LightningArgumentParser)
    with pytest.raises(ValueError, match="Cannot add arguments from"):
        cli.parser.add_lightning_class_args(int, "number")


def test_save_config_callback_writes_the_parsed_config_when_fit_starts_without_a_deprecated_call(tmp_path,
                                                                                                    monkeypatch):
    """``save_config_kwargs={"overwrite": True}`` (Lightning's examples): ``config.yaml`` in the run directory holds
    every option, the command line's over the defaults; jsonargparse is called without a deprecated parameter."""
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "all")  # else jsonargparse shows each kind once a process
    example = _example_classes()
    args = [f"--trainer.default_root_dir={tmp_path}", "--trainer.limit_train_batches=1", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", "--model.hidden=3"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = LightningCLI(example["Regression"], example["Points"], run=False, save_config_kwargs={"overwrite": True},
                           seed_everything_default=1234, args=args)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert [str(w.message) for w in caught if w.category.__module__.startswith("jsonargparse")] == []
    saved = yaml.safe_load((Path(cli.trainer.run_dir) / "config.yaml").read_text())
    assert (saved["seed_everything"], saved["model"]["hidden"], saved["trainer"]["limit_train_batches"]) == (1234, 3, 1)
    assert saved["data"] == cli.config["data"].as_dict()  # the defaults too
    assert "max_epochs" in saved["trainer"] and saved["trainer"]["max_epochs"] is None  # None written out too
