"""The Strategy protocol declares every member the code uses, and every registered strategy defines each
one itself: no caller probes a strategy with getattr/hasattr and a default."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from trainscale.runtime import strategies
from trainscale.runtime.strategies import Strategy

SRC = Path(strategies.__file__).resolve().parents[2]  # src/trainscale
MEMBERS = sorted({name for name in vars(Strategy) if not name.startswith("_")} | set(Strategy.__annotations__))
METHODS = [name for name in MEMBERS if callable(vars(Strategy).get(name))]
PENDING: set = set()  # probes allowed: none


def _registered():
    for name, target in strategies._IMPLEMENTATIONS.items():
        module, cls = target.split(":")
        yield name, getattr(importlib.import_module(module), cls)


def test_the_protocol_declares_what_the_runtime_trainer_and_telemetry_use():
    assert MEMBERS == sorted(["name", "checkpoint_suffix", "forward_communicates", "pipelined", "setup_module",
                              "setup_optimizer", "unwrap", "no_backward_sync", "clip_gradients_norm", "time_allreduce",
                              "save_checkpoint", "load_checkpoint", "teardown", "materialises_meta", "data_world"])


@pytest.mark.parametrize("name, cls", list(_registered()), ids=list(strategies._IMPLEMENTATIONS))
def test_every_registered_strategy_defines_every_protocol_member_itself(name, cls):
    missing = [member for member in MEMBERS if member not in vars(cls)]  # its own, not inherited or defaulted
    assert not missing, f"{cls.__name__} lacks {missing}"
    # an alias ("hsdp", "tp": layouts of "model_parallel") names the class its strategy's own name does
    assert cls.name == name or strategies._IMPLEMENTATIONS[cls.name] == strategies._IMPLEMENTATIONS[name]
    assert isinstance(cls.checkpoint_suffix, str) and isinstance(cls.forward_communicates, bool)
    assert isinstance(cls.materialises_meta, bool)
    for method in METHODS:
        ours = list(inspect.signature(vars(cls)[method]).parameters)
        declared = list(inspect.signature(vars(Strategy)[method]).parameters)
        assert ours == declared, f"{cls.__name__}.{method}{ours} differs from the protocol's {declared}"


def _strategy_uses(tree: ast.AST):
    """(kind, member) for each ``getattr``/``hasattr`` naming a protocol member or probing ``*.strategy``,
    and for each ``<...>.strategy.<member>`` attribute read."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target, member = node.args[0], node.args[1] if len(node.args) > 1 else None
            probes_strategy = isinstance(target, ast.Attribute) and target.attr == "strategy"
            named = member.value if isinstance(member, ast.Constant) else None
            if probes_strategy or named in MEMBERS:
                yield node.func.id, named
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and node.value.attr == "strategy"):
            yield "attribute", node.attr


def test_no_code_probes_a_strategy_and_every_member_read_is_declared():
    probes, undeclared = set(), set()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for kind, member in _strategy_uses(ast.parse(path.read_text(), rel)):
            if kind == "attribute" and member not in MEMBERS:
                undeclared.add((rel, member))
            elif kind != "attribute":
                probes.add((rel, kind, member))
    assert not undeclared, f"strategy members read but not declared in the Strategy protocol: {sorted(undeclared)}"
    assert probes <= PENDING, f"getattr/hasattr on strategy members (use the protocol's): {sorted(probes - PENDING)}"
