"""Starting a job under torchrun from a command (bench's cells, ``trainscale check``'s runs) and reading its result.

:func:`launch_job` runs ``python -m torch.distributed.run ... --module MODULE --config CONFIG`` in its own process
group under a timeout; the job's ``main`` is :func:`job_main`, which writes rank zero's result (or each failing
rank's error) as JSON beside the config.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

KILL_GRACE_S = 5.0


def next_version_dir(root: Path) -> Path:
    n = 0
    while (root / f"version_{n}").exists():
        n += 1
    return root / f"version_{n}"


def threads_per_process(max_devices: int, env: dict | None = None) -> int:
    """CPU threads of every process in every cell: ``OMP_NUM_THREADS`` when the user set it, else
    cores ÷ the largest device count of the grid.

    The same in every cell, so that a CPU "device" has the same compute whether 1 or N of them run
    (as a GPU does), and N processes never oversubscribe the cores. (With cores ÷ devices threads
    instead, on a loaded 2-core machine a 1-process step at batch 16 took 296 ms against 46 ms for
    each of 2 one-thread processes: OpenMP threads wait on each other when cores are short.)
    """
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // max(1, max_devices))


def launch_job(module: str, config: Path, devices: int, log_path: Path, timeout: float,
               threads: int | None = None) -> tuple[int | None, bool, int]:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node=DEVICES --module MODULE --config
    CONFIG`` (torchrun's arguments and environment from :mod:`trainscale.runtime.launch`) in its own process
    group, output to ``log_path``; kill the group after ``timeout`` s. One device runs ``python -m MODULE
    --config CONFIG`` alone, as a single-process run without a launcher. Used by bench's cells and by
    ``trainscale check``.

    Returns:
        ``(returncode, timed_out, omp_num_threads)``: the exit status (None when killed), whether the timeout
        fired, and the threads each process was given (``threads``, or the launcher's default).
    """
    from trainscale.runtime import launch

    if devices == 1:  # one process needs no agent: torchrun's would cost a second interpreter and a rendezvous
        argv = [sys.executable, "-m", module, "--config", str(config)]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", *launch.torchrun_args(devices),
                "--module", module, "--config", str(config)]
    env = launch.worker_env(devices, {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None,
                            restarts=False)
    # Jobs import the entry's module: the current directory first, as `python -m` would.
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *filter(None, [env.get("PYTHONPATH")])])
    timed_out = False
    with open(log_path, "wb") as log:
        with _interrupt_deferred() as interrupted:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            if interrupted:  # Ctrl-C while the job was starting: it is stopped below, as after its start
                raise KeyboardInterrupt
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        except BaseException:  # KeyboardInterrupt: leave no orphaned workers behind
            _kill_group(proc)
            raise
    return proc.returncode, timed_out, int(env["OMP_NUM_THREADS"])


@contextlib.contextmanager
def _interrupt_deferred():
    """Hold a SIGINT (Ctrl-C) that arrives inside the block and report it after, as a list that is non-empty
    when one came: a KeyboardInterrupt raised inside ``Popen`` would leave the job it had just started
    running with nothing to stop it. Only the main thread receives signals; elsewhere, or where SIGINT is
    ignored, nothing is deferred."""
    came: list[int] = []
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield came
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield came
    finally:
        signal.signal(signal.SIGINT, previous)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (psutil's process tree; [] once ``pid`` is gone). torchrun puts its workers in
    their own sessions, so killing torchrun's process group alone could leave them running."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the cell's process group (torchrun forwards it to its workers), then SIGKILL whatever of
    the group and its descendants is left after a grace period, and wait until they are gone.

    Descendants are collected while torchrun lives (a worker it starts during the grace period counts too);
    once torchrun is gone its orphans belong to init and can no longer be found from its pid."""
    below = set(_descendants(proc.pid))
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + KILL_GRACE_S
    while proc.poll() is None and time.monotonic() < deadline:
        below.update(_descendants(proc.pid))
        time.sleep(0.05)
    if proc.poll() is None:
        below.update(_descendants(proc.pid))
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # SIGKILL is delivered asynchronously: return only when none of them runs any more.
    deadline = time.monotonic() + KILL_GRACE_S
    while any(_alive(pid) for pid in below) and time.monotonic() < deadline:
        time.sleep(0.02)


def is_oom(err: BaseException) -> bool:
    """True for out-of-memory errors: ``torch.OutOfMemoryError``, ``MemoryError``, or a message saying so."""
    import torch

    oom_types = (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))
    return isinstance(err, oom_types) or "out of memory" in str(err).lower()


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def job_main(run, argv: list[str] | None, prog: str, dir_key: str, result_name: str) -> int:
    """The ``main`` of a job started by :func:`launch_job`: read ``--config``, call
    ``run(cfg)`` on every rank; rank zero writes what it returns to ``cfg[dir_key]/result_name``, a rank that
    raises writes ``error.rank<R>.json`` (type, message, out of memory or not, traceback) and re-raises
    (recorded by torchrun's ``record``). Shared by bench's cells and ``trainscale check``'s runs."""
    from torch.distributed.elastic.multiprocessing.errors import record

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--config", required=True, help="the job's JSON file")
    cfg = json.loads(Path(parser.parse_args(argv).config).read_text())
    rank = int(os.environ.get("RANK", "0"))

    @record
    def _run() -> None:
        try:
            result = run(cfg)
        except BaseException as err:
            write_json(Path(cfg[dir_key]) / f"error.rank{rank}.json",
                        {"rank": rank, "type": type(err).__name__, "message": str(err)[:2000], "oom": is_oom(err),
                         "traceback": traceback.format_exc()[-4000:]})
            raise
        if result is not None:
            write_json(Path(cfg[dir_key]) / result_name, result)

    _run()
    return 0
