"""TrainerConfig: every loop flag validated in Trainer.__init__ (pure logic)."""

import inspect
import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Literal

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
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_epoch'; did you mean 'max_epochs'"):
        resolve_trainer_config(max_epoch=3)
    cfg = resolve_trainer_config(default_root_dir=str(tmp_path), max_steps=5)
    assert isinstance(cfg, TrainerConfig) and cfg.default_root_dir == tmp_path and cfg.step_limit == 5
    assert resolve_trainer_config(default_root_dir=None).default_root_dir == Path("runs")  # Lightning's None
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
    assert _flag_names(Runtime) == runtime_names
    assert _flag_names(Trainer) == ["callbacks", "logger", "runtime", "profiler", "plugins", *runtime_names,
                                    *trainer_names]
    # Python's words for an unknown keyword (what Lightning's Trainer raises), with the closest flag
    with pytest.raises(TypeError, match=r"Trainer.__init__\(\) got an unexpected keyword argument 'acelerator'; "
                                        "did you mean 'accelerator'"):
        Trainer(acelerator="cpu")
    with pytest.raises(TypeError, match=r"Runtime.__init__\(\) got an unexpected keyword argument 'precison'; "
                                        "did you mean 'precision'"):
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


def _flag_names(cls) -> list:
    """The parameters of ``cls``'s constructor: the flags (no ``**kwargs`` that would hide one from a type checker)."""
    params = inspect.signature(cls).parameters.values()
    assert not [p for p in params if p.kind is p.VAR_KEYWORD]
    return [p.name for p in params]


def _doc_entries(doc: str, section: str) -> dict:
    """``{name: description}`` of a Google-style docstring section ("Args", "Attributes"), whitespace collapsed."""
    lines = inspect.cleandoc(doc).splitlines()
    out, name = {}, None
    for line in lines[lines.index(f"{section}:") + 1:]:
        if not line.startswith("    "):  # a blank line or the next section ends it
            break
        entry = re.match(r"    (\w+): (.*)", line)
        if entry:
            name = entry[1]
            out[name] = entry[2]
        else:
            out[name] += " " + line.strip()
    return out


def _declared(init) -> tuple[list, dict]:
    """A constructor's parameters as ``[(name, default, annotation, keyword-only)]`` and its "Args" descriptions."""
    params = [p for p in inspect.signature(init).parameters.values() if p.name != "self"]
    return ([(p.name, p.default, p.annotation, p.kind is p.KEYWORD_ONLY) for p in params],
            _doc_entries(init.__doc__, "Args"))


def _fields(*classes, keyword_only: bool = False) -> tuple[list, dict]:
    out, docs = [], {}
    for cls in classes:
        out += [(f.name, f.default if f.default is not MISSING else f.default_factory(), f.type,
                 keyword_only or f.kw_only) for f in fields(cls)]
        docs.update(_doc_entries(cls.__doc__, "Attributes"))
    return out, docs  # the same, read from the dataclasses' fields and "Attributes" sections


def _taking_strategy_objects(params: list) -> list:
    """The flags as the constructors take them: ``strategy`` also a strategy object (Lightning's way), which the
    Runtime turns into the flags it stands for (a name and options: ``connector.strategy_object_flags``); the
    declared field, which the command lines read, holds names."""
    return [(name, default, f"{kind} | Strategy" if name == "strategy" else kind, keyword_only)
            for name, default, kind, keyword_only in params]


def test_the_runtime_names_each_flag_with_the_type_default_and_description_of_its_field():
    from trainscale.runtime.connector import RuntimeFlags
    from trainscale.runtime.runtime import Runtime

    params, docs = _declared(Runtime.__init__)
    expected, expected_docs = _fields(RuntimeFlags)
    expected = _taking_strategy_objects(expected)
    assert params == expected
    assert docs == expected_docs and len(docs) == len(expected)  # one description per flag


def test_a_changed_default_or_description_would_be_seen():
    """The comparison reads what it compares: a description or default that differs is found."""
    from trainscale.runtime.connector import RuntimeFlags

    doc = RuntimeFlags.__doc__.replace("precision: \"32-true\", ", "precision: ")
    assert _doc_entries(doc, "Attributes")["precision"] == ('"16-mixed", "bf16-mixed", "bf16-true" or "64-true" '
                                                            '(float64 parameters, inputs and default dtype; also '
                                                            'Lightning\'s 64 and "64").')


def test_the_trainer_names_each_flag_with_the_type_default_and_description_of_its_field():
    from trainscale import Trainer
    from trainscale.runtime.connector import RuntimeFlags

    params, docs = _declared(Trainer.__init__)
    runtime_params, _ = _fields(RuntimeFlags, keyword_only=True)
    loop_params, loop_docs = _fields(TrainerConfig, keyword_only=True)
    own = [("callbacks", None, "list[Callback] | None", True), ("logger", None, "Any", True),
           ("runtime", None, "Runtime | None", True),
           ("profiler", None, "Profiler | Literal['simple', 'advanced', 'pytorch'] | None", True),
           ("plugins", None, "Any", True)]
    assert params == own + _taking_strategy_objects(runtime_params) + loop_params
    assert docs == {**{name: docs[name] for name, *_ in own}, **loop_docs}  # the Runtime's flags: in Runtime.__init__
    preamble = inspect.cleandoc(Trainer.__init__.__doc__).split("Args:")[0]
    assert all(re.search(rf"\b{name}\b", preamble) for name, *_ in runtime_params)


def test_each_flag_has_its_rule_on_its_field_or_a_resolver_that_converts_it():
    """One declarative layer: a flag's own rule sits on its field (``flag``) and ``check_flags`` applies it; the
    flags left are those a resolver turns into another value (with the rules across flags, code)."""
    from dataclasses import dataclass

    from trainscale.runtime.flags import check_flags, flag

    unruled = {f.name for f in fields(TrainerConfig) if "rule" not in f.metadata}
    assert unruled == {"max_epochs", "max_steps", "default_root_dir", "val_check_interval", "max_time"}

    @dataclass(frozen=True)
    class Flags:
        warmup: int = flag(1, low=1)
        ratio: float | None = flag(None, low=0.0)
        mode: Literal["a", "b"] = flag("a")  # the choices: the Literal's values
        strict: bool | Literal["warn"] | None = flag(None)

    check_flags(Flags())
    check_flags(Flags(mode="b", strict="warn"))
    for bad, message in [({"warmup": 0}, "warmup=0 must be an int >= 1$"), ({"ratio": float("nan")}, "ratio=nan must "
                         "be a finite number >= 0.0 or None"), ({"mode": "c"}, "mode='c'; choose 'a' or 'b'"),
                         ({"strict": "yes"}, "strict='yes'; choose None, True, False or 'warn'")]:
        with pytest.raises(ValueError, match=message):
            check_flags(Flags(**bad))
