"""How N processes come to be: torchrun (``torch.distributed.run``), never a launcher of our own.

- ``trainscale run -n N script.py ARGS`` and a script that asks for ``devices=N`` outside any
  launcher both become ``python -m torch.distributed.run --nproc-per-node N ... script.py ARGS``.
  torchrun starts the workers, sets RANK/WORLD_SIZE/LOCAL_RANK/..., hosts the rendezvous and,
  with ``--max-restarts``, restarts failed workers
  (https://pytorch.org/docs/stable/elastic/run.html).
- Importing this module does not import torch (the CLI uses it for ``--help``).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence


def torchrun_args(nproc_per_node: int, *, nnodes: str | int = 1, node_rank: int | None = None,
                  rdzv_backend: str | None = None, rdzv_endpoint: str | None = None,
                  max_restarts: int = 0, run_id: str | None = None, env: dict | None = None) -> list[str]:
    """torchrun's own flags for a job (without the entry point).

    One node without a rendezvous endpoint uses ``--standalone`` (a local c10d rendezvous on a
    free port, with a fresh run id). Several nodes need ``rdzv_endpoint`` (host:port of the rendezvous)
    and a run id shared by every node and by no other job (``--rdzv-id``; torchrun's default, "none",
    is the same for every job, so a restarted job could resume another one's "last" checkpoint):
    ``run_id``, else ``SLURM_JOB_ID`` from ``env`` (default ``os.environ``).

    Raises:
        ValueError: a non-positive process count, or several nodes without an endpoint or a run id.
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node} must be >= 1")
    args = [f"--nproc-per-node={nproc_per_node}"]
    single_node = str(nnodes) in ("1", "1:1")
    if single_node and rdzv_endpoint is None:
        args.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError(f"nnodes={nnodes} needs a rendezvous endpoint: pass --rdzv-endpoint HOST:PORT "
                             "(the same on every node)")
        args += [f"--nnodes={nnodes}", f"--rdzv-backend={rdzv_backend or 'c10d'}",
                 f"--rdzv-endpoint={rdzv_endpoint}"]
        if node_rank is not None:
            args.append(f"--node-rank={node_rank}")
        run_id = run_id or (os.environ if env is None else env).get("SLURM_JOB_ID")
        if not run_id:
            raise ValueError(f"nnodes={nnodes} needs a job id shared by every node and new for each job: pass "
                             "--rdzv-id ID (the same on every node, e.g. the date and time the job was submitted); "
                             "inside a SLURM job SLURM_JOB_ID is taken")
        args.append(f"--rdzv-id={run_id}")
    if max_restarts:
        args.append(f"--max-restarts={max_restarts}")
    return args


def worker_env(nproc_per_node: int, env: dict | None = None) -> dict:
    """The environment for torchrun: the caller's, plus sane defaults it does not override.

    - OMP_NUM_THREADS: CPU cores shared among the node's processes (torchrun would force 1).
    - TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: restarted gloo workers otherwise may read the previous
      round's addresses from the shared store and hang (seen with torch 2.13; shared/FACTS).
    """
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc_per_node))))
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


def current_entry_point() -> list[str]:
    """The program this process runs, as torchrun's trailing arguments: ``script.py ARGS`` or
    ``-m module ARGS``.

    Raises:
        RuntimeError: in a notebook, a REPL or ``python -c``, where there is no script to relaunch.
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return ["-m", name, *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or not os.path.isfile(script):
        raise RuntimeError("devices>1 needs several processes, but this program is not a script that can be "
                           "relaunched (notebook, REPL or python -c). Pass strategy='ddp_notebook' (the processes "
                           "are forked from this one), or run a script with `trainscale run -n N script.py` or "
                           "torchrun")
    return [script, *sys.argv[1:]]


def exec_torchrun(torchrun: Sequence[str], entry: Sequence[str], nproc_per_node: int) -> None:
    """Replace this process by ``python -m torch.distributed.run TORCHRUN ENTRY``. Does not return."""
    argv = [sys.executable, "-m", "torch.distributed.run", *torchrun]
    if entry and entry[0] == "-m":
        argv += ["--module", *entry[1:]]
    else:
        argv += list(entry)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, worker_env(nproc_per_node))


def relaunch_current_script(nproc_per_node: int, num_nodes: int = 1) -> None:
    """Re-execute the running script under torchrun with ``nproc_per_node`` workers (one node).

    Raises:
        RuntimeError: the program cannot be relaunched (see :func:`current_entry_point`), or
            ``num_nodes > 1`` (each node must be started by its own ``trainscale run``/torchrun/srun).
    """
    if num_nodes > 1:
        raise RuntimeError(f"num_nodes={num_nodes}: start the script on every node with "
                           "`trainscale run --nnodes N --node-rank R --rdzv-endpoint HOST:PORT -n DEVICES script.py`")
    exec_torchrun(torchrun_args(nproc_per_node), current_entry_point(), nproc_per_node)
