"""How N processes come to be: torchrun (``torch.distributed.run``), never a launcher of our own.

- A process that a launcher started once per node with several processes to run there (a Kubernetes
  pod started as ``python train.py``: ``World.per_node``) becomes torchrun with that launcher's node count,
  node rank and address (:func:`start_node_ranks`).
- ``trainscale run -n N script.py ARGS`` and a script that asks for ``devices=N`` outside any
  launcher both become torchrun (``python -m trainscale.runtime.agent --nproc-per-node N ... script.py ARGS``,
  ``agent.py``): ``trainscale run`` as its child (:func:`run_torchrun`), the script by
  :func:`become_torchrun` (torchrun's agent in its own process when light, else ``exec``); either prints the
  failing rank's own error last.
  torchrun starts the workers, sets RANK/WORLD_SIZE/LOCAL_RANK/..., hosts the rendezvous and,
  with ``--max-restarts``, restarts failed workers
  (https://pytorch.org/docs/stable/elastic/run.html).
- Every worker starts as ``python -m trainscale.runtime.worker SCRIPT ARGS`` (``worker.py``): it dies
  with its agent, and records its exception for :func:`run_torchrun` to print last. The entry
  follows ``--`` so torchrun never parses the script's own flags (``--d 192`` was torchrun's
  "ambiguous option").
- Importing this module does not import torch (the CLI uses it for ``--help``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

from trainscale.runtime.agent import EXITS_ENV, EXITS_FILE, REPORT_FLAG
from trainscale.runtime.worker import ERROR_FILE, HOLD_ENV, die_with_parent

_NNODES = re.compile(r"^[1-9]\d*(:[1-9]\d*)?$")
_FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


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
        ValueError: a non-positive process count, ``nnodes`` not ``N`` or ``MIN:MAX``, a negative
            ``max_restarts``, or several nodes without an endpoint or a run id.
    """
    _check_counts(nproc_per_node, nnodes, max_restarts)
    args = [f"--nproc-per-node={nproc_per_node}"]
    if str(nnodes) in ("1", "1:1") and rdzv_endpoint is None:
        args.append("--standalone")
    else:
        args += _rendezvous_args(nnodes, node_rank, rdzv_backend, rdzv_endpoint,
                                 run_id or (os.environ if env is None else env).get("SLURM_JOB_ID"))
    if max_restarts:
        args.append(f"--max-restarts={max_restarts}")
    return args


def _check_counts(nproc_per_node: int, nnodes: str | int, max_restarts: int) -> None:
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node} must be >= 1")
    low, _, high = str(nnodes).partition(":")
    if not _NNODES.match(str(nnodes)) or (high and int(low) > int(high)):
        raise ValueError(f"--nnodes {nnodes!r} must be a node count N or an elastic range MIN:MAX (MIN <= MAX), "
                         "e.g. --nnodes 2 or --nnodes 1:4")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts {max_restarts} must be >= 0 (0: no restart)")


def _rendezvous_args(nnodes: str | int, node_rank: int | None, rdzv_backend: str | None, rdzv_endpoint: str | None,
                     run_id: str | None) -> list[str]:
    """torchrun's flags for a c10d rendezvous of several nodes (see :func:`torchrun_args`)."""
    if rdzv_endpoint is None:
        raise ValueError(f"nnodes={nnodes} needs a rendezvous endpoint: pass --rdzv-endpoint HOST:PORT "
                         "(the same on every node)")
    if not run_id:
        raise ValueError(f"nnodes={nnodes} needs a job id shared by every node and new for each job: pass "
                         "--rdzv-id ID (the same on every node, e.g. the date and time the job was submitted); "
                         "inside a SLURM job SLURM_JOB_ID is taken")
    args = [f"--nnodes={nnodes}", f"--rdzv-backend={rdzv_backend or 'c10d'}", f"--rdzv-endpoint={rdzv_endpoint}"]
    if node_rank is not None:
        args.append(f"--node-rank={node_rank}")
    return args + [f"--rdzv-id={run_id}"]


def worker_env(nproc_per_node: int, env: dict | None = None, restarts: bool = True) -> dict:
    """The environment for torchrun: the caller's, plus sane defaults it does not override.

    - OMP_NUM_THREADS: CPU cores shared among the node's processes (torchrun would force 1).
    - TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, when torchrun may start the workers again (``restarts``:
      ``--max-restarts``, or an elastic node count): torchrun's agent otherwise shares its rendezvous store with
      the workers across restart rounds, and restarted gloo workers may read the previous round's addresses
      and hang in init_process_group (seen with torch 2.13; pytorch/pytorch#135712). With one round only, the
      workers keep the agent's store (as under plain torchrun) instead of starting one of their own.
    """
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc_per_node))))
    if restarts:
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


def torchrun_argv(torchrun: Sequence[str], entry: Sequence[str]) -> list[str]:
    """``python -m trainscale.runtime.agent TORCHRUN --module -- trainscale.runtime.worker ENTRY``: torchrun
    (``torch.distributed.run``), which also writes down the exit codes of failed workers (``agent.py``).

    After ``--`` torchrun parses nothing: the script's flags reach the script as they are.
    """
    return [sys.executable, "-m", "trainscale.runtime.agent", *torchrun, "--module", "--",
            "trainscale.runtime.worker", *entry]


# The most resident memory a script's process may hold and still become torchrun's agent itself (see
# become_torchrun): what it built before Trainer() then stays for the whole job, so at most this much.
AGENT_IN_PROCESS_MAX_RSS = 1 << 30  # bytes


def agent_in_process_refusal(max_rss: int = AGENT_IN_PROCESS_MAX_RSS) -> str | None:
    """Why this process must not host torchrun's agent (None: it may): a CUDA context is initialised (it would
    hold GPU memory on the first GPU for the whole job, beside the workers), or the resident memory is ``max_rss``
    bytes or more (the script's data and model, kept while the workers run), or it cannot be read (psutil)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "a CUDA context is initialised in this process"
    import psutil

    try:
        rss = psutil.Process().memory_info().rss
    except psutil.Error:
        return "its resident memory cannot be read"
    if rss >= max_rss:
        return f"it holds {rss / 2**30:.2f} GiB (>= {max_rss / 2**30:.2f} GiB)"
    return None


def become_torchrun(torchrun: Sequence[str], entry: Sequence[str], nproc_per_node: int) -> None:
    """Become ``python -m torch.distributed.run TORCHRUN ENTRY``, torchrun's agent starting the workers. Does not
    return.

    A light process (:func:`agent_in_process_refusal` is None: no CUDA context, under 1 GiB resident) runs
    torchrun's own ``main`` itself, with the torch it has imported; then exits with torchrun's status (after its
    failure report, as torchrun prints it) without the script's atexit handlers, which belong to the workers.
    Any other process is replaced (``exec``) by a new interpreter running torchrun, which imports torch again
    (about 1.2 s more to the first step here, docs/clusters.md) but keeps nothing of the script."""
    sys.stdout.flush()
    sys.stderr.flush()
    # one round: a relaunch and a pod's launch have no --max-restarts and a fixed node count
    env = worker_env(nproc_per_node, restarts=any(a.startswith("--max-restarts") for a in torchrun))
    argv = torchrun_argv(torchrun, entry)  # python -m trainscale.runtime.agent TORCHRUN ...
    if agent_in_process_refusal() is not None:
        os.execve(sys.executable, [*argv[:3], REPORT_FLAG, *argv[3:]], env)
    from trainscale.runtime.agent import main_reporting

    os.environ.update(env)
    try:  # the failing rank's own error printed last, after torchrun's summary (as trainscale run does)
        status = main_reporting(argv[3:])
    except SystemExit as done:  # torchrun refused its arguments
        status = done.code if isinstance(done.code, int) else 1
    except BaseException:  # the agent itself failed: its traceback, then exit 1
        import traceback

        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # as exec would


def relaunch_current_script(nproc_per_node: int, num_nodes: int = 1) -> None:
    """Re-execute the running script under torchrun with ``nproc_per_node`` workers (one node).

    Raises:
        RuntimeError: the program cannot be relaunched (see :func:`current_entry_point`), or
            ``num_nodes > 1`` (each node must be started by its own ``trainscale run``/torchrun/srun).
    """
    if num_nodes > 1:
        raise RuntimeError(f"num_nodes={num_nodes}: start the script on every node with "
                           "`trainscale run --nnodes N --node-rank R --rdzv-endpoint HOST:PORT -n DEVICES script.py`")
    become_torchrun(torchrun_args(nproc_per_node), current_entry_point(), nproc_per_node)


def node_torchrun_args(world) -> list[str]:
    """torchrun's flags for a per-node launch (``World.per_node``, e.g. a Kubernetes pod): the node's
    ``local_world_size`` processes, with the launcher's node count and this node's rank, meeting at the
    launcher's address in torchrun's static rendezvous, hosted by node 0's agent (the workers then use
    its store: no other port has to be reachable)."""
    return [f"--nproc-per-node={world.local_world_size}", f"--nnodes={world.num_nodes}",
            f"--node-rank={world.node_rank}", "--rdzv-backend=static", f"--master-addr={world.master_addr}",
            f"--master-port={world.master_port}"]


def start_node_ranks(world) -> None:
    """Make this process, the one a per-node launcher started on this node (``World.per_node``), torchrun
    (:func:`become_torchrun`) starting the node's ranks (:func:`node_torchrun_args`). Does not return.

    Raises:
        RuntimeError: the program cannot be relaunched (see :func:`current_entry_point`).
    """
    entry = current_entry_point()
    print(f"trainscale: {world.detected_from}; node {world.node_rank} of {world.num_nodes} starts "
          f"{world.local_world_size} processes with torchrun, meeting at {world.master_addr}:{world.master_port}",
          file=sys.stderr, flush=True)
    become_torchrun(node_torchrun_args(world), entry, world.local_world_size)


# -- trainscale run: checks before the launch, torchrun as a child, the failure printed last ----------
def check_entry(entry: Sequence[str]) -> None:
    """Fail before any process starts when the program cannot run: a missing script, a syntax
    error, an unknown module. (Under ``--max-restarts`` such errors were restarted every time.)

    Raises:
        ValueError: naming the problem and the fix.
    """
    if entry[:1] == ["-m"]:
        import importlib.util

        if len(entry) < 2 or importlib.util.find_spec(entry[1]) is None:
            raise ValueError(f"no module named {entry[1:2]!r} on this Python's path: check the name, or install it")
        return
    script = entry[0]
    if not os.path.isfile(script):
        raise ValueError(f"script {script!r} not found (working directory {os.getcwd()!r}): check the path")
    with open(script, "rb") as f:
        source = f.read()
    try:
        compile(source, script, "exec")
    except SyntaxError as err:
        raise ValueError(f"{script}:{err.lineno}: SyntaxError: {err.msg}; fix it before launching") from None


def check_rendezvous(endpoint: str, wait: float = 5.0) -> None:
    """Fail within seconds when ``HOST:PORT`` is held by a program that is not a PyTorch rendezvous
    store: torchrun would otherwise connect to it and wait forever, printing nothing.

    Nothing listening is fine (this node's torchrun will host it, or the host node is not up yet), and
    so is a real store (another node's torchrun on this machine hosts it): a ``TCPStore`` client must
    answer within ``wait`` seconds (in a thread: its own timeout does not apply to a silent peer).

    Raises:
        ValueError: the endpoint is not HOST:PORT, the host does not resolve, or the port is held.
    """
    host, _, port_text = endpoint.rpartition(":")
    if not host or not port_text.isdigit():
        raise ValueError(f"--rdzv-endpoint {endpoint!r} must be HOST:PORT, e.g. 10.0.0.1:29400")
    port = int(port_text)
    try:
        socket.getaddrinfo(host, port)
        socket.create_connection((host, port), timeout=2.0).close()
    except socket.gaierror:
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: host {host!r} does not resolve; use the address of "
                         "the node that hosts the rendezvous (the same on every node)") from None
    except OSError:
        return  # nothing listens there yet
    import torch.distributed  # noqa: F401 - before the clock: on a busy machine its import alone can take `wait`
    answered = []
    threading.Thread(target=_probe_store, args=(host, port, answered), daemon=True).start()
    deadline = time.monotonic() + wait
    while not answered and time.monotonic() < deadline:
        time.sleep(0.05)
    if not answered or answered[0] is not None:
        raise ValueError(f"the rendezvous endpoint {host}:{port} is held by another program, not a PyTorch "
                         f"rendezvous store ({answered[0] if answered else f'no answer within {wait:.0f} s'}); "
                         f"pass --rdzv-endpoint {host}:<a free port> on every node, or stop the program that holds "
                         f"port {port} (`ss -ltnp 'sport = :{port}'` names it)")


def _probe_store(host: str, port: int, answered: list) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False).num_keys()
        answered.append(None)
    except Exception as err:  # noqa: BLE001 - whatever the peer did, it is not a store
        answered.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")


def run_torchrun(torchrun: Sequence[str], entry: Sequence[str], nproc_per_node: int, max_restarts: int = 0) -> int:
    """Run torchrun as a child of this process and return its exit code.

    The child dies with this process (``PR_SET_PDEATHSIG``), its workers with it. SIGTERM, SIGHUP,
    SIGQUIT, SIGUSR1 and SIGUSR2 sent to this process are passed on; SIGINT (Ctrl-C) reaches the
    whole process group from the terminal. A worker error that would recur at every restart (see
    ``worker.py``) stops torchrun at once. When the job fails, the first failed rank's own error is
    printed last on stderr, after torchrun's summary.
    """
    log_dir = tempfile.mkdtemp(prefix="trainscale-run-")
    argv = torchrun_argv([f"--log-dir={log_dir}", *torchrun], entry)
    try:
        env = worker_env(nproc_per_node)
        env[EXITS_ENV] = log_dir
        if max_restarts:  # a worker with an error a restart cannot fix waits for _wait to stop torchrun
            env[HOLD_ENV] = "1"
        proc = subprocess.Popen(argv, env=env, preexec_fn=die_with_parent)
        previous = {sig: signal.signal(sig, lambda s, _f: proc.send_signal(s)) for sig in _FORWARDED}
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches torchrun itself
        try:
            stopped = _wait(proc, log_dir, max_restarts)
        finally:  # every disposition as it was, Ctrl-C included, whatever the caller does next
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if stopped:
            print(f"\ntrainscale run: not restarted (--max-restarts {max_restarts}): the error below happened before "
                  "the process group existed and would recur at every restart; fix it and run again",
                  file=sys.stderr, flush=True)
        report = failure_report(log_dir) if proc.returncode != 0 else None
        if report:
            print(report, file=sys.stderr, flush=True)
        return proc.returncode
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def _wait(proc: subprocess.Popen, log_dir: str, max_restarts: int) -> bool:
    """Wait for torchrun; stop it when a worker recorded an error that a restart cannot fix. True if stopped."""
    while proc.poll() is None:
        time.sleep(0.2)
        if max_restarts and any(not r["restartable"] for r in _records(log_dir)):
            proc.terminate()
            proc.wait()
            return True
    return False


def _records(log_dir: str) -> list[dict]:
    out = []
    for path in glob.glob(os.path.join(log_dir, "**", ERROR_FILE), recursive=True):
        try:
            with open(path, encoding="utf-8") as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue  # being written
    return out


def failure_report(log_dir: str, label: str = "trainscale run") -> str | None:
    """The first failed worker's error as recorded by ``worker.py`` (rank, type, message, the user's
    frames), then, last, each rank that ended without a Python exception (``os._exit``, a crash in C code, a
    signal other than the agent's own SIGTERM) with its exit code from torchrun (``agent.py``): its peers' errors
    (a collective whose peer left) follow from it. None when there is neither."""
    records = _records(log_dir)
    parts = []
    if records:
        first = min(records, key=lambda r: (r["time"], int(r["rank"] or 0)))
        parts.append(f"\n{label}: rank {first['rank']} (node {first['node_rank']}, local rank {first['local_rank']}) "
                     f"failed first:\n{first['traceback'].rstrip()}")
    recorded = {str(r["rank"]) for r in records}
    for ended in _silent_exits(log_dir):
        if str(ended["rank"]) in recorded:
            continue
        code = ended["exitcode"]
        how = f"exited with code {code}" if code >= 0 else f"was killed by {signal.Signals(-code).name}"
        after = "; the error above follows from it (a peer that left)" if records else ""
        parts.append(f"\n{label}: rank {ended['rank']} (local rank {ended['local_rank']}) {how} without a Python "
                     f"exception (os._exit, a crash in C code, or a signal: see its output above){after}")
    return "\n".join(parts) or None


def _silent_exits(log_dir: str) -> list[dict]:
    """The failed workers torchrun's agent reported (``agent.EXITS_FILE``), but those it stopped itself (SIGTERM to
    the group after the first failure)."""
    try:
        with open(os.path.join(log_dir, EXITS_FILE), encoding="utf-8") as f:
            exits = json.load(f)
    except (OSError, ValueError):
        return []
    return [e for e in exits if e["exitcode"] != -signal.SIGTERM]
