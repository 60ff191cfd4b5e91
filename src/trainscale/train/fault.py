"""What the Trainer does when things go wrong: signals, non-finite losses, hangs, where to resume.

One object, :class:`FaultTolerance`, called from a few lines of ``Trainer.fit``:

- **Signals** (:mod:`trainscale.train.signals`). SIGTERM and SIGUSR1 set a flag; every rank must
  agree to save, so the flags are combined in :meth:`poll`, which runs about every second of steps
  (the slowest rank's measured step time decides the next check's step), so the checkpoint follows
  a signal within seconds whatever the step time. Then the Trainer writes a mid-epoch checkpoint,
  requeues a SLURM job (SIGUSR1) and exits with :class:`Preempted`. A rank that cannot get there
  (blocked in a collective, stalled) dumps its stacks and exits 20 s after SIGTERM.
- **Non-finite loss.** ``on_nonfinite="raise"``: each micro-batch's loss is kept (a detached
  reference: no op, no host sync per step; stacked into one tensor every 256) and tested in
  :meth:`poll`, i.e. every ``log_every_n_steps`` steps, at epoch ends and before every checkpoint
  (so a checkpoint never holds weights of a non-finite step): their sum rides in poll's all-reduce
  (a sum of finite losses is finite, one with inf/NaN is not); the Trainer passes the running loss
  sum it keeps on the device anyway, so no stack or sum of the kept losses is made. Only when some
  rank's sum is not finite are its losses read to name the first bad step (a second all-reduce, on
  the failure path only). Testing each loss as it came cost ~32 µs per step on CPU (five small ops),
  1.7 % of a 1.9 ms MLP step; ``isfinite``/``argmax`` in every poll touched ~0.8 MiB of PyTorch
  kernel code that a plain loop never runs (resident memory). The error names the step, the epoch
  and the rank(s). ``"skip"``: the decision must be taken before the
  optimizer step, so it costs one host sync per step (``.item()`` on the gradient norm). The norm is
  taken after the gradient all-reduce, so every rank sees the same value and skips the same steps
  (a per-rank loss test would let replicas diverge). The optimizer step is skipped, the gradients
  dropped, the skip counted; more than ``max_nonfinite_skips`` in a row raise. Under "16-mixed" the
  GradScaler already skips such steps and lowers its scale; it keeps doing so and the skips are counted.
- **Hangs.** :meth:`guard` turns a failed collective into a :class:`~trainscale.runtime.hangs.CollectiveTimeout`
  naming the operation and (on rank 0) the ranks that did not arrive; a :class:`~trainscale.runtime.hangs.Watchdog`
  dumps stacks to ``<run dir>/stacks/rank{R}.txt`` after ``timeout / 2`` s without a step.

:meth:`poll` is the loop's only extra collective: a 3·W-element all-reduce after about a second of
steps (never more than ``log_every_n_steps`` steps apart). World size 1: no collective; the signal
flag is read every step and the check runs every ``log_every_n_steps`` steps.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import torch

from trainscale.runtime import hangs
from trainscale.train.signals import GRACE_S, Preempted, SignalWatch, requeue_slurm_job

__all__ = ["FaultTolerance", "NonFiniteLossError", "Preempted", "STEP_PHASE", "steps_between_checks"]

_COMM_MARKERS = ("Timed out", "timed out", "closed by peer", "Connection reset", "Broken pipe", "Gloo", "gloo",
                 "NCCL", "monitoredBarrier", "Socket Timeout")


_FOLD = 256  # micro-batch losses kept as tensors before they are stacked into one

STEP_PHASE = "training step (forward, backward with gradient all-reduce, optimizer step)"
CHECK_PHASE = "non-finite/signal check (all-reduce)"

CHECK_TARGET_S = 1.0
"""Seconds between two checks that the step cadence aims at when several ranks must agree."""


def steps_between_checks(step_s: float, check_every: int, target_s: float = CHECK_TARGET_S) -> int:
    """Optimizer steps until the next check: about ``target_s`` seconds of steps of ``step_s`` seconds
    (the slowest rank's), at least 1 and at most ``check_every``; 1 while ``step_s`` is unknown (0)."""
    if not step_s > 0:
        return 1
    return max(1, min(check_every, math.ceil(target_s / step_s)))


class NonFiniteLossError(FloatingPointError):
    """The loss (``on_nonfinite="raise"``) or the gradients (``"skip"``, too many in a row) were inf/NaN."""


def is_comm_error(err: BaseException) -> bool:
    """A failed collective (timeout, crashed peer), as opposed to a bug in the user's step."""
    if not isinstance(err, RuntimeError) or isinstance(err, hangs.CollectiveTimeout):
        return False
    text = str(err)
    return type(err).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError") or \
        any(m in text for m in _COMM_MARKERS)


class FaultTolerance:
    """Signals, non-finite checks, hang diagnosis and the watchdog for one ``fit``.

    Args:
        runtime: the Trainer's :class:`~trainscale.runtime.runtime.Runtime`.
        on_nonfinite: "raise" or "skip".
        max_nonfinite_skips: with "skip", raise after more than this many skipped steps in a row.
        check_every_n_steps: steps between :meth:`poll` collectives (the Trainer's ``log_every_n_steps``).
        handle_signals: install the SIGTERM/SIGUSR1 handlers (main thread only).
    """

    def __init__(self, runtime, on_nonfinite: str = "raise", max_nonfinite_skips: int = 10,
                 check_every_n_steps: int = 50, handle_signals: bool = True, *,
                 signal_grace_s: float = GRACE_S) -> None:
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r}; choose 'raise' or 'skip'")
        if isinstance(max_nonfinite_skips, bool) or not isinstance(max_nonfinite_skips, int) or max_nonfinite_skips < 0:
            raise ValueError(f"max_nonfinite_skips={max_nonfinite_skips!r} must be an int >= 0")
        self.rt = runtime
        self.on_nonfinite = on_nonfinite
        self.max_nonfinite_skips = max_nonfinite_skips
        self.check_every = check_every_n_steps
        self.handle_signals = handle_signals
        self.signals = SignalWatch(runtime.rank, signal_grace_s)
        self.phase = STEP_PHASE
        self.skipped = 0
        self._skips_in_a_row = 0
        self._losses: list[torch.Tensor] = []  # micro-batch losses (detached) not yet stacked ...
        self._loss_steps: list[int] = []  # ... and the optimizer step of each kept loss, stacked or not
        self._stacked: list[torch.Tensor] = []  # 1-d float32 tensors of _FOLD losses each
        self._next_check = 0  # the first step checks (and starts the step clock)
        self._last_check: tuple[int, float] | None = None  # (step, time.monotonic()) of the last poll
        self._step_s = 0.0  # this rank's seconds per optimizer step between its last two polls
        self.watchdog: hangs.Watchdog | None = None
        self.stacks_dir: Path | None = None

    # -- lifetime ------------------------------------------------------------------------------
    def start(self, run_dir: Path) -> None:
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
        """Keep ``loss`` (detached) of optimizer step ``step`` for the next :meth:`poll` ("raise" mode): no
        op on the device, no host sync. Every ``_FOLD`` micro-batches the kept losses are stacked into one
        device tensor (one op), so a long poll interval holds 4 bytes per micro-batch, not a tensor."""
        if self.on_nonfinite == "raise":
            self._losses.append(loss)
            self._loss_steps.append(step)
            if len(self._losses) >= _FOLD:
                self._stack()

    def _stack(self) -> None:
        if self._losses:  # a loss of any shape counts by its sum, which keeps inf/NaN
            losses = [t if t.dim() == 0 else t.sum() for t in self._losses]
            self._stacked.append(torch.stack(losses).float())
            self._losses = []

    def _take_losses(self) -> tuple[torch.Tensor | None, list[int]]:
        """Every loss kept since the last poll as one float32 tensor (or None), and their steps."""
        self._stack()
        stacked, steps = self._stacked, self._loss_steps
        self._stacked, self._loss_steps = [], []
        if not stacked:
            return None, steps
        return (stacked[0] if len(stacked) == 1 else torch.cat(stacked)), steps

    def _drop_losses(self) -> tuple[None, list[int]]:
        """Forget the kept losses (all finite); the same shape of answer as :meth:`_take_losses`."""
        self._losses, self._stacked, self._loss_steps = [], [], []
        return None, []

    def skip_step(self, module, optimizer, grad_norm: torch.Tensor | None, *, step: int, epoch: int) -> bool:
        """"skip" mode: True when the (all-reduced) gradients are not finite and the optimizer step
        must be skipped (one host sync). Always False in "raise" mode.

        Raises:
            NonFiniteLossError: more than ``max_nonfinite_skips`` non-finite steps in a row.
        """
        if self.on_nonfinite != "skip":
            return False
        if grad_norm is None:
            self.rt.precision.unscale_gradients(optimizer)
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if bool(torch.isfinite(grad_norm).item()):  # the one host sync per step of "skip"
            self._skips_in_a_row = 0
            return False
        self.skipped += 1
        self._skips_in_a_row += 1
        if self._skips_in_a_row > self.max_nonfinite_skips:
            raise NonFiniteLossError(
                f"rank {self.rt.rank}: non-finite gradients in {self._skips_in_a_row} optimizer steps in a row "
                f"(last: step {step + 1}, epoch {epoch}), more than max_nonfinite_skips={self.max_nonfinite_skips}; "
                "lower the learning rate, clip gradients (gradient_clip_val=1.0), or check the data")
        return self.rt.precision.scaler is None  # the GradScaler skips (and rescales) by itself

    def due(self, step: int) -> bool:
        """Whether :meth:`poll` runs after optimizer step ``step``: the same answer on every rank (the
        next check's step was agreed in the last poll). At world size 1 also after any step that
        follows a signal."""
        if self.watchdog is not None:
            self.watchdog.pet()
        if self.signals.received is not None and self.rt.world_size == 1:
            return True
        return step >= self._next_check

    def poll(self, step: int, epoch: int, running: torch.Tensor | None = None) -> int | None:
        """Combine every rank's signal flag, loss sum (``running``, or the kept losses') and seconds per
        step (a 3·W all-reduce; every rank calls it at the same step) and agree on the next check's step;
        when a sum is not finite, every rank's first non-finite step (a second, W-element all-reduce, on
        that path only).

        Args:
            step, epoch: where the loop stands (for the error message).
            running: a 0-d device tensor that already sums every loss given to :meth:`observe_loss` since
                the epoch began (the Trainer's running loss sum). In "raise" mode its finiteness is tested
                in place of a sum of the kept losses (no stack, no sum: ~0.1 ms less per poll on CPU), and
                the kept losses are read on the failure path only.

        Returns:
            The signal to act on (any rank received one), or None.

        Raises:
            NonFiniteLossError: "raise" mode and some rank saw a non-finite loss (names step, epoch, ranks).
        """
        rt = self.rt
        lazy = running is not None and self.on_nonfinite == "raise"
        if lazy:
            losses, steps, local = None, [], running
        else:
            losses, steps = self._take_losses()
            local = losses.sum() if losses is not None else None
        previous, self.phase = self.phase, CHECK_PHASE
        signum = self.signals.received or 0
        if rt.world_size == 1:  # nothing to combine: the sum is read directly (one host sync)
            rows = [[signum, local.item() if local is not None else 0.0, 0.0]]
        else:  # per rank: signal, loss sum, seconds per step
            vec = torch.zeros(3 * rt.world_size, dtype=torch.float32, device=rt.device)
            vec[3 * rt.rank] = signum
            vec[3 * rt.rank + 2] = self._measure_step_time(step)
            if local is not None:
                vec[3 * rt.rank + 1] = local
            rows = rt.all_reduce(vec).view(-1, 3).tolist()  # host sync, about every CHECK_TARGET_S seconds
        self._plan_next_check(step, rows)
        if lazy:  # the kept losses are needed only to name a bad step
            losses, steps = self._take_losses() if not math.isfinite(rows[rt.rank][1]) else self._drop_losses()
        bad_steps = {}
        if not all(math.isfinite(row[1]) for row in rows):  # the failure path: find the first bad steps
            first = torch.zeros(rt.world_size, dtype=torch.long, device=rt.device)  # per rank: 0 none, else step + 1
            if not math.isfinite(rows[rt.rank][1]):
                values = losses.tolist() if losses is not None else []
                bad = [s for s, v in zip(steps, values) if not math.isfinite(v)]
                first[rt.rank] = min(bad) + 1 if bad else 0  # none: finite losses whose sum overflowed float32
            bad_steps = {r: s - 1 for r, s in enumerate(rt.all_reduce(first).tolist()) if s > 0}
        self.phase = previous
        if bad_steps:
            step1 = min(bad_steps.values())
            raise NonFiniteLossError(
                f"non-finite loss at optimizer step {step1 + 1} (epoch {epoch}) on rank(s) "
                f"{sorted(r for r, s in bad_steps.items() if s == step1)} (every rank's first: "
                f"{ {r: s + 1 for r, s in sorted(bad_steps.items())} }); lower the learning rate, clip gradients "
                "(gradient_clip_val=1.0), check the data, or pass on_nonfinite='skip'")
        signals = [int(row[0]) for row in rows if row[0]]
        return max(signals) if signals else None

    def _measure_step_time(self, step: int) -> float:
        """This rank's seconds per optimizer step since its last poll (the previous value when no step
        ran since; 0 before the second poll)."""
        now = time.monotonic()
        if self._last_check is not None and step > self._last_check[0]:
            self._step_s = (now - self._last_check[1]) / (step - self._last_check[0])
        self._last_check = (step, now)
        return self._step_s

    def _plan_next_check(self, step: int, rows: list[list[float]]) -> None:
        """The step of the next check, from values every rank has after the all-reduce, so every rank
        agrees: at world size 1 ``check_every`` steps on (a signal is read every step there); else about
        ``CHECK_TARGET_S`` seconds of the slowest rank's steps, so a signal leads to a checkpoint within
        a few seconds whatever the step time."""
        if self.rt.world_size == 1:
            self._next_check = step + self.check_every
        else:
            self._next_check = step + steps_between_checks(max(row[2] for row in rows), self.check_every)

    # -- failures ------------------------------------------------------------------------------
    def diagnose(self, err: BaseException, where: str) -> hangs.CollectiveTimeout | None:
        """For a failed collective: a ``CollectiveTimeout`` naming ``self.phase``, ``where`` and, on
        rank 0, the ranks that did not arrive (a ``monitored_barrier`` on the gloo monitor group, with
        a short timeout of ``timeout / 4`` clamped to 1–10 s). None for any other error."""
        if self.rt.world_size == 1 or not is_comm_error(err):
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
        is named (rank 0) instead of the whole job hanging in the next collective."""
        if self.rt.world_size == 1 or self.rt.monitor_group is None:
            return
        missing, _ = hangs.missing_ranks(self.rt.monitor_group, self.rt.timeout)
        if missing:
            raise hangs.CollectiveTimeout(
                f"rank {self.rt.rank}: ranks {missing} did not reach {operation} {where} within "
                f"timeout={self.rt.timeout:g} s; their Python stacks: {self.stacks_dir}/rank<R>.txt",
                operation, missing)

    def exit(self, signum: int, path: str | None) -> None:
        """After the checkpoint of a signal: requeue a SLURM job on SIGUSR1 (rank 0), then raise ``Preempted``."""
        if signum == signal.SIGUSR1 and self.rt.is_rank_zero:
            status = requeue_slurm_job()
            if status is not None:
                self.rt.print(f"trainscale: {status}")
        self.rt.print(f"trainscale: {signal.Signals(signum).name} received; checkpoint {path}; exiting")
        raise Preempted(signum, path)
