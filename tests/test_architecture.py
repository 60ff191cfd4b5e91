"""The package layout holds its shape: imports point down the layers of docs/architecture.md (those under
``if TYPE_CHECKING:`` too, but for the contracts listed in ALLOWED_TYPE_IMPORTS), no two subpackages import each
other (directly or round a cycle), and each function whose complexity is above 15 is listed here with the reason it
stays one function."""

import ast
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "trainscale"

# Lowest first. A package may import its own modules and those of any lower layer, never a higher one.
LAYERS = [
    {"models", "data", "utilities"},
    {"runtime"},
    {"telemetry"},
    {"scaling"},
    {"loggers", "checkpointing", "faults", "callbacks", "jobs", "profilers"},
    {"lightning", "trainer"},  # trainer: Lightning's lightning.pytorch.trainer import paths
    {"tune"},
    {"loop"},
    {"plan", "check", "export", "tuner"},
    {"bench"},
    {"cli"},
]
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

# Imports under ``if TYPE_CHECKING:`` that point up or sideways, each with why it stays: Lightning's two contracts, in
# which a class of a lower layer names the Trainer that runs it. Nothing is imported at run time (the Trainer passes
# itself in), and the import cycle test leaves these out. Any other upward import, for types or not, fails the layer
# test: type the value by a small ``typing.Protocol`` or a base class in the lower layer, or pass the values it reads.
# An entry whose import has gone is removed.
CALLBACK_CONTRACT = ("Lightning's callback contract: each Callback hook receives the Trainer (a callback reads its "
                     "state and sets its should_stop), and an override keeps the hook's parameter types")
MODULE_CONTRACT = ("Lightning's module contract: TrainingModule.trainer (and attach_trainer, which sets it) is the "
                   "Trainer that runs the module, as LightningModule.trainer")
ALLOWED_TYPE_IMPORTS = {
    "callbacks/backbone_finetuning.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/base.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/device_stats_monitor.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/early_stopping.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/ema.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/finetuning.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/gradient_accumulation_scheduler.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/lr_monitor.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/model_checkpoint.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/model_summary.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/on_exception_checkpoint.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/prediction_writer.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/rich_model_summary.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/swa.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/throughput_monitor.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "callbacks/timer.py:trainscale.loop.trainer": CALLBACK_CONTRACT,
    "lightning/module.py:trainscale.loop.trainer": MODULE_CONTRACT,
}

# Functions above McCabe complexity 15 (radon's count: one plus each branch point), each with why it is one
# function. A function that grows past 15 gets an entry here or is simplified; an entry whose function has
# come back under the line is removed.
MAX_COMPLEXITY = 15
ALLOWED_COMPLEX = {
    "bench/advice.py:advise": "independent advice rules in priority order; each branch is one rule, read top to bottom",
    "bench/analysis.py:shares": "the phases of a step, each optional in a row (CPU rows lack some)",
    "bench/analysis.py:table": "one optional column per branch of the printed table",
    "bench/grid.py:plan": "the sweep grid's flag checks, each with its own message naming the fix",
    "bench/predicted.py:add_predictions": "each predicted number is optional, as the planner may not know it",
    "bench/report.py:plot_phases": "one figure; each branch draws an optional series",
    "bench/report.py:plot_scaling": "one figure; each branch draws an optional series",
    "bench/runner.py:_cell_outcome": "one status per branch (ok, oom, timeout, failed, crashed), each with its reason",
    "bench/runner.py:sweep": "the public entry point: argument checks with messages, then the loop over cells",
    "check/compare.py:step_view": "each compared number is optional in a step record",
    "loop/trainer.py:Trainer.train_step": "the one training step (torchtitan's train_step): each concern called "
                                          "once, in order, every decision a visible line",
    "check/report.py:verdict": "one finding per branch, in the order the report prints them",
    "plan/planner.py:_comm_s": "one collective pattern per strategy and mesh axis",
    "plan/planner.py:plan": "the public entry point: argument checks with messages, then one row per cell",
    "telemetry/processor.py:Telemetry._numbers": "the defined numbers of docs/telemetry.md, each optional by device",
    "telemetry/report.py:write_plots": "one plot per block, each drawn only when the run recorded its numbers",
    "telemetry/report.py:text_summary": "one optional line of report.txt per branch",
}


class Import(NamedTuple):
    module: str
    line: int
    type_only: bool  # in the body of an ``if TYPE_CHECKING:`` block: read by type checkers, never run


def _imports(path: Path) -> Iterator[Import]:
    """Every ``trainscale`` import in ``path``, at any depth, those under ``TYPE_CHECKING`` marked ``type_only``."""
    tree = ast.parse(path.read_text())
    type_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for statement in node.body for n in ast.walk(statement))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainscale."):
            yield Import(node.module, node.lineno, id(node) in type_only)
        elif isinstance(node, ast.Import):
            yield from (Import(a.name, node.lineno, id(node) in type_only)
                        for a in node.names if a.name.startswith("trainscale."))


def _package(path: Path) -> str | None:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else None


class Edge(NamedTuple):
    source: str
    target: str
    why: str  # "file:line imports module", for the failure message
    type_key: str | None  # "file:module" of an import under TYPE_CHECKING, as ALLOWED_TYPE_IMPORTS names it

    @property
    def contract(self) -> bool:
        return self.type_key in ALLOWED_TYPE_IMPORTS


def _edges() -> Iterator[Edge]:
    for path in sorted(SRC.rglob("*.py")):
        source = _package(path)
        if source is None:  # trainscale/__init__.py: the lazy public names, above every layer
            continue
        rel = path.relative_to(SRC).as_posix()
        for module, line, type_only in _imports(path):
            target = module.split(".")[1]
            if target != source:
                where = f"{rel}:{line} imports {module}" + (" (TYPE_CHECKING)" if type_only else "")
                yield Edge(source, target, where, f"{rel}:{module}" if type_only else None)


def test_imports_under_type_checking_are_marked_type_only(tmp_path):
    """Only the body of ``if TYPE_CHECKING:`` is type-only: its ``else`` branch and any other block run."""
    source = tmp_path / "module.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from trainscale.loop.trainer import Trainer\n"
                      "else:\n    from trainscale.loop import state\n"
                      "def f():\n    import trainscale.tune.batch_size\n")
    assert list(_imports(source)) == [("trainscale.loop.trainer", 3, True), ("trainscale.loop", 5, False),
                                      ("trainscale.tune.batch_size", 7, False)]


def test_every_subpackage_has_a_layer():
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYER), f"add to LAYERS (or remove): {sorted(packages ^ set(LAYER))}"


def test_imports_point_down_the_layers():
    upward = [edge for edge in _edges() if LAYER[edge.target] >= LAYER[edge.source]]
    unlisted = [edge.why for edge in upward if not edge.contract]
    assert not unlisted, ("imports that point up or sideways (type the value by a Protocol or a base class in the "
                          "lower layer, or pass the values it reads):\n" + "\n".join(unlisted))
    stale = sorted(set(ALLOWED_TYPE_IMPORTS) - {edge.type_key for edge in upward})
    assert not stale, f"no longer an upward type import: remove from ALLOWED_TYPE_IMPORTS: {stale}"


def test_no_import_cycle_between_subpackages():
    graph: dict[str, set[str]] = {}
    for edge in _edges():
        if not edge.contract:  # type imports included; Lightning's two contracts left out (ALLOWED_TYPE_IMPORTS)
            graph.setdefault(edge.source, set()).add(edge.target)

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    cycles = sorted(p for p in graph if reaches(p, p, set()))
    assert not cycles, f"subpackages on an import cycle: {cycles}"


def test_complex_functions_are_listed_with_a_reason():
    radon = pytest.importorskip("radon.complexity", reason="radon is in the test extra")
    found = {f"{p.relative_to(SRC)}:{b.fullname}": b.complexity for p in sorted(SRC.rglob("*.py"))
             for b in radon.cc_visit(p.read_text()) if b.complexity > MAX_COMPLEXITY}
    unlisted = sorted(f"{name} (complexity {c})" for name, c in found.items() if name not in ALLOWED_COMPLEX)
    stale = sorted(set(ALLOWED_COMPLEX) - set(found))
    assert not unlisted, "simplify, or list with a reason in ALLOWED_COMPLEX:\n" + "\n".join(unlisted)
    assert not stale, f"no longer above {MAX_COMPLEXITY}: remove from ALLOWED_COMPLEX: {stale}"


def test_the_architecture_page_shows_the_training_step_as_it_is():
    """docs/architecture.md holds a copy of ``Trainer.train_step``'s source: the copy must be exact."""
    import inspect
    import textwrap

    from trainscale.loop.trainer import Trainer

    page = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    copy = page.split("<!-- train_step: begin -->\n```py\n", 1)[1].split("```\n<!-- train_step: end -->", 1)[0]
    assert copy == textwrap.dedent(inspect.getsource(Trainer.train_step)), \
        "docs/architecture.md: paste Trainer.train_step's current source between the train_step markers"


def test_no_package_below_the_loop_writes_a_trainer_attribute():
    """Each layer owns its state: below ``loop/`` a function gets the values it uses, not the Trainer to write into.
    Callbacks are the exception Lightning's contract makes (``EarlyStopping`` sets ``trainer.should_stop``)."""
    writes = []
    for path in sorted(SRC.rglob("*.py")):
        if _package(path) in (None, "loop", "callbacks", "cli") or LAYER[_package(path)] > LAYER["loop"]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            writes += [f"{path.relative_to(SRC)}:{node.lineno}" for t in targets if isinstance(t, ast.Attribute)
                       and isinstance(t.value, ast.Name) and t.value.id == "trainer"]
    assert not writes, f"pass the values instead of writing the Trainer's attributes: {writes}"
