"""A ``FlopCounterMode`` that never fails an op of the step it counts.

Imported lazily by ``flops.FlopsPerSample`` (it imports torch's flop counter). Two ways
``torch.utils.flop_counter.FlopCounterMode`` breaks a model that runs without it (torch 2.13, read in
torch/utils/flop_counter.py and torch/_ops.py):

- a FLOP formula raises (an ``AssertionError`` on shapes it does not expect): here every formula of
  ``flop_registry`` is guarded through ``custom_mapping`` and counts 0 when it raises;
- a higher-order operator without a counting rule (``while_loop``, ``scan``, ... : only ``cond`` and
  triton kernels have one) gets ``NotImplemented`` back, and the dispatcher raises ``TypeError``:
  here it runs uncounted (the counter's own dispatch mode is popped while it dispatches).

Each case is listed in ``failures``; the count is then incomplete and ``FlopsPerSample`` does not use
it. What cannot be caught per op is left to the caller: a region compiled inside the model (e.g. eager
``flex_attention``, which calls ``torch.compile(fullgraph=True)``) refuses to run under any dispatch mode.
"""

from __future__ import annotations

from typing import Any, Callable

from torch._ops import HigherOrderOperator
from torch.utils.flop_counter import FlopCounterMode, flop_registry


def _tolerant(mode_class: type) -> type:
    """A subclass of torch's inner dispatch mode that runs unknown higher-order operators uncounted."""

    class TolerantMode(mode_class):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is NotImplemented and isinstance(func, HigherOrderOperator):
                out = func(*args, **(kwargs or {}))  # this mode is popped here: the operator's own implementation
                self.counter.failures.append(f"{func}: no FLOP rule for this higher-order operator (run uncounted)")
            return out

    return TolerantMode


class TolerantFlopCounter(FlopCounterMode):
    """``FlopCounterMode(display=False)`` whose formula errors and unknown higher-order operators do not
    raise; each is described in ``failures`` (a list of str)."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        super().__init__(display=False, custom_mapping={op: self._guard(op, f) for op, f in flop_registry.items()})

    def _guard(self, op: Any, formula: Callable) -> Callable:
        def guarded(*args: Any, **kwargs: Any) -> int:
            try:
                return formula(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a formula's error must not fail the training step
                self.failures.append(f"{op}: FLOP formula raised {type(exc).__name__}: {exc}")
                return 0

        guarded._get_raw = True  # already shape-wrapped in flop_registry: FlopCounterMode takes it as it is
        return guarded

    def __enter__(self) -> "TolerantFlopCounter":
        super().__enter__()
        mode = getattr(self, "mode", None)  # the TorchDispatchMode that FlopCounterMode pushed
        if mode is not None and hasattr(mode, "counter"):
            mode.__class__ = _tolerant(type(mode))  # same instance, same state: only the dispatch changes
        return self
