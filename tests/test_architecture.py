"""The package layout holds its shape: imports point down the layers of docs/architecture.md, no two
subpackages import each other (directly or round a cycle), and each function whose complexity is above 15
is listed here with the reason it stays one function."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "trainscale"

# Lowest first. A package may import its own modules and those of any lower layer, never a higher one.
LAYERS = [
    {"models", "data", "utilities"},
    {"runtime"},
    {"telemetry"},
    {"scaling"},
    {"loggers", "checkpointing", "faults", "callbacks", "jobs", "profilers"},
    {"lightning"},
    {"tune"},
    {"loop"},
    {"plan", "check", "export", "tuner"},
    {"bench"},
    {"cli"},
]
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

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


def _imports(path: Path):
    """(module, line) of every ``trainscale`` import in ``path``, at any depth, except under ``TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainscale."):
            yield node.module, node.lineno
        elif isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name.startswith("trainscale."))


def _package(path: Path) -> str | None:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else None


def _edges():
    for path in sorted(SRC.rglob("*.py")):
        source = _package(path)
        if source is None:  # trainscale/__init__.py: the lazy public names, above every layer
            continue
        for module, line in _imports(path):
            target = module.split(".")[1]
            if target != source:
                yield source, target, f"{path.relative_to(SRC)}:{line} imports {module}"


def test_every_subpackage_has_a_layer():
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYER), f"add to LAYERS (or remove): {sorted(packages ^ set(LAYER))}"


def test_imports_point_down_the_layers():
    upward = [why for source, target, why in _edges() if LAYER[target] >= LAYER[source]]
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


def test_no_import_cycle_between_subpackages():
    graph: dict[str, set[str]] = {}
    for source, target, _ in _edges():
        graph.setdefault(source, set()).add(target)

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
