"""The collectives a traced training step issues, as PyTorch's functional collectives see them.

DTensor (tensor parallelism's ``parallelize_module`` styles) redistributes through the functional
collectives of ``torch.distributed._functional_collectives`` (``torch.ops._c10d_functional.all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``), which pass through the
dispatcher; :class:`CollectiveLog`, a ``TorchDispatchMode``, records each with its bytes. On a fake
process group and fake tensors (``trainscale.plan.memory``) nothing is sent and nothing allocated: the log
is the step's communication as the real run would issue it (the idea of ``CommDebugMode``,
``torch.distributed.tensor.debug``, which counts the same ops but keeps no sizes). FSDP2 calls the
non-functional ``torch.distributed`` collectives, which bypass the dispatcher: they are not logged here
(``trainscale.plan.comm`` models them).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils._python_dispatch import TorchDispatchMode

# op name -> the kind trainscale.plan.comm times; the bytes each records are its input's (the local tensor)
KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "all_to_all_single": "all_to_all"}


@dataclass(frozen=True)
class Collective:
    """One collective: ``kind`` ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") and ``nbytes``,
    the bytes of its local input on one rank (an all-gather's output is ``group size`` times that)."""

    kind: str
    nbytes: int


class CollectiveLog(TorchDispatchMode):
    """``with CollectiveLog() as log: ...`` records ``log.collectives`` in issue order."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            kind = KINDS.get(func.__name__.split(".")[0])
            if kind is not None:
                tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                self.collectives.append(Collective(kind, sum(t.numel() * t.element_size() for t in tensors)))
        return func(*args, **(kwargs or {}))


def per_step(collectives: list[Collective], steps: int) -> list[Collective]:
    """The collectives of one of ``steps`` identical traced steps (the last ``len // steps``).

    Raises:
        ValueError: a log whose length ``steps`` does not divide (the steps were not identical).
    """
    if len(collectives) % steps:
        raise ValueError(f"{len(collectives)} collectives do not split into {steps} identical steps")
    return collectives[len(collectives) - len(collectives) // steps:]
