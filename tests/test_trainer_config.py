"""TrainerConfig: every loop flag validated in Trainer.__init__ (pure logic)."""

import pytest

from trainscale.loop.config import TrainerConfig, resolve_trainer_config


@pytest.mark.parametrize("flags, message", [
    ({"keep_last": "3"}, "keep_last='3' must be an int >= 1 or None"),
    ({"keep_last": 0}, "keep_last=0 must be an int >= 1"),
    ({"seed": -1}, "seed=-1 must be an int >= 0"),
    ({"seed": 2**32}, "seed=4294967296 must be < 2\\*\\*32"),
    ({"seed": 1.5}, "seed=1.5 must be an int"),
    ({"gradient_clip_val": 0.0}, "gradient_clip_val=0.0 must be a finite number"),
    ({"gradient_clip_val": float("inf")}, "gradient_clip_val=inf must be a finite number"),
    ({"straggler_margin": -0.1}, "straggler_margin=-0.1 .* 20 % over the median"),
    ({"log_every_n_steps": True}, "log_every_n_steps=True must be an int"),
    ({"on_nonfinite": "ignore"}, "on_nonfinite='ignore'; choose 'raise' or 'skip'"),
    ({"enable_checkpointing": "yes"}, "enable_checkpointing='yes' must be True or False"),
    ({"default_root_dir": ""}, "default_root_dir='' must be a directory path"),
    ({"checkpoint_every_n_steps": 0}, "checkpoint_every_n_steps=0 must be an int >= 1 or None"),
])
def test_bad_values_name_the_flag_and_what_it_accepts(flags, message):
    with pytest.raises(ValueError, match=message):
        resolve_trainer_config(**flags)


def test_default_root_dir_that_is_a_file(tmp_path):
    path = tmp_path / "runs"
    path.write_text("not a directory")
    with pytest.raises(ValueError, match="is a file; pass a directory"):
        resolve_trainer_config(default_root_dir=path)


def test_unknown_flag_and_defaults(tmp_path):
    with pytest.raises(TypeError, match="unexpected flag 'max_epoch'; did you mean 'max_epochs'"):
        resolve_trainer_config(max_epoch=3)
    cfg = resolve_trainer_config(default_root_dir=str(tmp_path), max_steps=5)
    assert isinstance(cfg, TrainerConfig) and cfg.default_root_dir == tmp_path and cfg.step_limit == 5
    assert resolve_trainer_config().step_limit == float("inf")
    with pytest.raises(Exception):
        cfg.max_epochs = 2  # frozen


def test_each_flag_is_declared_once_and_the_constructors_show_them_all():
    """The Trainer's and the Runtime's signatures are made from RuntimeFlags and TrainerConfig, and a misspelt
    flag of either kind names the closest one."""
    import inspect
    from dataclasses import fields

    from trainscale import Runtime, Trainer
    from trainscale.runtime.connector import RuntimeFlags

    runtime_names = [f.name for f in fields(RuntimeFlags)]
    trainer_names = [f.name for f in fields(TrainerConfig)]
    assert not set(runtime_names) & set(trainer_names)
    assert list(inspect.signature(Runtime).parameters) == runtime_names
    assert list(inspect.signature(Trainer).parameters) == ["callbacks", "logger", *runtime_names, *trainer_names]
    with pytest.raises(TypeError, match="Trainer\\(\\) got an unexpected flag 'acelerator'; did you mean 'accelerator'"):
        Trainer(acelerator="cpu")
    with pytest.raises(TypeError, match="Runtime\\(\\) got an unexpected flag 'precison'; did you mean 'precision'"):
        Runtime(precison="bf16-mixed")


def test_a_read_only_or_over_long_root_dir_is_one_line_before_training(tmp_path, monkeypatch):
    import os

    from trainscale.loop import config

    # the permission as the OS answers it for this user (faked: root may write to a read-only directory)
    real_access = os.access
    monkeypatch.setattr(config.os, "access", lambda path, mode: str(path) != str(tmp_path))
    with pytest.raises(ValueError, match="cannot be written .*read-only for this user.*pass a writable directory"):
        resolve_trainer_config(default_root_dir=tmp_path / "runs")
    monkeypatch.setattr(config.os, "access", real_access)
    assert resolve_trainer_config(default_root_dir=tmp_path / "runs").default_root_dir == tmp_path / "runs"
    with pytest.raises(ValueError, match="a name of 300 bytes .*file systems allow 255: pass a shorter"):
        resolve_trainer_config(default_root_dir=tmp_path / ("x" * 300))
