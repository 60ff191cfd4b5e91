"""Every fenced Python block of README.md and docs/*.md runs, as a user who pastes it would run it.

Each block is written to a file of its own in an empty directory and run there as ``python FILE`` would run
it (so the files it writes, ``runs/`` included, go there), with trainscale importable, in a process of its own:
forked from ``docs_examples_server.py``, which has imported torch, torch._dynamo and trainscale and nothing
more (about 5 s of CPU a fresh interpreter would pay for each block). A block must therefore be complete: its
imports, its model and its data. A block that cannot run on this machine says so on the line before its fence,
with the reason, e.g.::

    <!-- not run: needs a GPU -->

and is reported here as skipped with that reason; the reasons are limited to what a CPU-only machine
cannot do (a GPU, several machines). Blocks that start several processes (``devices=2``) run them for
real, with gloo: the Trainer's relaunch hands torchrun's arguments to the block server, which forks the workers
warm with the environment torchrun gives its workers and runs torchrun's worker entry in each
(``docs_examples_server.py``; the relaunch itself is tested whole, fresh interpreters under a real torchrun, in
test_run_cli.py and test_cli.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
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


@pytest.fixture(scope="module")
def block_server(tmp_path_factory):
    """docs_examples_server.py: a process that has imported torch, torch._dynamo and trainscale and forks each
    block's process from that state (a fresh interpreter pays about 5 s of CPU for those imports here)."""
    ours, theirs = socket.socketpair()
    log = tmp_path_factory.mktemp("block-server") / "stderr"
    with theirs, open(log, "w") as stderr:
        server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("docs_examples_server.py")),
                                   str(theirs.fileno())], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=stderr,
                                  env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"})
    with ours:
        yield ours, bytearray(), log
    assert server.wait(timeout=60) == 0, f"the block server failed:\n{log.read_text()[-3000:]}"


def _answer(sock: socket.socket, pending: bytearray, timeout: float | None) -> dict:
    """The server's next answer line; raises TimeoutError after ``timeout`` seconds without one."""
    sock.settimeout(timeout)
    while b"\n" not in pending:
        chunk = sock.recv(4096)
        if not chunk:
            raise EOFError("the block server is gone")
        pending += chunk
    line, _, rest = bytes(pending).partition(b"\n")
    pending[:] = rest
    return json.loads(line)


def _run_block(server, script: Path, env: dict, out_dir: Path, timeout: float) -> tuple[int, str, str]:
    """``python SCRIPT`` in the script's folder, forked by the block server: (exit status, stdout, stderr)."""
    sock, pending, log = server
    stdout, stderr = out_dir / "stdout", out_dir / "stderr"
    sock.sendall(json.dumps({"script": str(script), "env": env, "stdout": str(stdout),
                             "stderr": str(stderr)}).encode() + b"\n")
    try:
        group = _answer(sock, pending, timeout=60)["pid"]
    except (EOFError, TimeoutError) as err:
        raise AssertionError(f"the block server did not start the block ({err}):\n{log.read_text()[-3000:]}")
    killed = False
    while True:
        try:
            answer = _answer(sock, pending, None if killed else timeout)
        except TimeoutError:  # a hang: kill the block's process group (torchrun's workers die with it)
            os.killpg(group, signal.SIGKILL)
            killed = True
            continue
        if "exit" in answer:
            return answer["exit"], stdout.read_text(), stderr.read_text()
        group = answer["pid"]  # the workers forked for the block's relaunch


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path,line,code,skip_reason", _blocks())
def test_docs_python_block_runs(path, line, code, skip_reason, tmp_path, tmp_path_factory, block_server):
    missing = _missing_extra(code)
    if missing:
        pytest.skip(missing)
    script = tmp_path / f"{path.stem}_line{line}.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_CONFIG_DIR": str(tmp_path / ".wandb"), "WANDB_CACHE_DIR": str(tmp_path / ".wandb"),
           "WANDB_DATA_DIR": str(tmp_path / ".wandb"), "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    status, stdout, stderr = _run_block(block_server, script, env, tmp_path_factory.mktemp("output"), timeout=220)
    assert status == 0, (f"{path.name} line {line}: the example failed (exit {status})\n"
                         f"--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-5000:]}")


def test_every_skipped_block_gives_an_allowed_reason():
    reasons = [p.values[3] for p in _blocks() if p.values[3] is not None]
    bad = [r for r in reasons if not r.startswith(ALLOWED_REASONS)]
    assert not bad, f"blocks skipped for reasons a CPU machine does not explain: {bad}; make them run"


def test_the_collector_finds_the_blocks_of_every_document():
    files = {p.values[0].name for p in _blocks()}
    assert {"README.md", "lightning.md", "loggers.md", "strategies.md"} <= files
