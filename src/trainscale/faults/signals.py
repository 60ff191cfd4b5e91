"""SIGTERM and SIGUSR1 during ``fit``: a flag the loop acts on, and a deadline for a rank that cannot.

Who sends them: torchrun's agent sends SIGTERM to its workers when it stops and SIGKILL 30 s later;
SLURM sends SIGTERM at the time limit or on ``scancel`` (SIGKILL after ``KillWait``, 30 s by default)
and SIGUSR1 ahead of the limit when asked (``--signal=USR1@90``); Kubernetes sends SIGTERM and kills
after ``terminationGracePeriodSeconds`` (30 s by default).

- The Python handler records the signal in :attr:`SignalWatch.received` (and SIGTERM in
  :attr:`SignalWatch.received_sigterm`, Lightning's ``trainer.received_sigterm``), then calls the handler that
  was installed before ``fit`` when it is a Python function, as Lightning's ``_SignalConnector`` does (so a handler
  of your own still runs). The loop reads the signal at its next check (``FaultTolerance.poll``, which every rank
  runs at the same step), writes a checkpoint and raises :class:`Preempted`.
- A Python handler runs only when the main thread executes Python code: a rank blocked inside a
  collective (C++) never runs it, and a rank stalled in its own code never reaches the check. So the
  C-level handler of the ``signal`` module also writes each signal's number to a pipe
  (``signal.set_wakeup_fd``), which a daemon thread reads whatever the main thread is doing. After
  SIGTERM it waits ``grace_s`` seconds (default 20, below the launchers' 30); if ``fit`` has not
  ended by then, it writes every thread's Python stack to the rank's stacks file and to stderr and
  ends the process with ``os._exit(128 + SIGTERM)``. A rank already known to be stalled (its hang
  watchdog fired: no step for a long while) does so at once: nothing will reach a checkpoint there,
  e.g. the stuck rank that torchrun signals after another rank's collective timeout. SIGUSR1 is a
  warning ahead of the limit, not a kill: it gets no deadline. A second identical signal ends the
  process at once, the same way.
- A forked child (a DataLoader worker) gets the handlers that were there before ``fit`` back and no
  wakeup pipe: otherwise its signals would be read as the trainer's own.
"""

from __future__ import annotations

import faulthandler
import math
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from trainscale.utilities.exceptions import SIGTERMException

GRACE_S = 20.0
"""Seconds from SIGTERM to a forced exit when no checkpoint ended ``fit`` first (torchrun, SLURM and
Kubernetes kill after 30 s by default)."""

HANDLED = (signal.SIGTERM, signal.SIGUSR1)
_STOP = 0  # written to the pipe by stop(); no signal has the number 0

_active: set["SignalWatch"] = set()  # watches started in this process, for the fork handler below


class Preempted(SystemExit):
    """Raised after the checkpoint that follows SIGTERM/SIGUSR1. Exit code ``128 + signal``, the
    shell's convention for a process ended by that signal. :func:`preempted` makes the one to raise."""

    def __init__(self, signum: int, path: str | None) -> None:
        SystemExit.__init__(self, 128 + signum)
        self.signum, self.path = signum, path


class PreemptedBySigterm(Preempted, SIGTERMException):
    """The :class:`Preempted` of SIGTERM, also Lightning's ``SIGTERMException`` (``except SIGTERMException`` catches
    it, as in Lightning)."""


def preempted(signum: int, path: str | None) -> Preempted:
    """The exception to raise after the checkpoint of ``signum``: :class:`PreemptedBySigterm` for SIGTERM."""
    return (PreemptedBySigterm if signum == signal.SIGTERM else Preempted)(signum, path)


class SignalWatch:
    """SIGTERM/SIGUSR1 handling for one ``fit`` (see the module's docstring).

    Args:
        rank: this process's rank (for the messages).
        grace_s: seconds from SIGTERM to the forced exit, > 0.

    Raises:
        ValueError: ``grace_s`` is not a positive number.
    """

    def __init__(self, rank: int, grace_s: float = GRACE_S) -> None:
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not grace_s > 0:
            raise ValueError(f"signal grace period {grace_s!r} must be a positive number of seconds")
        self.rank = rank
        self.grace_s = float(grace_s)
        self.received: int | None = None
        self.received_sigterm = False  # a SIGTERM came (another signal may have come after it)
        self.stacks_path: Path | None = None
        self._previous_handlers: dict[int, object] = {}
        self._previous_wakeup_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._stalled: Callable[[], bool] = lambda: False

    def start(self, stacks_path: Path | None = None, stalled: Callable[[], bool] | None = None) -> None:
        """Install the handlers, the wakeup pipe and its reader thread. Signal handlers can only be
        set from the main thread: elsewhere nothing is installed (the flag then stays None).

        Args:
            stacks_path: the file that gets every thread's stack at a forced exit.
            stalled: called from the reader thread at SIGTERM; True (the rank made no progress for a
                long while) means exit at once rather than after ``grace_s``.
        """
        if threading.current_thread() is not threading.main_thread() or self._pipe is not None:
            return
        self.stacks_path = stacks_path
        self._stalled = stalled or (lambda: False)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd's requirement: a signal handler never blocks
        for signum in HANDLED:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._pipe = (read_fd, write_fd)
        self._thread = threading.Thread(target=self._watch, args=(read_fd,), name="trainscale-signals", daemon=True)
        self._thread.start()
        _active.add(self)

    def stop(self) -> None:
        """Put back the previous handlers and wakeup fd, and end the reader thread (no deadline after this)."""
        if self._pipe is None:
            return
        self._restore()
        os.write(self._pipe[1], bytes([_STOP]))
        self._thread.join(timeout=10)
        self._close()

    def _on_signal(self, signum, frame) -> None:
        self.received = signum
        self.received_sigterm = self.received_sigterm or signum == signal.SIGTERM
        previous = self._previous_handlers.get(signum)
        if callable(previous):  # the handler installed before fit (not SIG_DFL/SIG_IGN), as Lightning calls it
            previous(signum, frame)

    def _restore(self) -> None:
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()
        _active.discard(self)

    def _close(self) -> None:
        for fd in self._pipe:
            os.close(fd)
        self._pipe, self._thread = None, None

    def _watch(self, read_fd: int) -> None:
        """The reader thread: hand each of our signals to :meth:`_delivered`; end the process when
        SIGTERM's deadline passes."""
        deadline = math.inf
        seen: set[int] = set()
        while True:
            wait = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
            if not select.select([read_fd], [], [], wait)[0]:
                self._give_up(signal.SIGTERM, f"no checkpoint ended the run within {self.grace_s:g} s of SIGTERM")
            for signum in os.read(read_fd, 256):
                if signum == _STOP:
                    return
                if signum in HANDLED:  # others (SIGINT, SIGCHLD) have Python handlers that are not ours
                    self._delivered(signum, seen)
                    if signum == signal.SIGTERM:
                        deadline = min(deadline, time.monotonic() + self.grace_s)

    def _delivered(self, signum: int, seen: set[int]) -> None:
        """Record a signal; end the process at once when it came before, or for SIGTERM to a rank
        that has already stalled."""
        if signum in seen:
            self._give_up(signum, f"a second {signal.Signals(signum).name}")
        if signum == signal.SIGTERM and self._stalled():
            self._give_up(signum, "SIGTERM to a rank that had made no step for a long while (its hang watchdog fired)")
        seen.add(signum)
        self.received = signum

    def _give_up(self, signum: int, why: str) -> None:
        """Write every thread's stack to the stacks file and stderr, then end the process now."""
        code = 128 + signum
        where = f"; Python stacks in {self.stacks_path}" if self.stacks_path is not None else ""
        os.write(2, f"trainscale: rank {self.rank}: {why}{where}; exiting with code {code}\n".encode())
        if self.stacks_path is not None:
            self.stacks_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.stacks_path, "a", encoding="utf-8") as f:
                f.write(f"--- {why}: stacks of every thread at exit ---\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        faulthandler.dump_traceback(file=2, all_threads=True)
        os._exit(code)


def _forget_in_child() -> None:
    """After ``fork`` (DataLoader workers): the child has no reader thread; give it the handlers from
    before ``fit`` and no wakeup pipe, so its signals are neither swallowed nor reported as ours."""
    for watch in list(_active):
        try:
            watch._restore()
            watch._close()
        except (ValueError, OSError):  # forked from a thread other than the main one: leave it
            _active.discard(watch)


os.register_at_fork(after_in_child=_forget_in_child)


def requeue_slurm_job() -> str | None:
    """``scontrol requeue $SLURM_JOB_ID`` inside a SLURM job: what was run and "ok" or scontrol's
    error; None outside a job or without scontrol."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or not shutil.which("scontrol"):
        return None
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    return f"scontrol requeue {job}: {'ok' if done.returncode == 0 else done.stderr.strip()}"
