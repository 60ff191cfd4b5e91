"""The readability budget, checked on the code itself: in ``train/`` and ``runtime/`` no
function is longer than 50 lines or has a cyclomatic complexity over 12 (radon's count: McCabe 1976,
one plus each branch point), and ``trainer.py`` stays under 400 lines."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "trainscale"
PACKAGES = ("train", "runtime", "callbacks")
MAX_LINES, MAX_COMPLEXITY, MAX_TRAINER_LINES = 50, 12, 400


def _files():
    return sorted(p for pkg in PACKAGES for p in (SRC / pkg).rglob("*.py"))


def _functions(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body_start = node.body[0]
            if isinstance(body_start, ast.Expr) and isinstance(getattr(body_start, "value", None), ast.Constant) \
                    and len(node.body) > 1:
                body_start = node.body[1]  # the docstring does not count
            yield node.name, node.lineno, node.end_lineno - body_start.lineno + 1


def test_no_function_over_50_lines():
    long = [f"{p.relative_to(SRC)}:{line} {name} ({n} lines)" for p in _files() for name, line, n in _functions(p)
            if n > MAX_LINES]
    assert not long, "functions over the budget:\n" + "\n".join(long)


def test_no_function_over_complexity_12():
    radon = pytest.importorskip("radon.complexity", reason="radon is in the test extra")
    complex_ = [f"{p.relative_to(SRC)}:{b.lineno} {b.name} (complexity {b.complexity})"
                for p in _files() for b in radon.cc_visit(p.read_text()) if b.complexity > MAX_COMPLEXITY]
    assert not complex_, "functions over the budget:\n" + "\n".join(complex_)


def test_trainer_py_under_400_lines():
    lines = len((SRC / "train" / "trainer.py").read_text().splitlines())
    assert lines < MAX_TRAINER_LINES, f"trainer.py has {lines} lines"
