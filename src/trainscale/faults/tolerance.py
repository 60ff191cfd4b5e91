"""What the Trainer does when things go wrong: one facade, :class:`FaultTolerance`, over three concerns.

- **Signals** (:mod:`trainscale.faults.signals`): SIGTERM/SIGUSR1 set a flag; the Trainer then writes a
  mid-epoch checkpoint, requeues a SLURM job (SIGUSR1) and exits with :class:`Preempted`. A rank that
  cannot get there (blocked in a collective, stalled) dumps its stacks and exits 20 s after SIGTERM.
- **Non-finite losses** (:mod:`trainscale.faults.nonfinite`): ``on_nonfinite="raise"`` keeps the losses
  and tests them at each check; ``"skip"`` skips optimizer steps whose gradients are not finite.
- **Hangs** (:mod:`trainscale.runtime.hangs`): a failed collective becomes a ``CollectiveTimeout``
  naming the operation (:attr:`FaultTolerance.phase`) and, on rank 0, the ranks that did not arrive;
  a ``Watchdog`` dumps stacks to ``<run dir>/stacks/rank{R}.txt`` after ``timeout / 2`` s without a step.

What is the facade's own is **the check** (:meth:`FaultTolerance.poll`), the loop's only extra
collective: every rank must take the same decision at the same step, so the ranks' signal flags,
loss sums and seconds per step go through one 3·W-element all-reduce, and from it every rank sets the
step of the next check (:meth:`FaultTolerance.due`): after about ``CHECK_TARGET_S`` (1 s) of the slowest
rank's steps, never more than ``check_every_n_steps`` steps apart, so a signal leads to a checkpoint
within seconds whatever the step time. World size 1: no collective; the signal flag is read after
every step and the check runs every ``check_every_n_steps`` steps.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import torch

from trainscale.runtime import hangs
from trainscale.faults.nonfinite import KeptLosses, NonFiniteLossError, SkipNonFinite, nonfinite_loss_error
from trainscale.faults.signals import GRACE_S, Preempted, SignalWatch, preempted, requeue_slurm_job

__all__ = ["FaultTolerance", "NonFiniteLossError", "Preempted", "STEP_PHASE", "steps_between_checks"]

STEP_PHASE = "training step (forward, backward with gradient all-reduce, optimizer step)"
CHECK_PHASE = "non-finite/signal check (all-reduce)"

CHECK_TARGET_S = 1.0
"""Seconds of steps between two checks when several ranks must agree."""


def steps_between_checks(step_s: float, check_every: int, target_s: float = CHECK_TARGET_S) -> int:
    """Optimizer steps until the next check: about ``target_s`` seconds of steps of ``step_s`` seconds
    (the slowest rank's), at least 1 and at most ``check_every``; 1 while ``step_s`` is unknown (0)."""
    if not step_s > 0:
        return 1
    return max(1, min(check_every, math.ceil(target_s / step_s)))


class FaultTolerance:
    """Signals, non-finite checks, hang diagnosis and the watchdog for one ``fit``.

    Args:
        runtime: the Trainer's :class:`~trainscale.runtime.runtime.Runtime`.
        on_nonfinite: "raise" or "skip".
        max_nonfinite_skips: with "skip", raise after more than this many skipped steps in a row.
        check_every_n_steps: the most optimizer steps between two checks (the Trainer's ``log_every_n_steps``).
        handle_signals: install the SIGTERM/SIGUSR1 handling (main thread only).
        signal_grace_s: seconds from SIGTERM to a forced exit when no checkpoint ended ``fit`` first.

    Raises:
        ValueError: a bad ``on_nonfinite``, ``max_nonfinite_skips`` or ``signal_grace_s``.
    """

    def __init__(self, runtime, on_nonfinite: str = "raise", max_nonfinite_skips: int = 10,
                 check_every_n_steps: int = 50, handle_signals: bool = True, *,
                 signal_grace_s: float = GRACE_S) -> None:
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r}; choose 'raise' or 'skip'")
        self.rt = runtime
        self.on_nonfinite = on_nonfinite
        self.check_every = check_every_n_steps
        self.handle_signals = handle_signals
        self.signals = SignalWatch(runtime.rank, signal_grace_s)
        self.losses = KeptLosses()
        self.skips = SkipNonFinite(max_nonfinite_skips, runtime.rank)
        self.phase = STEP_PHASE  # what the loop is doing, for a CollectiveTimeout's message
        self.watchdog: hangs.Watchdog | None = None
        self.stacks_dir: Path | None = None
        self._next_check = 0  # the step of the next check; the first step checks (and starts the clock)
        self._last_check: tuple[int, float] | None = None  # (step, time.monotonic()) of the last check
        self._step_s = 0.0  # this rank's seconds per optimizer step between its last two checks

    @property
    def skipped(self) -> int:
        """Optimizer steps skipped for non-finite gradients ("skip")."""
        return self.skips.skipped

    # -- lifetime ------------------------------------------------------------------------------
    def start(self, run_dir: Path) -> None:
        """Arm the watchdog and the signal handling; stacks go to ``run_dir/stacks/rank{R}.txt``."""
        self.stacks_dir = Path(run_dir) / "stacks"
        stacks = self.stacks_dir / f"rank{self.rt.rank}.txt"
        self.watchdog = hangs.Watchdog(stacks, self.rt.timeout / 2).start()
        if self.handle_signals:
            self.signals.start(stacks, stalled=self.watchdog.stalled)

    def stop(self) -> None:
        self.signals.stop()
        if self.watchdog is not None:
            self.watchdog.stop()

    # -- per step ------------------------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor, step: int) -> None:
        """Keep ``loss`` (detached) of optimizer step ``step`` for the next check ("raise" mode)."""
        if self.on_nonfinite == "raise":
            self.losses.add(loss, step)

    def skip_step(self, module, optimizer, grad_norm: torch.Tensor | None, *, step: int, epoch: int) -> bool:
        """"skip" mode: True when the (all-reduced) gradients are not finite and the optimizer step
        must be skipped (one host sync). Always False in "raise" mode.

        Raises:
            NonFiniteLossError: more than ``max_nonfinite_skips`` non-finite steps in a row.
        """
        if self.on_nonfinite != "skip":
            return False
        return self.skips.should_skip(self.rt.precision, module, optimizer, grad_norm, step=step, epoch=epoch)

    def due(self, step: int) -> bool:
        """Whether :meth:`poll` runs after optimizer step ``step``: the same answer on every rank (the
        step was agreed in the last check). At world size 1 also after any step that follows a signal."""
        if self.watchdog is not None:
            self.watchdog.pet()
        if self.signals.received is not None and self.rt.world_size == 1:
            return True
        return step >= self._next_check

    # -- the check -----------------------------------------------------------------------------
    def poll(self, step: int, epoch: int, running: torch.Tensor | None = None) -> int | None:
        """The check: every rank calls it at the same step (:meth:`due`, epoch ends, before checkpoints).

        One 3·W all-reduce of every rank's signal flag, loss sum and seconds per step, from which
        every rank sets the next check's step; when a loss sum is not finite, a second, W-element
        all-reduce of every rank's first non-finite step (on that path only).

        Args:
            step, epoch: where the loop stands.
            running: "raise" mode: a 0-d device tensor that sums every loss given to :meth:`observe_loss`
                since the epoch began (the Trainer's running loss sum), tested instead of the kept
                losses' sum. None: the kept losses are summed.

        Returns:
            The signal to act on (some rank received one), or None.

        Raises:
            NonFiniteLossError: "raise" mode and some rank saw a non-finite loss (names step, epoch, ranks).
        """
        previous, self.phase = self.phase, CHECK_PHASE
        loss_sum = None  # "raise" mode: the losses since the last check, summed on the device
        if self.on_nonfinite == "raise":
            loss_sum = running if running is not None else self.losses.total()
        now = time.monotonic()  # this rank's seconds per step since its last check (the previous value if none ran)
        if self._last_check is not None and step > self._last_check[0]:
            self._step_s = (now - self._last_check[1]) / (step - self._last_check[0])
        self._last_check = (step, now)
        signum = self.signals.received or 0
        if self.rt.world_size == 1:
            rows = [[signum, loss_sum.item() if loss_sum is not None else 0.0, self._step_s]]
            self._next_check = step + self.check_every
        else:  # every rank's [signal or 0, loss sum or 0, seconds per step], in rank order (one host sync)
            vec = torch.zeros(self.rt.world_size, 3, dtype=torch.float32, device=self.rt.device)
            vec[self.rt.rank, 0] = signum
            if loss_sum is not None:
                vec[self.rt.rank, 1] = loss_sum
            vec[self.rt.rank, 2] = self._step_s
            rows = self.rt.all_reduce(vec).tolist()  # a sum: each rank fills its own row
            # the next check from values every rank has, so all agree: about a second of the slowest rank's steps
            self._next_check = step + steps_between_checks(max(row[2] for row in rows), self.check_every)
        if not all(math.isfinite(row[1]) for row in rows):
            self._raise_nonfinite(rows, epoch)
        self.losses.clear()
        self.phase = previous
        signals = [int(row[0]) for row in rows if row[0]]
        return max(signals) if signals else None

    def _raise_nonfinite(self, rows: list[list[float]], epoch: int) -> None:
        """Some rank's loss sum was not finite: find every rank's first non-finite step (a W-element all-reduce)
        and raise."""
        first = torch.zeros(self.rt.world_size, dtype=torch.long, device=self.rt.device)  # 0: none, else step + 1
        if not math.isfinite(rows[self.rt.rank][1]):
            bad = self.losses.first_nonfinite_step()  # None: finite losses whose float32 sum overflowed
            first[self.rt.rank] = bad + 1 if bad is not None else 0
        self.losses.clear()
        first_steps = {r: s - 1 for r, s in enumerate(self.rt.all_reduce(first).tolist()) if s > 0}
        if first_steps:
            raise nonfinite_loss_error(first_steps, epoch)

    # -- failures ------------------------------------------------------------------------------
    def diagnose(self, err: BaseException, where: str) -> hangs.CollectiveTimeout | None:
        """For a failed collective: a ``CollectiveTimeout`` naming ``self.phase``, ``where`` and, on
        rank 0, the ranks that did not arrive (a ``monitored_barrier`` on the gloo monitor group, with
        a short timeout of ``timeout / 4`` clamped to 1–10 s). None for any other error."""
        if self.rt.world_size == 1 or not hangs.is_comm_error(err):
            return None
        missing, note = None, ""
        if self.rt.monitor_group is not None:
            try:
                missing, note = hangs.missing_ranks(self.rt.monitor_group, max(1.0, min(10.0, self.rt.timeout / 4)))
            except Exception as exc:  # noqa: BLE001 - the diagnosis must not hide the original error
                note = f"{type(exc).__name__}: {exc}"[:160]
        return hangs.explain(err, self.phase, rank=self.rt.rank, timeout_s=self.rt.timeout, where=where,
                             missing=missing, stacks_dir=self.stacks_dir, note=note)

    def barrier(self, operation: str, where: str) -> None:
        """A ``monitored_barrier`` before ``operation``: a rank that does not arrive within the timeout
        is named (rank 0) instead of the whole job hanging in the next collective. Nothing without a
        monitor group (world size 1, NCCL).

        Raises:
            trainscale.runtime.hangs.CollectiveTimeout: some rank did not arrive.
        """
        if self.rt.world_size == 1 or self.rt.monitor_group is None:
            return
        missing, _ = hangs.missing_ranks(self.rt.monitor_group, self.rt.timeout)
        if missing:
            raise hangs.CollectiveTimeout(
                f"rank {self.rt.rank}: ranks {missing} did not reach {operation} {where} within "
                f"timeout={self.rt.timeout:g} s; their Python stacks: {self.stacks_dir}/rank<R>.txt",
                operation, missing)

    def exit(self, signum: int, path: str | None) -> None:
        """After the checkpoint of a signal: requeue a SLURM job on SIGUSR1 (rank 0), then raise ``Preempted``.

        Raises:
            Preempted: always (exit code 128 + ``signum``; for SIGTERM also Lightning's ``SIGTERMException``).
        """
        if signum == signal.SIGUSR1 and self.rt.is_rank_zero:
            status = requeue_slurm_job()
            if status is not None:
                self.rt.print(f"trainscale: {status}")
        self.rt.print(f"trainscale: {signal.Signals(signum).name} received; checkpoint {path}; exiting")
        raise preempted(signum, path)
