"""Lightning's own tests (55 files of its ``tests/tests_pytorch``) run against trainscale: functions passing per file.

Each file is copied from a Lightning checkout into ``--out`` with only its imports changed, then run with pytest in a
process of its own (``python -m pytest -n 0 --timeout=30 -p no:cacheprovider -q -rA``, a JUnit XML for the
outcomes); the table of docs/lightning.md ("Lightning's own tests, run against trainscale") is what it prints.

The import rewrite (``rewrite_imports``), statement by statement:

- ``lightning.pytorch.<path>``: each name from ``trainscale.<path>``, else from the nearest package above it that has
  it (``lightning.pytorch.trainer.trainer.Trainer`` -> ``trainscale.Trainer``), or from where trainscale keeps it
  (``MOVED``: ``core.saving``, ``AttributeDict``); ``LightningModule`` -> ``TrainingModule``,
  ``LightningDataModule`` -> ``DataModule``; ``import lightning.pytorch as pl`` -> ``import trainscale as pl``.
  ``lightning.fabric.<path>`` the same way (``seed_everything``). ``MisconfigurationException`` -> ``ValueError``
  (``EQUIVALENT``: what trainscale raises in its place, the words still checked by ``match=``).
- ``lightning.pytorch.demos.boring_classes`` -> the repo's ``examples/lightning/boring_classes.py`` (copied in).
- ``tests_pytorch.helpers.runif.RunIf`` -> a ``pytest.mark.skipif`` over the machine (GPUs, packages, platform,
  ``PL_RUN_STANDALONE_TESTS``).
- Helpers of Lightning's other test modules that are plain test code, using only public Lightning API (``LIFTED``:
  ``tests_pytorch.helpers.utils``, ``.dataloaders``, ``.datasets``, ``.datamodules``, ``.simple_models``,
  ``.deterministic_model`` whole;
  ``CustomLogger`` of ``tests_pytorch.loggers.test_logger`` and ``get_members`` of ``tests_pytorch.models.test_hooks``
  with the module-level statements and definitions they use) -> a copy in ``--out`` (``_helpers_utils.py``,
  ``_loggers_test_logger.py``, ...), its imports changed the same way; a test file's import of one reads the copy
  (``_shims.lifted``). Where the copy imports a package that is not installed (torchmetrics for ``simple_models``),
  the name is a placeholder whose call raises that ``ModuleNotFoundError`` (the case then counts as skipped).
- Helpers that monkeypatch Lightning's modules (``MOCKING``: ``tests_pytorch.conftest.mock_cuda_count``,
  ``mock_mps_count``) -> a function that fails naming the ``lightning.*`` path it mocks, as the conftest fixtures of
  the same kind do (below), so the failure counts as "internals".
- ``_<PACKAGE>_GREATER_EQUAL_x_y``, ``_<PACKAGE>_AVAILABLE``, ``_IS_WINDOWS``: computed on this machine.
- ``lightning_utilities`` (a package of its own, installed) stays as it is.
- Any other name is a placeholder (``_shims.missing``): calling it fails with "trainscale has no <path>.<name>"; its
  public attributes are placeholders too (so an enum member of a missing name in a ``parametrize`` list does not stop the
  file; iterating one, or reading a ``_``-attribute, fails naming it); an ``...Exception``/``...Error``/``...Warning`` name is a class nothing raises (``PossibleUserWarning``).

A conftest.py gives Lightning's autouse fixtures that reset torch state (deterministic algorithms, process group),
its ``tmpdir_server`` (an HTTP server over ``tmp_path``) and, for ``cuda_count_*``/``mps_count_*``/
``xla_available``/``tpu_available``, fixtures that fail naming the Lightning module they mock. Four functions of
``trainer/test_trainer.py`` and one of ``trainer/test_states.py`` stop the pytest process and are deselected
(``DESELECTED``).

Counting, per test function (its parametrized cases together): a case whose first error says a package is not
installed (``NOT_INSTALLED``: hydra, omegaconf; Lightning's CI has them) counts as skipped; "skipped" when every case
is skipped; "passing" when every case that ran passed; else a failure, judged by its first failing case and first
exception: "internals" when it comes from Lightning's private API (``classify`` with ``INTERNAL_PATTERNS`` over the
exception lines and the test file's own traceback lines: ``fit_loop`` and the other loops, a placeholder of one of
Lightning's loop classes (``lightning.pytorch.loops.*``), a mock or import of a
``lightning.*`` module path, an attribute a trainscale ``Strategy`` lacks, a
``_``-prefixed attribute, a placeholder of a ``_``-name); the other failures are "counted", each with a rough cause
(``cause``). "counted" = functions - skipped - internals - deselected. ``--list`` prints every function's verdict
and first error line, so each classification can be checked; ``--no-run`` counts the XMLs of an earlier run again.

    PYTHONPATH=src python benchmarks/lightning_tests.py --lightning-git /path/to/pytorch-lightning/.git --out /tmp/lt
    PYTHONPATH=src python benchmarks/lightning_tests.py --lightning /path/to/checkout --out /tmp/lt --list
    PYTHONPATH=src python benchmarks/lightning_tests.py --lightning ... --out ... --files trainer/test_trainer.py
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter

FILES = [
    "callbacks/test_early_stopping.py",
    "callbacks/test_lr_monitor.py",
    "callbacks/test_timer.py",
    "checkpointing/test_checkpoint_callback_frequency.py",
    "checkpointing/test_model_checkpoint.py",
    "models/test_hooks.py",
    "models/test_hparams.py",
    "trainer/flags/test_check_val_every_n_epoch.py",
    "trainer/flags/test_fast_dev_run.py",
    "trainer/flags/test_limit_batches.py",
    "trainer/flags/test_min_max_epochs.py",
    "trainer/flags/test_overfit_batches.py",
    "trainer/flags/test_val_check_interval.py",
    "trainer/logging_/test_train_loop_logging.py",
    "trainer/optimization/test_manual_optimization.py",
    "trainer/optimization/test_optimizers.py",
    "trainer/test_trainer.py",
    "trainer/logging_/test_eval_loop_logging.py",
    "callbacks/test_finetuning_callback.py",
    "checkpointing/test_trainer_checkpoint.py",
    "trainer/properties/test_estimated_stepping_batches.py",
    "trainer/properties/test_log_dir.py",
    "trainer/properties/test_loggers.py",
    "trainer/optimization/test_backward_calls.py",
    "callbacks/test_lambda_function.py",
    "callbacks/test_callbacks.py",
    "trainer/dynamic_args/test_multiple_eval_dataloaders.py",
    "trainer/test_states.py",
    "callbacks/test_callback_hook_outputs.py",
    "trainer/logging_/test_loop_logging.py",
    "trainer/test_dataloaders.py",
    "callbacks/test_gradient_accumulation_scheduler.py",
    "loops/test_training_loop.py",
    "loops/test_training_loop_flow_dict.py",
    "loops/test_training_loop_flow_scalar.py",
    "loops/test_evaluation_loop.py",
    "loops/test_evaluation_loop_flow.py",
    "loops/test_prediction_loop.py",
    "loops/test_flow_warnings.py",
    "loops/optimization/test_automatic_loop.py",
    "loops/optimization/test_manual_loop.py",
    "loops/optimization/test_closure.py",
    "trainer/flags/test_env_vars.py",
    "trainer/flags/test_barebones.py",
    "trainer/properties/test_get_model.py",
    "trainer/connectors/test_checkpoint_connector.py",
    "trainer/connectors/test_signal_connector.py",
    "trainer/connectors/test_callback_connector.py",
    "trainer/logging_/test_logger_connector.py",
    "trainer/logging_/test_distributed_logging.py",
    "callbacks/test_stochastic_weight_avg.py",
    "callbacks/test_throughput_monitor.py",
    "checkpointing/test_torch_saving.py",
    "trainer/optimization/test_multiple_optimizers.py",
    "trainer/test_config_validator.py",
]
# With devices=2, trainscale's Trainer() re-executes the process under torchrun (Lightning starts its processes in
# fit); a KeyboardInterrupt in fit reaches the caller (Lightning turns it into SystemExit): each stops pytest.
# KeyboardInterrupt raised in a hook: Lightning's Trainer turns it into SystemExit, trainscale lets it through, and
# pytest then ends the session (test_on_exception_hook, test_keyboard_interrupt, test_interrupt_state_on_keyboard_interrupt)
DESELECTED = {"trainer/test_trainer.py": ["test_trainer_config_strategy", "test_trainer_config_device_ids",
                                          "test_on_exception_hook", "test_keyboard_interrupt"],
              "trainer/test_states.py": ["test_interrupt_state_on_keyboard_interrupt"]}
# Lightning test helpers copied in (see the module docstring): module -> the names to copy (None: the whole file).
# Each one was read and uses only public Lightning API; a name of these modules not listed stays a placeholder.
LIFTED: dict[str, list[str] | None] = {
    "tests_pytorch.helpers.utils": None,
    "tests_pytorch.helpers.dataloaders": None,
    "tests_pytorch.helpers.datasets": None,
    "tests_pytorch.helpers.datamodules": None,
    "tests_pytorch.helpers.simple_models": None,
    "tests_pytorch.helpers.deterministic_model": None,
    "tests_pytorch.loggers.test_logger": ["CustomLogger"],
    "tests_pytorch.models.test_hooks": ["get_members"],
}
# Lightning test helpers that monkeypatch a lightning.* module (its tests/tests_pytorch/conftest.py): the path mocked.
MOCKING = {"tests_pytorch.conftest.mock_cuda_count": "fabric.accelerators.cuda.num_cuda_devices",
           "tests_pytorch.conftest.mock_mps_count": "fabric.accelerators.mps.MPSAccelerator.is_available",
           "tests_pytorch.conftest.mock_xla_available": "fabric.accelerators.xla._XLA_AVAILABLE",
           "tests_pytorch.conftest.mock_tpu_available": "fabric.accelerators.xla.XLAAccelerator.is_available"}
RENAMED = {"LightningModule": "TrainingModule", "LightningDataModule": "DataModule"}
# Lightning modules whose names trainscale keeps elsewhere (docs/lightning.md, docs/loggers.md). Lightning's
# strategies are at its own path: ``trainscale.strategies`` (docs/strategies.md).
MOVED_NAMES: dict[tuple[str, str], str] = {
    ("lightning.pytorch.utilities", "measure_flops"): "trainscale.telemetry.throughput"}
MOVED = {"lightning.pytorch.core.saving": "trainscale.loggers",
         "lightning.fabric.utilities.throughput": "trainscale.telemetry.throughput",
         "lightning.pytorch.core.mixins": "trainscale.lightning.hparams",
         "lightning.pytorch.utilities": "trainscale.lightning.hparams",
         "lightning.pytorch.core.optimizer": "trainscale.lightning.optimizers"}
# Lightning's MisconfigurationException is trainscale's ValueError (each "Lightning: MisconfigurationException" of
# docs/lightning.md): ``pytest.raises(MisconfigurationException, match=...)`` checks the ValueError and its words.
EQUIVALENT = {"MisconfigurationException": "ValueError"}
FLAG = re.compile(r"^_([A-Z]+_GREATER_EQUAL_\d+_\d+|[A-Z0-9_]+_AVAILABLE|IS_WINDOWS)$")
# Lightning's private API in the first failure: (pattern over the exception lines, pattern over the test file's own
# traceback lines); either matching makes the failure "internals".
INTERNAL_PATTERNS = [
    ("fit_loop", re.compile(r"\bfit_loop\b|\b(epoch|batch)_loop\b|_evaluation_loop|predict_loop"), None),
    ("lightning.* mock or import",
     re.compile(r"No module named '?lightning\b|[\"']lightning\.(pytorch|fabric)\."), None),
    ("loop classes", re.compile(r"trainscale has no lightning\.pytorch\.loops\."), None),
    ("trainer.strategy internals",
     re.compile(r"'\w*Strategy' object has no attribute|type object '\w*Strategy' has no"), None),
    ("_-prefixed name",
     re.compile(r"attribute '_[a-zA-Z]\w*'"), re.compile(r"\b(?<!_shims\.)[A-Za-z]\w*\._[a-zA-Z]\w*")),
]
# A first error that says a package is not installed (Lightning's CI has hydra, omegaconf, ...): the case did not
# run, as a skipped one ("No module named" for a package other than lightning; a NameError for a name the test file
# imports only when its package is there).
NOT_INSTALLED = re.compile(r"^E\s+(ModuleNotFoundError: No module named '(?!lightning\b)|NameError: name )", re.M)


def _missing_is_private(path: str) -> bool:
    return any(part.startswith("_") for part in path.split("."))


# --------------------------------------------------------------------------------------------------- the rewrite


def _lifted_file(module: str) -> str:
    """The copy's module name in --out: ``tests_pytorch.helpers.utils`` -> ``_helpers_utils``."""
    return "_" + module.removeprefix("tests_pytorch.").replace(".", "_")


def _resolve(module: str, name: str) -> str | None:
    """The trainscale module that has ``name`` for a ``lightning.pytorch``/``lightning.fabric`` ``module``."""
    moved = MOVED_NAMES.get((module, name)) or MOVED.get(module)
    if moved and importlib.util.find_spec(moved) and hasattr(importlib.import_module(moved), name):
        return moved
    parts = module.split(".")[2:]
    for depth in range(len(parts), -1, -1):
        candidate = ".".join(["trainscale", *parts[:depth]])
        try:
            mod = importlib.import_module(candidate)
        except ImportError:
            continue
        if hasattr(mod, name):
            return candidate
    return None


def _import_line(module: str, name: str, asname: str | None, boring: set[str]) -> str:
    """One ``from ... import`` line for a name of a Lightning module (see the module docstring)."""
    local = asname or name
    if module.startswith("tests_pytorch.helpers") and name in ("RunIf", "_xfail_gloo_windows"):
        return f"from _shims import {name}" + (f" as {asname}" if asname else "")
    if FLAG.match(name):
        return f"{local} = _shims.flag({name!r})"
    if name in EQUIVALENT:
        return f"{local} = {EQUIVALENT[name]}"
    if module in LIFTED and (LIFTED[module] is None or name in LIFTED[module]):
        return f"{local} = _shims.lifted({_lifted_file(module)!r}, {name!r})"
    if f"{module}.{name}" in MOCKING:
        return f"{local} = _shims.mocking({name!r}, {MOCKING[module + '.' + name]!r})"
    if module == "lightning.pytorch.demos.boring_classes" and name in boring:
        return f"from boring_classes import {name}" + (f" as {asname}" if asname else "")
    if module.split(".")[:2] in (["lightning", "pytorch"], ["lightning", "fabric"]):
        for target in ([RENAMED[name]] if name in RENAMED else []) + [name]:
            found = _resolve(module, target)
            if found:
                return f"from {found} import {target}" + (f" as {local}" if target != local else "")
    return f"{local} = _shims.missing({module + '.' + name!r})"


def _import_alias(alias: ast.alias) -> str:
    """One ``import x`` line for one name of an ``import`` statement that imports a Lightning module."""
    if alias.name in ("lightning.pytorch", "lightning") and alias.asname:
        return f"import trainscale as {alias.asname}"
    if LIFTED.get(alias.name, []) is None and alias.asname:
        return f"import {_lifted_file(alias.name)} as {alias.asname}"
    if alias.name.split(".")[0] in ("lightning", "tests_pytorch"):
        return f"{alias.asname or alias.name.split('.')[0]} = _shims.missing({alias.name!r})"
    return f"import {alias.name}" + (f" as {alias.asname}" if alias.asname else "")


def _rewrite_node(node: ast.stmt, boring: set[str]) -> list[str] | None:
    if isinstance(node, ast.Import):
        if not any(a.name.split(".")[0] in ("lightning", "tests_pytorch") for a in node.names):
            return None
        return [_import_alias(alias) for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("lightning",
                                                                                            "tests_pytorch"):
        return [_import_line(node.module, a.name, a.asname, boring) for a in node.names]
    return None


def rewrite_imports(source: str, boring: set[str]) -> str:
    """``source`` with its Lightning imports replaced (every import statement, nested ones too); nothing else."""
    lines = source.splitlines()
    edits = []
    for node in ast.walk(ast.parse(source)):
        new = _rewrite_node(node, boring) if isinstance(node, (ast.Import, ast.ImportFrom)) else None
        if new is not None:
            edits.append((node.lineno, node.end_lineno, node.col_offset, new))
    for start, end, col, new in sorted(edits, reverse=True):
        indent = " " * col
        lines[start - 1:end] = [indent + line for line in new]
    at = next((i + 1 for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("from __future__")), 0)
    lines.insert(at, "import _shims  # trainscale: placeholders and environment flags")
    return "\n".join(lines) + "\n"


SHIMS = '''"""Shims for Lightning's test helpers (benchmarks/lightning_tests.py): RunIf, flags, placeholders."""
import importlib.metadata
import importlib.util
import os
import sys

import pytest
import torch


def _version(text):
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2])


def flag(name):
    """``_<PACKAGE>_GREATER_EQUAL_x_y``, ``_<PACKAGE>_AVAILABLE``, ``_IS_WINDOWS`` for this machine."""
    if name == "_IS_WINDOWS":
        return sys.platform == "win32"
    if "_GREATER_EQUAL_" in name:
        package, wanted = name[1:].split("_GREATER_EQUAL_")
        try:
            have = importlib.metadata.version(package.lower())
        except importlib.metadata.PackageNotFoundError:
            return False
        return _version(have) >= tuple(int(p) for p in wanted.split("_"))
    package = name[1:-len("_AVAILABLE")].lower()
    return importlib.util.find_spec(package) is not None


COLLECTING = [True]  # conftest.py's pytest_collection_finish sets it False


class _MissingMeta(type):
    """A placeholder: calling it fails in a test; a public attribute, and a call while pytest collects (a
    ``parametrize`` list), give a placeholder, so the file's other tests still run; setting an attribute
    (``mock.patch.object``) fails. A placeholder never equals a real value."""

    def __call__(cls, *args, **kwargs):
        if COLLECTING[0]:
            return _MissingMeta(cls.__name__, (), {"_path": f"{cls._path}(...)"})
        if getattr(cls, "_error", None):
            raise ModuleNotFoundError(cls._error)
        raise NotImplementedError(f"trainscale has no {cls._path} (a placeholder in the copied test)")

    def __setattr__(cls, attr, value):
        raise NotImplementedError(f"trainscale has no {cls._path} (a placeholder in the copied test; .{attr} set)")

    def __getattr__(cls, attr):
        if attr.startswith("_"):
            raise AttributeError(f"{cls._path} (a placeholder in the copied test) has no attribute {attr!r}")
        child = _MissingMeta(attr, (), {"_path": f"{cls._path}.{attr}"})
        type.__setattr__(cls, attr, child)
        return child

    def __iter__(cls):
        raise TypeError(f"trainscale has no {cls._path} (a placeholder in the copied test; iterated)")

    def __repr__(cls):
        return f"<trainscale has no {cls._path} (a placeholder in the copied test)>"


def lifted(module, name):
    """``name`` of ``module``, the copy of a Lightning test helper; where the copy imports a package that is not
    installed, a placeholder whose call raises that ModuleNotFoundError."""
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as error:
        return _MissingMeta(name, (), {"_path": f"{module}.{name}", "_error": str(error)})


def mocking(name, what):
    """A Lightning test helper that monkeypatches ``lightning.<what>``: a call fails naming it."""
    def helper(*args, **kwargs):
        pytest.fail(f"Lightning's helper {name} mocks 'lightning.{what}', which trainscale does not have")

    return helper


def missing(path):
    """A placeholder for ``path`` (see ``_MissingMeta``); an exception or warning name is a class nothing raises."""
    name = path.rsplit(".", 1)[-1]
    if name.endswith(("Exception", "Error", "Warning")):
        return type(name, (Warning if name.endswith("Warning") else Exception,), {"_path": path})
    return _MissingMeta(name, (), {"_path": path})


_PACKAGES = {"rich": "rich", "omegaconf": "omegaconf", "psutil": "psutil", "sklearn": "sklearn", "onnx": "onnx",
             "onnxscript": "onnxscript", "tensorrt": "torch_tensorrt", "deepspeed": "deepspeed"}


def _reasons(kwargs):
    reasons = []
    for key, value in kwargs.items():
        if key == "min_cuda_gpus" and value and torch.cuda.device_count() < value:
            reasons.append(f"GPUs: {value}")
        elif key == "min_torch" and value and _version(torch.__version__) < _version(value):
            reasons.append(f"torch>={value}")
        elif key == "max_torch" and value and _version(torch.__version__) >= _version(value):
            reasons.append(f"torch<{value}")
        elif key == "min_python" and value and sys.version_info[:2] < _version(value):
            reasons.append(f"python>={value}")
        elif key in ("skip_windows",) and value and sys.platform == "win32":
            reasons.append("not Windows")
        elif key == "linux_only" and value and sys.platform != "linux":
            reasons.append("Linux")
        elif key == "standalone" and value and os.getenv("PL_RUN_STANDALONE_TESTS", "0") != "1":
            reasons.append("standalone")
        elif key == "mps" and value is not None and value != torch.backends.mps.is_available():
            reasons.append(f"mps={value}")
        elif key in _PACKAGES and value and importlib.util.find_spec(_PACKAGES[key]) is None:
            reasons.append(key)
        elif key in ("bf16_cuda", "tpu", "dynamo") and value:
            reasons.append(key)
    return reasons


def RunIf(**kwargs):
    """Lightning's ``RunIf``: skip unless this machine has what ``kwargs`` asks for."""
    reasons = _reasons(kwargs)
    return pytest.mark.skipif(condition=bool(reasons), reason=f"Requires: [{' + '.join(reasons)}]")


_xfail_gloo_windows = pytest.mark.xfail(RuntimeError, strict=True, condition=False, reason="gloo on Windows")
'''

CONFTEST = '''"""The trivial parts of Lightning's tests/tests_pytorch/conftest.py (benchmarks/lightning_tests.py)."""
import pytest
import torch

import _shims


def pytest_collection_finish(session):
    _shims.COLLECTING[0] = False


@pytest.fixture(autouse=True)
def teardown_process_group():
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def reset_deterministic_algorithm():
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def tmpdir_server(tmp_path):
    """An HTTP server over tmp_path (Lightning's fixture): yields its (host, port)."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("localhost", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield server.server_address
        server.shutdown()


def _mocking(name, what):
    def fixture():
        pytest.fail(f"Lightning's fixture {name} mocks 'lightning.{what}', which trainscale does not have")

    return pytest.fixture(fixture, name=name)


for _name, _what in [("cuda_count_0", "fabric.accelerators.cuda.num_cuda_devices"),
                     ("cuda_count_1", "fabric.accelerators.cuda.num_cuda_devices"),
                     ("cuda_count_2", "fabric.accelerators.cuda.num_cuda_devices"),
                     ("cuda_count_4", "fabric.accelerators.cuda.num_cuda_devices"),
                     ("mps_count_0", "fabric.accelerators.mps.MPSAccelerator.is_available"),
                     ("mps_count_1", "fabric.accelerators.mps.MPSAccelerator.is_available"),
                     ("xla_available", "fabric.accelerators.xla._XLA_AVAILABLE"),
                     ("tpu_available", "fabric.accelerators.xla.XLAAccelerator.is_available")]:
    globals()[_name] = _mocking(_name, _what)
'''


def _top_names(path: str) -> set[str]:
    tree = ast.parse(open(path).read())
    return {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))} | {
        t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}


def _read(args, rel: str) -> str:
    if args.lightning_git:
        return subprocess.run(["git", "-C", args.lightning_git, "show", f"{args.commit}:tests/tests_pytorch/{rel}"],
                              check=True, capture_output=True, text=True).stdout
    with open(os.path.join(args.lightning, "tests", "tests_pytorch", rel)) as f:
        return f.read()


def _commit(args) -> str:
    repo = args.lightning_git or args.lightning
    flag = ["--git-dir", repo] if args.lightning_git else ["-C", repo]
    out = subprocess.run(["git", *flag, "log", "-1", "--format=%H %cs", args.commit], capture_output=True, text=True)
    return out.stdout.strip() or "unknown (not a git checkout)"


def prepare(args) -> None:
    """Write the rewritten test files, ``boring_classes.py``, ``_shims.py``, the helpers and conftest.py to --out."""
    os.makedirs(args.out, exist_ok=True)
    boring_src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "lightning",
                              "boring_classes.py")
    shutil.copy(boring_src, os.path.join(args.out, "boring_classes.py"))
    boring = _top_names(boring_src)
    with open(os.path.join(args.out, "_shims.py"), "w") as f:
        f.write(SHIMS)
    with open(os.path.join(args.out, "conftest.py"), "w") as f:
        f.write(CONFTEST)
    for module, names in LIFTED.items():
        source = _read(args, module.removeprefix("tests_pytorch.").replace(".", "/") + ".py")
        with open(os.path.join(args.out, _lifted_file(module) + ".py"), "w") as f:
            f.write(rewrite_imports(source if names is None else lift(source, names), boring))
    for rel in args.files:
        with open(os.path.join(args.out, _flat(rel)), "w") as f:
            f.write(rewrite_imports(_read(args, rel), boring))


def lift(source: str, names: list[str]) -> str:
    """The part of a Lightning test module that defines ``names``: its module-level statements other than
    definitions (imports), and the named top-level classes and functions with every top-level one they use."""
    tree = ast.parse(source)
    definitions = {node.name: node for node in tree.body
                   if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
    wanted, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in definitions and name not in wanted:
            wanted.add(name)
            todo += [n.id for n in ast.walk(definitions[name]) if isinstance(n, ast.Name)]
    lines, kept = source.splitlines(), []
    for node in tree.body:
        is_definition = isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        if is_definition and node.name not in wanted:
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        kept.append(("\n\n\n" if is_definition else "\n") + "\n".join(lines[start - 1:node.end_lineno]))
    return "".join(kept).lstrip() + "\n"


def _flat(rel: str) -> str:
    return rel.replace("/", "__")


# --------------------------------------------------------------------------------------------------- running, counting


def _pythonpath() -> str:
    """PYTHONPATH for the pytest processes (they run in --out): this trainscale's folder first, absolute paths."""
    import trainscale

    here = os.path.dirname(os.path.dirname(os.path.abspath(trainscale.__file__)))
    rest = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([here, *rest])


def run_file(args, rel: str) -> tuple[str, float]:
    """Run one copied file; returns the path of its JUnit XML (absent if pytest died) and the seconds it took."""
    name = _flat(rel)
    xml = os.path.join(args.out, name[:-3] + ".xml")
    if os.path.exists(xml):
        os.remove(xml)
    cmd = [sys.executable, "-m", "pytest", name, "-n", "0", "--timeout=30", "-p", "no:cacheprovider", "-q", "-rA",
           "--tb=short", f"--junitxml={xml}", "-o", "junit_family=xunit1"]
    for fn in DESELECTED.get(rel, []):
        cmd += ["--deselect", f"{name}::{fn}"]
    start = time.perf_counter()
    with open(os.path.join(args.out, name[:-3] + ".log"), "w") as log:
        try:
            subprocess.run(cmd, cwd=args.out, stdout=log, stderr=subprocess.STDOUT, timeout=args.file_timeout,
                           env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": _pythonpath()})
        except subprocess.TimeoutExpired:
            log.write(f"\n[lightning_tests] killed after {args.file_timeout} s\n")
    return xml, time.perf_counter() - start


def _first_error(text: str) -> str:
    """The first exception of a --tb=short failure text (before "During handling ..." of a chained one)."""
    return re.split(r"\n(During handling of the above exception|The above exception was the direct cause)", text)[0]


def _split(text: str, test_file: str) -> tuple[str, str]:
    """(exception lines, the test file's own source lines) of the first exception of a --tb=short failure text."""
    errors, own_lines, own = [], [], True
    for line in _first_error(text).splitlines():
        location = re.match(r"^(\S+):\d+: in ", line)
        if location:
            own = os.path.basename(location.group(1)) == test_file
        elif line.startswith("E ") or line.startswith("E\t"):
            errors.append(line)
        elif own:
            own_lines.append(line)
    return "\n".join(errors), "\n".join(own_lines)


def classify(text: str, test_file: str) -> str | None:
    """The ``INTERNAL_PATTERNS`` label a failure text matches (Lightning's private API), else None."""
    errors, own = _split(text, test_file)
    placeholder = re.search(r"trainscale has no (\S+) \(a placeholder", errors)
    if placeholder and _missing_is_private(placeholder.group(1)):
        return "placeholder of a private name"
    for label, in_errors, in_own in INTERNAL_PATTERNS:
        if in_errors.search(errors) or in_own is not None and (in_own.search(own) or in_errors.search(own)):
            return label
    return None


def _expecting_placeholder(text: str, path: str) -> bool:
    """Whether the first error's line of the test file is inside ``with pytest.raises/warns(X)`` with X a placeholder
    exception or warning class (``MisconfigurationException``, ``PossibleUserWarning``: nothing raises them)."""
    where = re.search(r"^(\S+):(\d+): in ", _first_error(text), re.M)
    if not where or os.path.basename(where.group(1)) != os.path.basename(path):
        return False
    source = open(path).read()
    placeholders = set(re.findall(r"^\s*(\w+) = _shims\.missing\('[\w.]+(?:Exception|Error|Warning)'\)", source, re.M))
    line = int(where.group(2))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.With) and node.lineno <= line <= node.end_lineno:
            for item in node.items:
                call = item.context_expr
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                        and call.func.attr in ("raises", "warns") and call.args
                        and isinstance(call.args[0], ast.Name) and call.args[0].id in placeholders):
                    return True
    return False


def cause(text: str, path: str) -> str:
    """A rough cause of a counted failure, from its first exception's lines (a heuristic; see the module docstring)."""
    errors = "\n".join(line for line in _first_error(text).splitlines() if line.startswith("E "))
    if re.search(r"trainscale has no |has no attribute|unexpected keyword argument|fixture '\w+' not found", errors):
        return "a flag, attribute or object trainscale lacks"
    if re.search(r"DID NOT RAISE|DID NOT WARN|Regex pattern did not match|did not match|No warnings of type|"
                 r"warning .* (was|were) (not )?(emitted|raised)|Failed: DID NOT", errors):
        if _expecting_placeholder(text, path):
            return "a warning or error class trainscale does not have (PossibleUserWarning)"
        return "an error or warning worded otherwise, or not given"
    if re.search(r"^E\s+(ValueError|TypeError|RuntimeError|NotImplementedError)", errors, re.M):
        return "a spelling or value trainscale refuses"
    if re.search(r"Timeout", errors):
        return "a timeout (30 s)"
    return "a behaviour difference (a value, a file, an order)"


def _cases(xml: str) -> list[tuple[str, str, str]]:
    """(function, outcome, failure text) per test case of a JUnit XML."""
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        function = case.get("classname", "").split(".")[-1] + "::" + case.get("name", "").split("[")[0]
        outcome, text = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                text = (child.get("message") or "") + "\n" + (child.text or "")
                outcome = "skipped" if NOT_INSTALLED.search(_first_error(text)) else "failed"
                break
            if child.tag == "skipped":
                outcome = "skipped"
        cases.append((function, outcome, text))
    return cases


def _verdict(cases: list[tuple[str, str]], rel: str, out: str) -> tuple[str, str, str]:
    """(table column, verdict, first error line) of one test function from its cases' (outcome, failure text)."""
    failed = [text for outcome, text in cases if outcome == "failed"]
    if all(outcome == "skipped" for outcome, _ in cases):
        return "skipped", "skipped", ""
    if not failed:
        return "passing", "passing", ""
    first = _first_error(failed[0])
    first_line = next((line for line in first.splitlines() if line.startswith("E ")), first.strip()[:160])
    internal = classify(failed[0], _flat(rel))
    if internal:
        return "internals", f"internals ({internal})", first_line
    return "counted", f"FAILED: {cause(failed[0], os.path.join(out, _flat(rel)))}", first_line


def count(xml: str, rel: str, out: str) -> tuple[dict, list[tuple[str, str, str]]]:
    """The row of one file and its per-function verdicts (function, verdict, first error line)."""
    row = Counter(functions=0, skipped=0, internals=0, counted=0, passing=0, deselected=len(DESELECTED.get(rel, [])))
    row["functions"] = row["deselected"]
    verdicts = []
    if not os.path.exists(xml):
        return dict(row, error="no JUnit XML (pytest died or was killed)"), verdicts
    functions: dict[str, list[tuple[str, str]]] = {}
    for function, outcome, text in _cases(xml):
        functions.setdefault(function, []).append((outcome, text))
    for function, cases in functions.items():
        row["functions"] += 1
        column, verdict, first_line = _verdict(cases, rel, out)
        row[column] += 1
        if column == "passing":
            row["counted"] += 1
        verdicts.append((function, verdict, first_line))
    return dict(row), verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lightning", help="a Lightning checkout (its tests/tests_pytorch is read)")
    source.add_argument("--lightning-git", help="a Lightning git directory (bare mirror); files read with git show")
    parser.add_argument("--commit", default="HEAD", help="with --lightning-git: the commit to read (default HEAD)")
    parser.add_argument("--out", required=True, help="folder for the copied files, logs and JUnit XMLs")
    parser.add_argument("--files", nargs="+", default=FILES, help="files under tests/tests_pytorch (default: all 55)")
    parser.add_argument("--file-timeout", type=int, default=900, help="seconds per file before its pytest is killed")
    parser.add_argument("--no-run", action="store_true", help="count the JUnit XMLs already in --out (no pytest)")
    parser.add_argument("--list", action="store_true", help="print every function's verdict and first error line")
    args = parser.parse_args()

    import torch

    import trainscale

    print(f"Lightning commit: {_commit(args)}")
    print(f"trainscale: {os.path.dirname(trainscale.__file__)}; torch {torch.__version__}; "
          f"{platform.machine()}, {os.cpu_count()} CPUs; python {platform.python_version()}")
    if not args.no_run:
        prepare(args)
    columns = ["functions", "skipped", "internals", "deselected", "counted", "passing"]
    totals: Counter = Counter()
    rows, causes = [], Counter()
    for rel in args.files:
        xml, seconds = (os.path.join(args.out, _flat(rel)[:-3] + ".xml"), 0.0) if args.no_run else run_file(args, rel)
        row, verdicts = count(xml, rel, args.out)
        rows.append((rel, row))
        totals.update({k: row[k] for k in columns})
        causes.update(v.split(": ", 1)[1] for _, v, _ in verdicts if v.startswith("FAILED"))
        print(f"  {rel}: {row['passing']}/{row['counted']} passing ({seconds:.0f} s){' ' + row.get('error', '')}",
              flush=True)
        if args.list:
            for function, verdict, first in verdicts:
                print(f"    {function}: {verdict}" + (f"  | {first.strip()[:160]}" if first else ""))
    print("\n| Lightning test file | " + " | ".join(columns) + " |")
    print("| --- |" + " --- |" * len(columns))
    for rel, row in rows:
        print(f"| `{rel}` | " + " | ".join(str(row[k]) for k in columns) + " |")
    print("| all | " + " | ".join(str(totals[k]) for k in columns[:-1]) + f" | **{totals['passing']}** |")
    print(f"\ncounted failures by rough cause ({sum(causes.values())}):")
    for text, n in causes.most_common():
        print(f"  {n:3d}  {text}")


if __name__ == "__main__":
    main()
