"""A process that has imported torch, torch._dynamo and trainscale and forks one child per docs block.

``python tests/docs_examples_server.py FD`` reads requests from the socket ``FD``, one JSON line each:
``{"script": ABSOLUTE PATH, "env": {...}, "stdout": PATH, "stderr": PATH}``. For each it forks a child,
answers ``{"pid": PID}``, waits for the child and answers ``{"exit": STATUS}`` (the exit code, or minus the
signal that ended it) with the CPU seconds of the child and the processes it waited for (``"cpu_s"``), then
reads the next request; it exits at the end of input.

The child is what ``cd DIR && python SCRIPT`` would be, less the imports already done: a new session, the
request's environment, ``sys.argv`` and ``sys.path[0]`` as python sets them, stdin from /dev/null, stdout and
stderr to the request's files, the script run as ``__main__`` (``runpy``), an uncaught exception printed with the
script's frames, and the interpreter's exit (non-daemon threads joined, atexit handlers; see ``exit_as_python``).
Nothing else is shared: the server runs no torch operation and starts no thread (it checks) before it forks, and
Python reseeds ``random`` in a forked child. A script that relaunches itself (``devices=2``) finds itself in ``sys.argv[0]``,
as after ``python SCRIPT``; its workers, started by torchrun, are fresh interpreters.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import threading
import traceback

# what most blocks import; torch._dynamo too: the first optimizer built imports it (torch's ``_disable_dynamo``)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "trainscale.loop.trainer", "trainscale.runtime.runtime",
           "trainscale.models", "trainscale.data")


def serve(sock: socket.socket) -> dict | None:
    """Answer requests until the end of input (returns None); in a forked child, return its request."""
    requests = sock.makefile("r")
    for line in requests:
        request = json.loads(line)
        assert threading.active_count() == 1, "the server started a thread: forking would copy its state"
        pid = os.fork()
        if pid == 0:
            requests.close()
            sock.close()
            return request
        sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status, usage = os.wait4(pid, 0)
        sock.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status),
                                 "cpu_s": usage.ru_utime + usage.ru_stime}).encode() + b"\n")
    return None


def become(request: dict) -> None:
    """Turn this forked child into ``python SCRIPT`` run in the script's directory (see the module docstring)."""
    os.setsid()
    script = request["script"]
    folder = os.path.dirname(script)
    os.chdir(folder)
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [script]  # as runpy.run_path sets it: the path it runs
    sys.path[0] = folder


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


if __name__ == "__main__":
    for module in PRELOAD:
        __import__(module)
    # The preloaded objects live until the end: kept out of the collector's reach, they are neither traversed nor
    # copied (forked pages) by the child's garbage collections.
    gc.freeze()
    child = serve(socket.socket(fileno=int(sys.argv[1])))
    if child is not None:
        become(child)
        exit_as_python(run(child["script"]))
