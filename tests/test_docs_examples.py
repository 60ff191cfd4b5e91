"""Every fenced Python block of README.md and docs/*.md runs, as a user who pastes it would run it.

Each block is written to a file of its own and run with ``python`` in a fresh process, in an empty
directory (so the files it writes, ``runs/`` included, go there), with trainscale importable. A block
must therefore be complete: its imports, its model and its data. A block that cannot run on this
machine says so on the line before its fence, with the reason, e.g.::

    <!-- not run: needs a GPU -->

and is reported here as skipped with that reason; the reasons are limited to what a CPU-only machine
cannot do (a GPU, several machines). Blocks that start several
processes (``devices=2``) run them for real, with gloo.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)  # also indented (in a list item)
SKIP = re.compile(r"<!-- not run: (.+?) -->\s*$")
ALLOWED_REASONS = ("needs a GPU", "needs several machines")
EXTRAS = {"tensorboard": ("tensorboard", "TensorBoardLogger"), "wandb": ("wandb", "WandbLogger"),
          "mlflow": ("mlflow", "MLFlowLogger"), "stream": ("torchdata", "StatefulDataLoader"),
          "hf": ("transformers", "from_pretrained")}


def _blocks() -> list:
    params = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.search(before)
            marks = [pytest.mark.skip(reason=f"{path.name}:{line}: {skip.group(1)}")] if skip else []
            params.append(pytest.param(path, line, textwrap.dedent(match.group(2)), skip.group(1) if skip else None,
                                       id=f"{path.name}:{line}", marks=marks))
    return params


def _missing_extra(code: str) -> str | None:
    for extra, (module, logger) in EXTRAS.items():
        if (f"from {module}" in code or f"import {module}" in code or logger in code) \
                and importlib.util.find_spec(module) is None:
            return f"{module} is not installed: pip install 'trainscale[{extra}]'"
    return None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path,line,code,skip_reason", _blocks())
def test_docs_python_block_runs(path, line, code, skip_reason, tmp_path):
    missing = _missing_extra(code)
    if missing:
        pytest.skip(missing)
    script = tmp_path / f"{path.stem}_line{line}.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_CONFIG_DIR": str(tmp_path / ".wandb"), "WANDB_CACHE_DIR": str(tmp_path / ".wandb"),
           "WANDB_DATA_DIR": str(tmp_path / ".wandb"), "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=220)
    assert done.returncode == 0, (f"{path.name} line {line}: the example failed (exit {done.returncode})\n"
                                  f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-5000:]}")


def test_every_skipped_block_gives_an_allowed_reason():
    reasons = [p.values[3] for p in _blocks() if p.values[3] is not None]
    bad = [r for r in reasons if not r.startswith(ALLOWED_REASONS)]
    assert not bad, f"blocks skipped for reasons a CPU machine does not explain: {bad}; make them run"


def test_the_collector_finds_the_blocks_of_every_document():
    files = {p.values[0].name for p in _blocks()}
    assert {"README.md", "lightning.md", "loggers.md", "strategies.md"} <= files
