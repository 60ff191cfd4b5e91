"""Non-finite losses and gradients: ``Trainer(on_nonfinite="raise" | "skip")``.

- ``"raise"`` (default): :class:`KeptLosses` keeps each micro-batch's loss (detached, on the device:
  no op and no host sync per step). At each check (``FaultTolerance.poll``: about every second of
  steps, at epoch ends and before every checkpoint, so a checkpoint never holds weights updated from
  a non-finite loss) one sum per rank rides in the check's all-reduce; a sum with an inf or NaN is not
  finite. Only then are the kept losses read to name the first bad step (:meth:`KeptLosses.first_nonfinite_step`).
  The error (:func:`nonfinite_loss_error`) names the step, the epoch and the rank(s).
- ``"skip"``: :class:`SkipNonFinite` decides before the optimizer step, from the gradient norm after
  the all-reduce (the same on every rank, so every rank skips the same steps; a per-rank loss test
  would let replicas diverge). That costs one host sync per step. Under "16-mixed" the GradScaler
  skips such steps itself and lowers its scale; the skips are counted all the same.
"""

from __future__ import annotations

import math

import torch

FOLD = 256
"""Kept losses are stacked into one tensor every ``FOLD`` micro-batches."""

_ADVICE = "lower the learning rate, clip gradients (gradient_clip_val=1.0)"


class NonFiniteLossError(FloatingPointError):
    """The loss (``on_nonfinite="raise"``) or the gradients (``"skip"``, too many in a row) were inf/NaN."""


class KeptLosses:
    """The micro-batch losses since the last check, each with its optimizer step.

    Losses are kept as detached device tensors; every :data:`FOLD` of them are stacked into one 1-d
    float32 tensor, so a long interval holds a few tensors rather than one per micro-batch. A loss
    of any shape counts by its sum, which keeps inf/NaN.
    """

    def __init__(self) -> None:
        self.pending: list[torch.Tensor] = []  # not stacked yet
        self.stacked: list[torch.Tensor] = []
        self.steps: list[int] = []  # the step of every kept loss, stacked or not

    def add(self, loss: torch.Tensor, step: int) -> None:
        """Keep ``loss`` (detached already) of optimizer step ``step``."""
        self.pending.append(loss)
        self.steps.append(step)
        if len(self.pending) >= FOLD:
            self._stack()

    def _stack(self) -> None:
        if self.pending:
            self.stacked.append(torch.stack([t if t.dim() == 0 else t.sum() for t in self.pending]).float())
            self.pending = []

    def total(self) -> torch.Tensor | None:
        """The sum of the kept losses (a 0-d device tensor), or None when there are none."""
        self._stack()
        return torch.cat(self.stacked).sum() if self.stacked else None

    def first_nonfinite_step(self) -> int | None:
        """The step of the first inf/NaN loss (reads the losses: one host sync), or None (e.g. finite
        losses whose float32 sum overflowed)."""
        self._stack()
        values = torch.cat(self.stacked).tolist() if self.stacked else []
        bad = [step for step, value in zip(self.steps, values) if not math.isfinite(value)]
        return min(bad) if bad else None

    def clear(self) -> None:
        self.pending, self.stacked, self.steps = [], [], []


def nonfinite_loss_error(first_steps: dict[int, int], epoch: int) -> NonFiniteLossError:
    """The error for every rank's first non-finite step (``{rank: 0-based step}``, not empty)."""
    step = min(first_steps.values())
    ranks = sorted(r for r, s in first_steps.items() if s == step)
    every = {r: s + 1 for r, s in sorted(first_steps.items())}
    return NonFiniteLossError(f"non-finite loss at optimizer step {step + 1} (epoch {epoch}) on rank(s) {ranks} "
                              f"(every rank's first: {every}); {_ADVICE}, check the data, or pass "
                              "on_nonfinite='skip'")


class SkipNonFinite:
    """``on_nonfinite="skip"``: skip optimizer steps whose gradients are not finite.

    Args:
        max_in_a_row: raise after more than this many skipped steps in a row (an int >= 0).
        rank: this process's rank (for the message).

    Raises:
        ValueError: a bad ``max_in_a_row``.
    """

    def __init__(self, max_in_a_row: int, rank: int) -> None:
        if isinstance(max_in_a_row, bool) or not isinstance(max_in_a_row, int) or max_in_a_row < 0:
            raise ValueError(f"max_nonfinite_skips={max_in_a_row!r} must be an int >= 0")
        self.max_in_a_row = max_in_a_row
        self.rank = rank
        self.skipped = 0
        self.in_a_row = 0

    def should_skip(self, precision, module, optimizer, grad_norm: torch.Tensor | None, *, step: int,
                    epoch: int) -> bool:
        """True when the (all-reduced) gradients are not finite and the optimizer step must be skipped
        by the caller; False when they are finite, or when the GradScaler skips by itself.

        Args:
            precision: the Runtime's ``Precision`` (unscales the gradients before the norm).
            module, optimizer: whose gradients to test when ``grad_norm`` is None.
            grad_norm: the total gradient norm if clipping computed it already.
            step, epoch: where the loop stands (for the message).

        Raises:
            NonFiniteLossError: more than ``max_in_a_row`` non-finite steps in a row.
        """
        if grad_norm is None:
            precision.unscale_gradients(optimizer)
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if bool(torch.isfinite(grad_norm).item()):  # the one host sync per step of "skip"
            self.in_a_row = 0
            return False
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row > self.max_in_a_row:
            raise NonFiniteLossError(
                f"rank {self.rank}: non-finite gradients in {self.in_a_row} optimizer steps in a row "
                f"(last: step {step + 1}, epoch {epoch}), more than max_nonfinite_skips={self.max_in_a_row}; "
                f"{_ADVICE}, or check the data")
        return precision.scaler is None
