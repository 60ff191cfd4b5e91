"""Start a job's processes with ``torch.multiprocessing`` (spawn), for ``strategy="ddp_spawn"``.

``run(function, args, nprocs)`` pickles ``args`` once in the parent (a clear error names the
argument that cannot be pickled) into a file of a per-job temporary directory (removed afterwards),
starts ``nprocs`` fresh Python interpreters with
``torch.multiprocessing.start_processes(start_method="spawn")``, gives each the environment
torchrun would (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT on a free port), calls ``function(**args)`` there, and returns rank 0's return value.

Why it is slower to start than torchrun's relaunch of a script: each child is a new interpreter
that imports torch again and unpickles the model and the data; the results travel back through
a file. See docs/strategies.md.

Never blocking on a dead child: Python's spawn writes its bootstrap data into a pipe while it still
holds the pipe's read end, so a child that dies during bootstrap while the parent writes a large
payload into that pipe hangs the parent forever; the payload therefore goes through the file and
the pipe carries only a few hundred bytes. The parent then waits on the children's sentinels
(``ProcessContext.join`` in a loop), so a child that dies wakes it: a child that died before
reaching :func:`_child` died while bootstrapping (Python's spawn imports the main script again in
every child: a script without an ``if __name__ == "__main__":`` guard, a program read from stdin;
https://docs.python.org/3/library/multiprocessing.html#the-spawn-and-forkserver-start-methods) and
the error says so and how to fix it.

Hangs: the children create their process group with the caller's ``timeout``, so a collective or
a rendezvous that waits for a dead peer raises; ``ProcessContext.join`` then ends the other
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
_PAYLOAD = "payload.pkl"
# Seconds the other children get to end by themselves after one failed, then again after SIGTERM
# before SIGKILL (torch's default is 30 s: too long for a rank stuck in a rendezvous with a dead peer).
_GRACE_S = 3.0


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


def _child(local_rank: int, job_dir: str, nprocs: int, port: int) -> None:
    (Path(job_dir) / f"started.{local_rank}").touch()  # bootstrap is over: this child runs our code
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(nprocs),
                       "LOCAL_WORLD_SIZE": str(nprocs), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    import torch

    if "OMP_NUM_THREADS" not in os.environ:  # share the cores, as torchrun's workers do (launch.worker_env)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
    function, payload = pickle.loads((Path(job_dir) / _PAYLOAD).read_bytes())  # written by our parent
    result = function(**pickle.loads(payload))
    if local_rank == 0:
        torch.save(result, Path(job_dir) / _RESULT)


def run(function: Callable, kwargs: dict[str, Any], nprocs: int) -> Any:
    """Run ``function(**kwargs)`` in ``nprocs`` spawned processes; return rank 0's result.

    Args:
        function: a module-level function (pickled by reference).
        kwargs: its arguments, pickled once here (see :func:`dumps_checked`).
        nprocs: processes to start on this machine (the world size).

    Raises:
        ValueError: an argument cannot be pickled.
        RuntimeError: a child died while starting (names the fix: an ``if __name__ == "__main__":``
            guard, a script file).
        torch.multiprocessing.ProcessRaisedException: a child raised (its traceback is included);
            the other children are ended.
        torch.multiprocessing.ProcessExitedException: a child died (e.g. killed by a signal).
    """
    import torch
    import torch.multiprocessing as mp

    payload = dumps_checked(kwargs)
    with tempfile.TemporaryDirectory(prefix="trainscale-spawn-") as job_dir:  # mode 0700, removed at the end
        (Path(job_dir) / _PAYLOAD).write_bytes(pickle.dumps((function, payload)))
        ctx = mp.start_processes(_child, args=(job_dir, nprocs, free_port()), nprocs=nprocs, join=False,
                                 start_method="spawn")
        _watch(ctx, Path(job_dir))
        # Our own child wrote this file a moment ago; it holds arbitrary picklable results.
        return torch.load(Path(job_dir) / _RESULT, weights_only=False)


def _watch(ctx: Any, job_dir: Path) -> None:
    """Wait until every child has ended; on a failure end the others and raise (see the module docstring)."""
    import torch.multiprocessing as mp

    try:
        while not ctx.join(timeout=1.0, grace_period=_GRACE_S):
            pass
    except mp.ProcessExitedException as err:
        if not (job_dir / f"started.{err.error_index}").exists():
            raise RuntimeError(_bootstrap_error(err.error_index, err.exit_code)) from err
        raise
    finally:  # e.g. KeyboardInterrupt in the parent: leave no child behind
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
                process.join()


def _bootstrap_error(rank: int, exit_code: int) -> str:
    """The message for a child that died before running any trainscale code."""
    message = (f"strategy='ddp_spawn': the process of rank {rank} died while starting (exit code {exit_code}), before "
               "any trainscale code ran in it; its own error is printed above. ")
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    message += ("Under spawn each new process imports the main script again, so code at the script's top level runs "
                "again in every process: add `if __name__ == '__main__':` and put the code that starts training under "
                "it (https://docs.python.org/3/library/multiprocessing.html#multiprocessing-safe-main-import).")
    if main_file is not None and not os.path.isfile(main_file):
        message += (f" This program was read from {main_file}, which a new process cannot read again: save it as a "
                    "file with that guard and run `python file.py`")
    return message
