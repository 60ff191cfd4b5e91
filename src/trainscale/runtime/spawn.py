"""Start a job's processes on this machine with ``torch.multiprocessing``: the start method of
``strategy="ddp_spawn"`` ("spawn") and ``strategy="ddp_notebook"`` ("fork").

``run(function, kwargs, nprocs, start_method)`` starts ``nprocs`` children with
``torch.multiprocessing.start_processes``, gives each the environment torchrun would (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT on a free port),
calls ``function(**kwargs)`` there and returns rank 0's return value (through a file).

- "spawn": each child is a fresh interpreter. ``function`` and ``kwargs`` are pickled once with
  ``cloudpickle`` (so lambdas and classes defined in ``__main__`` or a notebook travel by value)
  into a file of a per-job temporary directory, which the children read and which is removed
  afterwards. Python's spawn imports the main script again in every child
  (https://docs.python.org/3/library/multiprocessing.html#the-spawn-and-forkserver-start-methods).
- "fork": each child is a copy of this process; nothing is pickled, so anything defined in a
  notebook cell works. CUDA cannot be used in a forked child once the parent has initialised it:
  refused before forking. GNU OpenMP (torch's CPU thread pool on Linux) is not fork-safe: a forked
  child that runs a parallel region after the parent ran one hangs (GCC bug 60035; seen here with
  torch 2.13), so each forked rank computes with one intra-op thread.

Never blocking on a dead child: Python's spawn writes its (small) bootstrap data into a pipe while
it still holds the pipe's read end, so a child that dies during bootstrap while the parent writes
a large payload into the pipe hangs the parent forever; the payload therefore goes through the
file. The parent then waits on the children's sentinels (``ProcessContext.join`` in a loop), so a
child that dies wakes it: a child that died before reaching :func:`_child` died while bootstrapping
(no ``if __name__ == "__main__":`` guard, a program read from stdin) and the error says so and how
to fix it.

Hangs: the children create their process group with the caller's ``timeout``, so a collective or
a rendezvous that waits for a dead peer raises; ``ProcessContext.join`` then ends the other
children (after a grace period) and raises the child's traceback in the parent
(https://pytorch.org/docs/stable/multiprocessing.html#spawning-subprocesses).
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
START_METHODS = {"spawn": "ddp_spawn", "fork": "ddp_notebook"}  # start method -> the strategy name users pass
# Seconds the other children get to end by themselves after one failed, then again after SIGTERM
# before SIGKILL (torch's default is 30 s: too long for a rank stuck in a rendezvous with a dead peer).
_GRACE_S = 3.0


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dump_checked(function: Callable, kwargs: dict[str, Any], file: Any) -> None:
    """Pickle ``(function, kwargs)`` with cloudpickle into ``file``; on failure name the argument that
    cannot be pickled and the fix.

    Raises:
        ValueError: an argument cannot be pickled even by value (an open file, a lock, a generator, ...).
        ModuleNotFoundError: cloudpickle is not installed (names the extra to install).
    """
    try:
        import cloudpickle
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("strategy='ddp_spawn' sends the model, data and functions to new processes with "
                                  "cloudpickle: pip install cloudpickle (or 'trainscale[spawn]'), or use "
                                  "strategy='ddp_notebook' (fork: nothing is pickled)") from err
    try:
        cloudpickle.dump((function, kwargs), file)
    except Exception:  # noqa: BLE001 - find the argument that fails, then re-raise with the fix
        named = {"the function": function, **kwargs.get("kwargs", {}), **kwargs}  # Runtime.launch keywords first, by name
        for name, value in named.items():
            try:
                cloudpickle.dumps(value)
            except Exception as err:  # noqa: BLE001
                raise ValueError(f"strategy='ddp_spawn' sends {name} to new processes by pickling (cloudpickle), "
                                 f"but it cannot be pickled ({type(err).__name__}: {err}). Pass objects without open "
                                 "files, locks or generators, or use strategy='ddp_notebook' (fork: the children "
                                 "are copies of this process and nothing is pickled)") from None
        raise


def _child(local_rank: int, job_dir: str, nprocs: int, port: int, inherited: tuple | None) -> None:
    """One rank. ``inherited``: ``(function, kwargs)`` under fork; None under spawn (read the payload file)."""
    (Path(job_dir) / f"started.{local_rank}").touch()  # bootstrap is over: this child runs our code
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(nprocs),
                       "LOCAL_WORLD_SIZE": str(nprocs), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    import torch

    if inherited is not None:  # forked: GNU OpenMP hangs in a child with >1 thread (module docstring)
        torch.set_num_threads(1)
        function, kwargs = inherited
    else:
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores, as torchrun's workers do (launch.worker_env)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
        with open(Path(job_dir) / _PAYLOAD, "rb") as f:
            function, kwargs = pickle.load(f)  # written by this job's parent a moment ago
    result = function(**kwargs)
    if local_rank == 0:
        torch.save(result, Path(job_dir) / _RESULT)


def run(function: Callable, kwargs: dict[str, Any], nprocs: int, start_method: str = "spawn") -> Any:
    """Run ``function(**kwargs)`` in ``nprocs`` new processes on this machine; return rank 0's result.

    Args:
        function: any callable (module-level, a lambda, defined in ``__main__`` or a notebook).
        kwargs: its arguments. Under "spawn" pickled once here with cloudpickle (see :func:`dump_checked`);
            under "fork" inherited by the children as they are.
        nprocs: processes to start (the world size).
        start_method: "spawn" (``ddp_spawn``) or "fork" (``ddp_notebook``).

    Raises:
        ValueError: an unknown start method, or (spawn) an argument that cannot be pickled.
        RuntimeError: (fork) CUDA was initialised in this process; or a child died while it was
            starting (names the fix: an ``if __name__ == "__main__":`` guard, a script file).
        torch.multiprocessing.ProcessRaisedException: a child raised (its traceback is included);
            the other children are ended.
        torch.multiprocessing.ProcessExitedException: a child died (e.g. killed by a signal).
    """
    import torch
    import torch.multiprocessing as mp

    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r}; choose one of {', '.join(map(repr, START_METHODS))}")
    if start_method == "fork":
        _check_fork_is_safe()
        # DistributedDataParallel imports torch._dynamo in each rank (about 3 s of CPU here): imported once in
        # this process, every forked rank of this job and of the next ones has it already. It starts no thread.
        import torch._dynamo  # noqa: F401
    with tempfile.TemporaryDirectory(prefix="trainscale-spawn-") as job_dir:  # mode 0700, removed at the end
        inherited = (function, kwargs) if start_method == "fork" else None
        if inherited is None:
            with open(Path(job_dir) / _PAYLOAD, "wb") as f:
                dump_checked(function, kwargs, f)
        ctx = mp.start_processes(_child, args=(job_dir, nprocs, free_port(), inherited), nprocs=nprocs,
                                 join=False, start_method=start_method)
        _watch(ctx, Path(job_dir), start_method)
        # Our own child wrote this file a moment ago; it holds arbitrary picklable results.
        return torch.load(Path(job_dir) / _RESULT, weights_only=False)


def _check_fork_is_safe() -> None:
    """Refuse to fork once CUDA is initialised: a forked child cannot use it (torch raises "Cannot
    re-initialize CUDA in forked subprocess" in every rank)."""
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("strategy='ddp_notebook' starts its processes with fork, but CUDA was already initialised "
                           "in this process (a torch.cuda call, a model or tensor moved to the GPU), and forked "
                           "processes cannot use CUDA then. Remove those calls before fit and restart the Python "
                           "kernel, or use strategy='ddp_spawn' (fresh processes)")


def _watch(ctx: Any, job_dir: Path, start_method: str) -> None:
    """Wait until every child has ended; on a failure end the others and raise (see the module docstring)."""
    import torch.multiprocessing as mp

    try:
        while not ctx.join(timeout=1.0, grace_period=_GRACE_S):
            pass
    except mp.ProcessExitedException as err:
        if not (job_dir / f"started.{err.error_index}").exists():
            raise RuntimeError(_bootstrap_error(err.error_index, err.exit_code, start_method)) from err
        raise
    finally:  # e.g. KeyboardInterrupt in the parent: leave no child behind
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
                process.join()


def _bootstrap_error(rank: int, exit_code: int, start_method: str) -> str:
    """The message for a child that died before running any trainscale code."""
    strategy = START_METHODS[start_method]
    message = (f"strategy={strategy!r}: the process of rank {rank} died while starting (exit code {exit_code}), before "
               "any trainscale code ran in it; its own error is printed above. ")
    if start_method != "spawn":
        return message + "Look there for the cause."
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    message += ("Under spawn each new process imports the main script again, so code at the script's top level runs "
                "again in every process: add `if __name__ == '__main__':` and put the code that starts training under "
                "it (https://docs.python.org/3/library/multiprocessing.html#multiprocessing-safe-main-import).")
    if main_file is not None and not os.path.isfile(main_file):
        message += (f" This program was read from {main_file}, which a new process cannot read again: save it as a "
                    "file with that guard and run `python file.py`, or use strategy='ddp_notebook' (fork: the "
                    "processes are copies of this one and import nothing)")
    return message
