"""Real multi-process tests: N fresh processes, each given the environment torchrun would give it
(RANK, WORLD_SIZE, LOCAL_RANK, ...), each under a hard time limit so a hang fails the test instead of
blocking CI.

The processes are started with ``forkserver``: one server process, started once per test session, imports
torch and torch._dynamo (:data:`PRELOAD`) and forks each rank from that state, so a rank does not pay those
imports again (``spawn`` did, twice per 2-process test on the 2 cores here). Nothing else is shared: the server never
runs a torch operation or starts a thread before it forks, and each rank takes the test's environment,
current directory and ``sys.path`` at the time of the call, as ``spawn`` gives them."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


START_METHOD = "forkserver"
# torch._dynamo too: the first optimizer a rank builds imports it (torch's optimizers wrap ``add_param_group`` in
# ``torch._disable_dynamo``), about 1 s of CPU per rank here; imported once in the server, it starts no thread.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def _child(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple,
           env: dict | None = None, launcher_env: list[dict] | None = None) -> None:
    if env is not None:  # the forkserver's environment is that of the session's first call: take the test's
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(launcher_env[rank] if launcher_env else
                      {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    result = fn(rank, *args)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_distributed(fn: Callable, *args: Any, world_size: int = 2, timeout: float = 120.0,
                    launcher_env: list[dict] | None = None) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` spawned processes; return each rank's result.

    Each rank gets torchrun's variables, or ``launcher_env[rank]`` in their place (another launcher's
    variables, to test how a process reads them; MASTER_ADDR/MASTER_PORT then come from there too).

    Raises:
        TimeoutError: a process is still running after ``timeout`` seconds (all are killed).
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback is included).
    """
    if START_METHOD == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_child, args=(fn, world_size, free_port(), out_dir, args, dict(os.environ),
                                               launcher_env),
                                 nprocs=world_size, join=False, start_method=START_METHOD)
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} did not finish within {timeout:.0f} s (a hang?)")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def run_python(args: list, tmp_path: Path, stdin: str | None = None,
               timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """``python ARGS`` run in ``tmp_path`` as a user runs it, with this checkout's sources importable and
    temporary files under ``tmp_path/tmp``: (the completed process, seconds it took).

    Raises:
        subprocess.TimeoutExpired: still running after ``timeout`` seconds (a hang; the process is killed).
    """
    src = str(Path(__file__).resolve().parents[1] / "src")
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(tmp_path / "tmp")}
    start = time.monotonic()
    out = subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                         cwd=tmp_path, env=env)
    return out, time.monotonic() - start
