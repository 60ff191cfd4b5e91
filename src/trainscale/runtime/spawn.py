"""Start a job's processes with ``torch.multiprocessing`` (spawn), for ``strategy="ddp_spawn"``.

``run(function, args, nprocs)`` pickles ``args`` once in the parent (a clear error names the
argument that cannot be pickled), starts ``nprocs`` fresh Python interpreters with
``torch.multiprocessing.start_processes(start_method="spawn")``, gives each the environment
torchrun would (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT on a free port), calls ``function(*args)`` there, and returns rank 0's return value.

Why it is slower to start than torchrun's relaunch of a script: each child is a new interpreter
that imports torch again and unpickles the model and the data; the results travel back through
a file. See docs/strategies.md.

Hangs: the children create their process group with the caller's ``timeout``, so a collective or
a rendezvous that waits for a dead peer raises; ``ProcessContext.join`` then terminates the other
children and raises in the parent (https://pytorch.org/docs/stable/multiprocessing.html#spawning-subprocesses).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

_RESULT = "result.pt"


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dumps_checked(named: dict[str, Any]) -> bytes:
    """Pickle ``named`` (argument name -> value); on failure name the argument and the fix.

    Raises:
        ValueError: an argument cannot be pickled (a lambda, a local class, an open file, ...), or
            refers to code defined interactively (``__main__`` of a notebook or REPL), which a spawned
            interpreter cannot import.
    """
    interactive = not hasattr(sys.modules.get("__main__"), "__file__")
    for name, value in named.items():
        try:
            data = pickle.dumps(value)
        except Exception as err:  # noqa: BLE001 - re-raised with the fix
            raise ValueError(f"strategy='ddp_spawn' sends {name} to new processes by pickling, but it cannot be "
                             f"pickled ({type(err).__name__}: {err}). Use module-level functions and classes "
                             "(def, not lambda; e.g. functools.partial(torch.optim.AdamW, lr=1e-3) as the "
                             "optimizer factory), or strategy='ddp' from a script") from None
        if interactive and b"__main__" in data:
            raise ValueError(f"strategy='ddp_spawn': {name} uses a class or function defined in this interactive "
                             "session (__main__), which spawned processes cannot import. Move it into a .py module "
                             "and import it from there")
    return pickle.dumps(named)


def _child(local_rank: int, function: Callable, payload: bytes, nprocs: int, port: int, out_dir: str) -> None:
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(nprocs),
                       "LOCAL_WORLD_SIZE": str(nprocs), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    import torch

    if "OMP_NUM_THREADS" not in os.environ:  # share the cores, as torchrun's workers do (launch.worker_env)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
    result = function(**pickle.loads(payload))
    if local_rank == 0:
        torch.save(result, Path(out_dir) / _RESULT)


def run(function: Callable, kwargs: dict[str, Any], nprocs: int) -> Any:
    """Run ``function(**kwargs)`` in ``nprocs`` spawned processes; return rank 0's result.

    Args:
        function: a module-level function (pickled by reference).
        kwargs: its arguments, pickled once here (see :func:`dumps_checked`).
        nprocs: processes to start on this machine (the world size).

    Raises:
        ValueError: an argument cannot be pickled.
        torch.multiprocessing.ProcessRaisedException: a child raised (its traceback is included);
            the other children are terminated.
        torch.multiprocessing.ProcessExitedException: a child died (e.g. killed by a signal).
    """
    import torch
    import torch.multiprocessing as mp

    payload = dumps_checked(kwargs)
    with tempfile.TemporaryDirectory(prefix="trainscale-spawn-") as out_dir:
        ctx = mp.start_processes(_child, args=(function, payload, nprocs, free_port(), out_dir), nprocs=nprocs,
                                 join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=1.0):
                pass
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        # Our own child wrote this file a moment ago; it holds arbitrary picklable results.
        return torch.load(Path(out_dir) / _RESULT, weights_only=False)
