"""A process that has imported torch, torch._dynamo and trainscale and forks one child per docs block.

``python tests/docs_examples_server.py FD`` reads requests from the socket ``FD``, one JSON line each:
``{"script": ABSOLUTE PATH, "env": {...}, "stdout": PATH, "stderr": PATH}``. For each it
forks a child, answers ``{"pid": PID}`` (the child's process group), waits for the child and answers
``{"exit": STATUS}`` (the exit code, or minus the signal that ended it) with the CPU seconds of the child and the
processes it waited for (``"cpu_s"``), then reads the next request; it exits at the end of input.

The child is what ``cd DIR && python SCRIPT`` would be, less the imports already done: a new session, the
request's environment, ``sys.argv`` and ``sys.path[0]`` as python sets them, stdin from /dev/null, stdout and
stderr to the request's files, the script run as ``__main__`` (``runpy``), an uncaught exception printed with the
script's frames, and the interpreter's exit (non-daemon threads joined, atexit handlers; see ``exit_as_python``).
Nothing else is shared: the server runs no torch operation and starts no thread (it checks) before it forks, and
Python reseeds ``random`` in a forked child. A script that relaunches itself (``devices=2``) finds itself in ``sys.argv[0]``,
as after ``python SCRIPT``.

The relaunch itself is the one thing done differently (it is tested whole in test_run_cli.py and test_cli.py): the
Trainer's ``launch.become_torchrun`` (torchrun's agent starting ``python -m trainscale.runtime.worker SCRIPT`` N times) hands
its arguments back to this server instead, which forks the N workers from its own state (torch, torch._dynamo and
trainscale imported, about 5 s of CPU each a fresh interpreter pays) and gives each the environment torchrun's agent
gives its workers (``local_elastic_agent.py``: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RUN_ID, ...) on top of the one ``launch.worker_env`` made for torchrun. Each then runs
``trainscale.runtime.worker``'s ``main`` on the script, as under torchrun; their output goes to the block's files;
when one fails, the others are killed, as torchrun's agent does; the status is 1 if any failed.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
import threading
import traceback
import uuid

# what most blocks import; torch._dynamo too: the first optimizer built imports it (torch's ``_disable_dynamo``)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "trainscale.loop.trainer", "trainscale.runtime.runtime",
           "trainscale.models", "trainscale.data")


def serve(sock: socket.socket) -> dict | None:
    """Answer requests until the end of input (returns None); in a forked child, return its request (with
    ``"rank"`` set in a worker forked for a relaunch)."""
    requests = sock.makefile("r")
    for line in requests:
        request = json.loads(line)
        relaunch_file = request["stdout"] + ".relaunch"
        assert threading.active_count() == 1, "the server started a thread: forking would copy its state"
        pid = os.fork()
        if pid == 0:
            requests.close()
            sock.close()
            return {**request, "relaunch_file": relaunch_file}
        sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status, usage = os.wait4(pid, 0)
        cpu = usage.ru_utime + usage.ru_stime
        code = os.waitstatus_to_exitcode(status)
        if code == 0 and os.path.exists(relaunch_file):  # the block asked for its workers
            with open(relaunch_file) as f:
                relaunch = json.load(f)
            workers = start_workers(request, relaunch)
            if isinstance(workers, dict):  # in a forked worker
                requests.close()
                sock.close()
                return workers
            sock.sendall(json.dumps({"pid": workers[0]}).encode() + b"\n")
            code, more_cpu = wait_workers(workers)
            cpu += more_cpu
        sock.sendall(json.dumps({"exit": code, "cpu_s": cpu}).encode() + b"\n")
    return None


def start_workers(request: dict, relaunch: dict) -> list[int] | dict:
    """Fork ``relaunch["nproc"]`` workers in one process group (its id is the first worker's pid), each with the
    variables torchrun's agent sets for a worker (torch/distributed/elastic/agent/server/local_elastic_agent.py)
    over ``relaunch["env"]``. Returns their pids; in a worker, its request."""
    nproc = relaunch["nproc"]
    with socket.socket() as probe:  # rank 0 hosts the store (TORCHELASTIC_USE_AGENT_STORE=False) on a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
              "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
              "TORCHELASTIC_RUN_ID": f"docs-{uuid.uuid4().hex[:8]}", "TORCHELASTIC_USE_AGENT_STORE": "False",
              "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    pids: list[int] = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, pids[0] if pids else 0)
            env = {**relaunch["env"], **common, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            return {**request, "env": env, "entry": relaunch["entry"], "rank": rank}
        os.setpgid(pid, pids[0] if pids else pid)
        pids.append(pid)
    return pids


def wait_workers(pids: list[int]) -> tuple[int, float]:
    """Wait for the workers; when one fails, kill the others (torchrun's agent stops the group). Returns the
    status (0, or 1 if any failed) and their CPU seconds."""
    failed, cpu, left = False, 0.0, set(pids)
    while left:
        pid, status, usage = os.wait4(-pids[0], 0)
        left.discard(pid)
        cpu += usage.ru_utime + usage.ru_stime
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            for other in left:
                os.kill(other, signal.SIGKILL)
    return (1 if failed else 0), cpu


def become(request: dict) -> None:
    """Turn this forked child into ``python SCRIPT`` run in the script's directory (see the module docstring); a
    worker forked for a relaunch, into torchrun's worker: the same, in its group, its output added to the block's."""
    worker = "rank" in request
    if not worker:
        os.setsid()
    script = request["script"]
    folder = os.path.dirname(script)
    os.chdir(folder)
    os.environ.clear()
    os.environ.update(request["env"])
    out_flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if worker else os.O_TRUNC)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], out_flags),
                            (2, request["stderr"], out_flags)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [script]  # as runpy.run_path sets it: the path it runs
    sys.path[0] = folder
    if not worker:
        from trainscale.runtime import launch

        launch.become_torchrun = lambda torchrun, entry, nproc: ask_for_workers(request, torchrun, entry, nproc)


def ask_for_workers(request: dict, torchrun: list, entry: list, nproc: int) -> None:
    """In place of ``launch.become_torchrun``: hand the workers' entry, count and environment to the server, and end
    this process as the real one ends (``os._exit``: the script's atexit handlers belong to the workers)."""
    assert not any(a.startswith(("--nnodes", "--max-restarts", "--rdzv")) for a in torchrun), torchrun
    from trainscale.runtime import launch

    sys.stdout.flush()
    sys.stderr.flush()
    with open(request["relaunch_file"], "w") as f:
        json.dump({"entry": list(entry), "nproc": nproc, "env": launch.worker_env(nproc, restarts=False)}, f)
    os._exit(0)


def run(script: str) -> int:
    """Run ``script`` as ``__main__``; return the exit status python would give: that of ``sys.exit``, or 1 after
    printing an uncaught exception from the script's first frame on."""
    import runpy

    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except BaseException as err:
        tb = err.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        traceback.print_exception(type(err), err, tb or err.__traceback__)
        return 1
    return 0


def exit_as_python(status: int) -> None:
    """End as the interpreter does (non-daemon threads joined, atexit handlers run, stdout and stderr flushed),
    without then freeing every object of the preloaded modules: in a forked child that writes each of their
    reference counts, copying every page they sit on (about 0.6 s of CPU a block); the exit status cannot change
    there."""
    import atexit

    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_worker(entry: list) -> int:
    """``python -m trainscale.runtime.worker ENTRY`` as torchrun starts it; returns its exit status."""
    from trainscale.runtime import worker

    sys.argv = [worker.__file__, *entry]
    try:
        worker.main()
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    for module in PRELOAD:
        __import__(module)
    # The preloaded objects live until the end: kept out of the collector's reach, they are neither traversed nor
    # copied (forked pages) by the child's garbage collections.
    gc.freeze()
    child = serve(socket.socket(fileno=int(sys.argv[1])))
    if child is not None:
        become(child)
        exit_as_python(run_worker(child["entry"]) if "rank" in child else run(child["script"]))
