"""The first code of each worker process that trainscale starts under torchrun.

torchrun runs ``python -m trainscale.runtime.worker SCRIPT ARGS`` (or ``-m MODULE ARGS``), which

1. asks Linux to kill this worker when its parent, torchrun's agent, dies (``prctl(PR_SET_PDEATHSIG,
   SIGKILL)``, prctl(2)): an agent killed with SIGKILL otherwise leaves its workers training on,
   orphaned. The flag survives ``exec``; it is set before the user's code runs.
2. runs the user's program as ``__main__``, as ``python SCRIPT`` would (``runpy``);
3. when the program fails, records the exception (type, message, traceback) in torchrun's error
   file with torch's own ``ErrorHandler`` (torchrun's failure summary then shows it) and in
   ``trainscale_error.json`` beside it, which ``trainscale run`` prints last. An error raised before
   any process group exists (a bad flag, a syntax or import error, a rejected argument) would recur
   at every restart: it is marked ``"restartable": false`` and ``trainscale run`` stops the restarts
   (under ``trainscale run --max-restarts N`` the worker waits to be stopped rather than exit, so the
   stop never races torchrun's restart);
4. when the program ends, moves the objects still alive out of the garbage collector's reach (``gc.freeze``):
   the interpreter's exit otherwise passes over all of them, torch's included, in each of its collections
   (about 1.5 s of CPU per worker here); atexit handlers run as before, and the memory goes with the process.

Importing this module does not import torch.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import runpy
import signal
import sys
import sysconfig
import time
import traceback
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Raised before a process group exists, these recur at every restart; torch.distributed's own errors
# (RuntimeError, DistError, TimeoutError while connecting) may not, and are left to torchrun's restarts.
_SETUP_ERRORS = (SyntaxError, ImportError, NameError, AttributeError, ValueError, TypeError, KeyError,
                 FileNotFoundError, SystemExit)
ERROR_FILE = "trainscale_error.json"
# Set by ``trainscale run --max-restarts N``, which stops torchrun when it finds a non-restartable error: such a
# worker then waits (at most HOLD_S seconds) instead of exiting, so that torchrun cannot restart the job first.
HOLD_ENV = "TRAINSCALE_HOLD_SETUP_ERRORS"
HOLD_S = 60.0


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when the thread that started it exits (Linux only).

    Returns:
        True if set; False where prctl is not available (other systems): nothing changes there.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _restartable(err: BaseException) -> bool:
    dist = sys.modules.get("torch.distributed")
    group_exists = bool(dist is not None and dist.is_available() and dist.is_initialized())
    return group_exists or not isinstance(err, _SETUP_ERRORS)


def _user_frames(err: BaseException) -> str:
    """``err``'s traceback (not the exceptions it was raised while handling) without the frames of this
    module, runpy and the standard library; the user's frames and those of libraries they called stay.
    A ``SystemExit`` names the exception it ended (argparse's usage error)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    lines = traceback.format_exception(type(err), err, err.__traceback__, chain=False)
    kept = [line for line in lines
            if not (line.startswith("  File ") and ("runpy" in line or __file__ in line or stdlib in line))]
    if isinstance(err, SystemExit) and err.__context__ is not None:
        context = err.__context__
        kept.append(f"  (exiting on {type(context).__module__}.{type(context).__name__}: {context})\n")
    return "".join(kept)


def _record(err: BaseException) -> None:
    """Write the exception being handled to torchrun's error file and to ``trainscale_error.json``."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    if not isinstance(err, SystemExit):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(err)
    message = f"{type(err).__name__}: {err}" if not isinstance(err, SystemExit) else f"SystemExit: {err.code}"
    record = {"rank": os.environ.get("RANK"), "local_rank": os.environ.get("LOCAL_RANK"),
              "node_rank": os.environ.get("GROUP_RANK"), "time": time.time(), "message": message,
              "traceback": _user_frames(err), "restartable": _restartable(err)}
    path = Path(error_file).with_name(ERROR_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    if not record["restartable"] and os.environ.get(HOLD_ENV) == "1":
        time.sleep(HOLD_S)  # trainscale run terminates torchrun (and with it this worker) as soon as it reads the file


def run(entry: list[str]) -> None:
    """Run ``SCRIPT ARGS`` or ``-m MODULE ARGS`` as ``__main__`` with ``sys.argv`` as python sets it."""
    if entry[:1] == ["-m"]:
        sys.argv = [entry[1], *entry[2:]]
        runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(entry)
        sys.path[0] = os.path.dirname(os.path.abspath(entry[0]))  # as `python SCRIPT` puts the script's folder first
        runpy.run_path(entry[0], run_name="__main__")


def main() -> None:
    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:  # the agent died before the flag was set
        sys.exit(f"trainscale worker: its agent (pid {parent}) is gone; exiting")
    try:
        run(sys.argv[1:])
    except SystemExit as err:
        if err.code not in (0, None):
            _record(err)
        raise
    except BaseException as err:
        _record(err)
        raise
    finally:  # what is alive now lives to the end: the exit's garbage collections pass over every object left
        gc.freeze()  # (torch's, about 1.5 s of CPU here) unless frozen out of their reach


if __name__ == "__main__":
    main()
