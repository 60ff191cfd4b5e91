"""Explaining a hang: which collective, which ranks did not arrive, and where each rank stands.

- The collective timeout itself is ``init_process_group(timeout=...)`` (Runtime ``timeout=``): a
  rank waiting longer raises (gloo: ``Timed out waiting 5000ms for recv operation``) and the process
  group is dead afterwards: raise, tear down, let the launcher restart (no collective works on it again).
- **gloo** (CPU): :func:`missing_ranks` asks a separate gloo group (:func:`new_monitor_group`) with
  ``torch.distributed.monitored_barrier`` which ranks do not answer; rank 0's barrier names them
  (``Ranks 1 failed to pass monitoredBarrier in 1000 ms``). Only rank 0 can know: the other ranks
  only hear from rank 0 (https://pytorch.org/docs/stable/distributed.html#torch.distributed.monitored_barrier).
- **NCCL**: no monitor group (:func:`wants_monitor_group`). NCCL's watchdog ends the process at a
  timeout before Python could ask anything (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, PyTorch's default),
  and an extra gloo group would open a connection to every other rank at start-up on the interface
  of the hostname. PyTorch's own tools name the collective instead: the flight recorder and its dump
  on timeout (:func:`nccl_debug_env`). The dump ran on one H200 rank (docs/gpu-results.md).
- :class:`Watchdog` writes every thread's Python stack with ``faulthandler.dump_traceback_later``
  when a rank makes no progress for a while, before the collective timeout fires, so the lagging
  rank's own file shows where it stands.
"""

from __future__ import annotations

import faulthandler
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Mapping

_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")
_COMM_MARKERS = ("Timed out", "timed out", "closed by peer", "Connection reset", "Broken pipe", "Gloo", "gloo",
                 "NCCL", "monitoredBarrier", "Socket Timeout")


class CollectiveTimeout(RuntimeError):
    """A collective failed: a rank did not arrive in time, or a peer crashed.

    Attributes:
        operation: what the ranks were doing (e.g. "gradient all-reduce (backward)").
        missing: the ranks that did not arrive, when known (rank 0 knows), else None.
    """

    def __init__(self, message: str, operation: str, missing: list[int] | None) -> None:
        super().__init__(message)
        self.operation = operation
        self.missing = missing


def is_comm_error(err: BaseException) -> bool:
    """A failed collective (timeout, crashed peer), as opposed to a bug in the user's step."""
    if not isinstance(err, RuntimeError) or isinstance(err, CollectiveTimeout):
        return False
    text = str(err)
    return type(err).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError") or \
        any(m in text for m in _COMM_MARKERS)


def wants_monitor_group(backend: str, world_size: int) -> bool:
    """Whether ``Runtime.launch`` makes the gloo monitor group: with several ranks on a pure gloo
    default group only (see the module's docstring for NCCL).

    Not lazily connected (``TORCH_GLOO_LAZY_INIT=1``, which torch 2.13 honours): its first use is the
    diagnosis after a failure, and a lazy gloo pair whose peer died before it connected can hang there
    (pytorch/gloo#520: 3 ranks, one exits, ``monitored_barrier(timeout=2 s)`` still waiting after
    40 s; connected at start: it fails at once). The eager group costs what the default gloo group
    already costs: one connection per pair of ranks.
    """
    return backend == "gloo" and world_size > 1


def new_monitor_group():
    """A gloo group beside the default one (which dies after a timeout).
    Collective: every rank must call it at the same point (``Runtime.launch`` does)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


# (variable, value, the other names torch reads for it): torch's ProcessGroupNCCL.hpp and
# FlightRecorder.hpp; torchtitan's init_distributed (torchtitan/distributed/utils.py) sets the same.
_NCCL_DEBUG = (
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", ("NCCL_ASYNC_ERROR_HANDLING",)),  # end the process, no NCCL abort
    ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", ()),  # write the flight recorder's buffer at a timeout
    ("TORCH_FR_BUFFER_SIZE", "2000", ("TORCH_NCCL_TRACE_BUFFER_SIZE",)),  # entries kept (0: recorder off)
    ("TORCH_NCCL_ENABLE_MONITORING", "1", ()),  # end a process whose NCCL watchdog is itself stuck
)


def nccl_debug_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set before an NCCL process group so that a timeout names the collective:
    each of ``_NCCL_DEBUG`` that ``environ`` sets under none of its names (the user's choice wins).

    At a timeout every rank then writes its flight recorder's last collectives (operation, sequence
    number, sizes, state, Python stack) to ``/tmp/nccl_trace_rank_<R>`` (``TORCH_FR_DUMP_TEMP_FILE``
    changes the prefix); ``torchfrtrace <dir> --prefix nccl_trace_rank_`` names the collective and
    the ranks that did not join it. On one H200 rank the dump named the timed-out all-reduce about 5 s after the
    timeout (docs/gpu-results.md).
    """
    return {name: value for name, value, aliases in _NCCL_DEBUG
            if not any(n in environ for n in (name, *aliases))}


def missing_ranks(group, timeout_s: float) -> tuple[list[int] | None, str]:
    """Ranks that do not reach a ``monitored_barrier`` on ``group`` within ``timeout_s`` seconds.

    Returns:
        ``(ranks, note)``. On rank 0: the missing ranks ([] when every rank arrived), or None with the
        barrier's own error as the note when a peer's connection broke (it crashed). On other ranks:
        ``[0]`` if rank 0 did not answer, else None (unknown there: rank 0's error names them).
    """
    import torch.distributed as dist

    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as err:
        found = _MISSING.search(str(err))
        if found:
            return sorted(int(r) for r in found.group(1).replace(" ", "").split(",") if r), ""
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return ([0] if dist.get_rank() != 0 else None), re.sub(r"^\[[^\]]*\]\s*", "", first)[:160]
    return ([] if dist.get_rank() == 0 else None), ""


def explain(err: BaseException, operation: str, *, rank: int, timeout_s: float, where: str,
            missing: list[int] | None, stacks_dir: Path | None, note: str = "") -> CollectiveTimeout:
    """The error to raise for a failed collective: the operation, the ranks that did not arrive,
    and where the stack dumps are."""
    msg = f"rank {rank}: {operation} {where} {_cause(err, timeout_s)}; {_who(missing, rank, note)}."
    if stacks_dir is not None:
        msg += f" Python stacks of ranks that stalled: {stacks_dir}/rank<R>.txt."
    msg += (" Fix the slow or crashed rank (see its log), or raise timeout= if the step is legitimately"
            " slower; restarts resume from the last checkpoint (--max-restarts).")
    return CollectiveTimeout(msg, operation, missing)


def _cause(err: BaseException, timeout_s: float) -> str:
    text = str(err)
    if "Timed out" in text or "timed out" in text:
        return f"timed out after {timeout_s:g} s"
    if "closed by peer" in text or "Connection reset" in text or "Broken pipe" in text:
        return "failed because a peer closed its connection (it crashed or exited)"
    return f"failed ({text.splitlines()[0][:200] if text else type(err).__name__})"


def _who(missing: list[int] | None, rank: int, note: str) -> str:
    if missing == [0] and rank != 0:
        return "rank 0 did not answer the check afterwards (it stalled, failed or exited: see rank 0's error)"
    if missing:
        return f"ranks that did not arrive: {missing}"
    if missing == []:
        return "every rank answered rank 0's check afterwards (a transient stall)"
    if rank == 0:
        return f"the check of which ranks are alive failed too ({note or 'no detail'}): a peer crashed, see its log"
    return "rank 0's error names the ranks that did not arrive"


class Watchdog:
    """Dump this rank's Python stacks to ``<run dir>/stacks/rank{R}.txt`` after ``after_s`` seconds
    without progress (``faulthandler.dump_traceback_later``, which runs on a C thread and works even
    when the main thread is blocked inside a collective).

    ``pet()`` is called at each step boundary. It re-arms the timer once more than ``after_s / 2``
    seconds passed since the last arming (re-arming starts a thread, which is not worth doing every
    step), so a stall is dumped at most ``after_s`` seconds after it began, and only a stall of at
    least ``after_s / 2`` can be dumped. faulthandler has one timer per process: a user's own
    ``dump_traceback_later`` is replaced while the watchdog is armed.
    """

    def __init__(self, path: Path, after_s: float) -> None:
        self.path = Path(path)
        self.after_s = float(after_s)
        self._file = None
        self.armed_at = float("inf")  # time.monotonic() of the last arming (inf: not started)

    def start(self) -> "Watchdog":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._arm()
        return self

    def _arm(self) -> None:
        faulthandler.dump_traceback_later(self.after_s, repeat=False, file=self._file, exit=False)
        self.armed_at = time.monotonic()

    def pet(self) -> None:
        """Progress: re-arm the timer when it was armed more than ``after_s / 2`` seconds ago."""
        if time.monotonic() > self.armed_at + self.after_s / 2:
            self._arm()

    def stalled(self) -> bool:
        """True once the timer has fired: no progress for at least ``after_s / 2`` seconds (at least
        ``after_s`` since the last re-arming). Safe to call from any thread."""
        return time.monotonic() > self.armed_at + self.after_s

    def stop(self) -> None:
        """Disarm; delete the file when nothing was dumped."""
        if self._file is None:
            return
        faulthandler.cancel_dump_traceback_later()
        self._file.close()
        self._file = None
        self.armed_at = float("inf")
        if self.path.is_file() and self.path.stat().st_size == 0:
            self.path.unlink()
