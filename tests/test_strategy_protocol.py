"""The Strategy base declares every member the code uses, with defaults; every registered strategy subclasses it and
overrides members with the base's signatures; no caller probes a strategy with getattr/hasattr, and no code outside
runtime/strategies/ compares a strategy's name (it asks a member instead)."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from trainscale.runtime import strategies
from trainscale.runtime.strategies import STRATEGY_CLASSES, Strategy

SRC = Path(strategies.__file__).resolve().parents[2]  # src/trainscale
MEMBERS = sorted({name for name in vars(Strategy) if not name.startswith("_")} | set(Strategy.__annotations__))
METHODS = [name for name in MEMBERS if inspect.isfunction(vars(Strategy).get(name))]
PENDING: set = set()  # probes allowed: none
FLAGS = ("check_run", "check_options", "options_from", "check_async_save")  # class methods: before a strategy exists
BOOLS = ("forward_communicates", "materialises_meta", "pipelined", "drives_all_devices", "uses_mesh",
         "needs_process_group", "applies_compile", "supports_sync_batchnorm")


def test_the_base_declares_what_the_runtime_trainer_and_telemetry_use():
    assert MEMBERS == sorted([
        "name", "sharded_checkpoints", "forward_communicates", "pipelined", "materialises_meta", "drives_all_devices",
        "uses_mesh", "needs_process_group", "applies_compile", "supports_sync_batchnorm",
        "manual_optimization_refusal", "gradient_sync", "precision_name", "given_options", *FLAGS,
        "setup_module", "setup_optimizer", "unwrap", "no_backward_sync", "clip_gradients_norm", "time_allreduce",
        "save_checkpoint", "load_checkpoint", "teardown", "data_world",
        # Lightning's public strategy surface (trainer.strategy)
        "root_device", "is_global_zero", "world_size", "global_rank", "local_rank", "model", "lightning_module",
        "connect", "barrier", "broadcast", "reduce", "all_gather"])


@pytest.mark.parametrize("name, cls", list(STRATEGY_CLASSES.items()), ids=list(STRATEGY_CLASSES))
def test_every_registered_strategy_subclasses_the_base_with_its_signatures(name, cls):
    assert issubclass(cls, Strategy) and cls is not Strategy
    # an alias ("hsdp", "tp": layouts of "model_parallel") names the class its strategy's own name does
    assert STRATEGY_CLASSES[cls.name] is cls
    assert cls.sharded_checkpoints in (True, False)
    assert all(isinstance(getattr(cls, flag), bool) for flag in BOOLS)
    for method in [m for m in METHODS if m in vars(cls)]:  # the overrides keep the base's parameters
        ours = list(inspect.signature(vars(cls)[method]).parameters)
        declared = list(inspect.signature(vars(Strategy)[method]).parameters)
        assert ours == declared, f"{cls.__name__}.{method}{ours} differs from the base's {declared}"
    for method in FLAGS:
        assert isinstance(inspect.getattr_static(cls, method), classmethod)


def test_each_strategy_defines_only_what_differs_from_the_base():
    """A member overridden with the base's own value is a duplicate default (they were, before the base)."""
    for cls in set(STRATEGY_CLASSES.values()):
        same = [m for m in MEMBERS if m in vars(cls) and not callable(vars(cls)[m])
                and not isinstance(vars(cls)[m], property) and m != "name" and vars(cls)[m] == vars(Strategy)[m]]
        assert not same, f"{cls.__name__} repeats the base's defaults {same}"


# Protocol members that are also Lightning's hooks of the user's module and data module, which the loop looks up on
# those objects (a plain data module may lack them): such a lookup names the member without probing a strategy.
USER_HOOK_NAMES = {"teardown"}
# Protocol members that are also attributes of a module (Lightning's ``strategy.model``; the loop module's user
# ``model``), which code looks up on a ``module``/``wrapped`` module: such a lookup does not probe a strategy.
MODULE_ATTRIBUTE_NAMES = {"model"}


def _strategy_uses(tree: ast.AST):
    """(kind, member) for each ``getattr``/``hasattr`` naming a protocol member or probing ``*.strategy``,
    and for each ``<...>.strategy.<member>`` attribute read. A lookup of one of :data:`USER_HOOK_NAMES` on a
    ``model`` or ``datamodule`` is the user's hook, not a probe."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target, member = node.args[0], node.args[1] if len(node.args) > 1 else None
            probes_strategy = isinstance(target, ast.Attribute) and target.attr in ("strategy", "strategy_class")
            named = member.value if isinstance(member, ast.Constant) else None
            on_user_object = named in USER_HOOK_NAMES and (
                (isinstance(target, ast.Name) and target.id in ("model", "datamodule"))
                or (isinstance(target, ast.Attribute) and target.attr in ("model", "datamodule")))
            on_module = named in MODULE_ATTRIBUTE_NAMES and isinstance(target, ast.Name) and target.id in ("module",
                                                                                                          "wrapped")
            if probes_strategy or (named in MEMBERS and not (on_user_object or on_module)):
                yield node.func.id, named
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and node.value.attr in ("strategy", "strategy_class")):
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
    assert not undeclared, f"strategy members read but not declared in the Strategy base: {sorted(undeclared)}"
    assert probes <= PENDING, f"getattr/hasattr on strategy members (use the protocol's): {sorted(probes - PENDING)}"


# Where a strategy's name may be compared: the strategies themselves, and the commands that choose strategies by
# their flags (the planner and bench model each strategy's layout and cost; check runs ddp or fsdp; the CLI parses).
NAME_CHECKS_ALLOWED = ("runtime/strategies/", "plan/", "cli/", "bench/", "check/")
NAMES = {*STRATEGY_CLASSES, "ddp_spawn", "ddp_notebook", "ddp_fork"}


def _names(node: ast.AST, constants: set) -> bool:
    """Whether ``node`` is a strategy name, a tuple/list/set holding one, or a module constant holding one."""
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names(e, constants) for e in node.elts)
    return isinstance(node, ast.Name) and node.id in constants


def _imported_constants(tree: ast.Module) -> set:
    """Names imported from trainscale whose values are collections holding a strategy's name."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainscale"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                value = getattr(module, alias.name, None)
                if isinstance(value, (tuple, list, set, frozenset, dict)) and NAMES & {v for v in value
                                                                                         if isinstance(v, str)}:
                    out.add(alias.asname or alias.name)
    return out


def name_checks(source: str) -> list[int]:
    """Lines comparing something with a strategy's name (``==``, ``!=``, ``in`` a tuple or a constant of names,
    defined in the module or imported from trainscale), or looking one up in a dict literal keyed by names."""
    tree = ast.parse(source)
    constants = {t.id for node in tree.body if isinstance(node, ast.Assign) and _names(node.value, set())
                 for t in node.targets if isinstance(t, ast.Name)} | _imported_constants(tree)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_names(n, constants) for n in (node.left, *node.comparators)):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and isinstance(node.func.value, ast.Dict) and any(_names(k, constants) for k in node.func.value.keys)):
            lines.append(node.lineno)
    return lines


def test_the_name_check_finds_each_form():
    forms = ['x == "ddp"', 'x != "pp"', 'x in ("dp", "pp")', 'x not in SHARDED', '{"ddp": 1}.get(x)',
             '"fsdp" == x']
    for form in forms:
        assert name_checks(f'SHARDED = ("fsdp", "tp")\nif {form}:\n    pass\n') == [2], form
    assert name_checks('from trainscale.runtime.strategies import STRATEGIES\nif x in STRATEGIES:\n    pass\n') == [2]
    assert name_checks('x == "auto"\ny = mesh["tp"]\nz = "ddp" if a else b\n') == []


def test_no_strategy_name_comparisons_outside_the_strategies():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith(NAME_CHECKS_ALLOWED):
            source = path.read_text()
            found += [f"{rel}:{n}: {source.splitlines()[n - 1].strip()}" for n in name_checks(source)]
    assert not found, "ask the strategy (a member of runtime/strategies/base.py) instead:\n" + "\n".join(found)
