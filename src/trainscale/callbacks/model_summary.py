"""A table of the model's layers and parameter counts, printed at the start of ``fit`` (Lightning's ``ModelSummary``).

    from trainscale.callbacks import ModelSummary
    Trainer(callbacks=[ModelSummary(max_depth=2)])    # or the default one: Trainer(enable_model_summary=True)

    print(summarize(model))                           # the same table for any nn.Module
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from trainscale.callbacks.base import Callback
from trainscale.runtime.precision import parameter_dtype

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer

BYTES_PER_PARAM = 4  # of an fp32 parameter: "32-true" and the mixed precisions (as Lightning's estimate)


def _numel(p: nn.Parameter) -> int:
    """A parameter's elements in the whole model: a DTensor's shape is the global one, so a parameter sharded by
    fsdp or split by tp counts fully on every rank (``DTensor.numel()`` is global too); a lazy parameter counts 0."""
    if isinstance(p, nn.parameter.UninitializedParameter) and not hasattr(p, "device_mesh"):
        return 0
    return p.numel()


@dataclass(frozen=True)
class LayerSummary:
    """One row: the submodule's dotted name, its class name and parameters (its own and its children's)."""

    name: str
    type: str
    params: int


@dataclass(frozen=True)
class Summary:
    """The layers down to ``max_depth`` and the whole model's parameter counts.

    Attributes:
        layers: one :class:`LayerSummary` per submodule of depth <= ``max_depth`` (1: the direct children).
        trainable_params, total_params: over every parameter of the model (each shared one once), global shapes.
        bytes_per_param: of the run's precision: 4 (fp32 weights, also under the mixed precisions), 2 under
            "bf16-true", 8 under "64-true", as Lightning's model summary counts them.
        size_mb: ``total_params × bytes_per_param`` / 1e6 (Lightning's "Total estimated model params size (MB)").
    """

    layers: tuple[LayerSummary, ...]
    trainable_params: int
    total_params: int
    bytes_per_param: int = BYTES_PER_PARAM

    @property
    def size_mb(self) -> float:
        return self.total_params * self.bytes_per_param / 1e6

    def __str__(self) -> str:
        from tabulate import tabulate  # on rank zero at fit start only

        rows = [(str(i), layer.name, layer.type, readable_count(layer.params)) for i, layer in enumerate(self.layers)]
        table = tabulate(rows, ("", "Name", "Type", "Params"), tablefmt="presto", disable_numparse=True)
        lines = [table, "-" * len(table.splitlines()[1])]
        lines += [f"{readable_count(self.trainable_params):<10}Trainable params",
                  f"{readable_count(self.total_params - self.trainable_params):<10}Non-trainable params",
                  f"{readable_count(self.total_params):<10}Total params",
                  f"{self.size_mb:<10.3f}Total estimated model params size (MB)"]
        return "\n".join(lines)


def readable_count(number: int) -> str:
    """``1234567`` → "1.2 M", ``132000`` → "132 K", as Lightning's ``get_human_readable_count`` (K, M, B, T;
    integers below 1000; one decimal below 100 of a unit)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if number >= scale:
            scaled = number / scale
            return f"{int(scaled):,d} {unit}" if scaled >= 100 and unit != "T" or scaled >= 1000 else f"{scaled:.1f} {unit}"
    return str(int(number))


def summarize(model: nn.Module, max_depth: int = 1, precision: str = "32-true") -> Summary:
    """The :class:`Summary` of ``model`` (``str()`` of it is the table Lightning prints).

    Args:
        max_depth: the deepest submodules listed (1: the direct children; -1: all; 0: no rows, the totals only).
        precision: the run's precision flag, for the bytes of a parameter in the size estimate.

    Raises:
        ValueError: ``max_depth`` below -1 or not an int.
    """
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
        raise ValueError(f"max_depth={max_depth!r} must be -1 (every layer), 0 (totals only) or an int > 0")
    layers = tuple(LayerSummary(name, type(module).__name__, sum(_numel(p) for p in module.parameters()))
                   for name, module in model.named_modules()
                   if name and (max_depth == -1 or name.count(".") < max_depth))
    params = list(model.parameters())  # each shared parameter once
    return Summary(layers, sum(_numel(p) for p in params if p.requires_grad), sum(_numel(p) for p in params),
                   parameter_dtype(precision).itemsize)


class ModelSummary(Callback):
    """Print the model's :func:`summarize` table on rank zero at ``on_fit_start`` (Lightning's ``ModelSummary``
    callback; the Trainer adds ``ModelSummary()`` when ``enable_model_summary`` is on and the callbacks hold none).
    Parameters of fsdp shards and tp splits are counted by their global shapes (no collective runs).

    Args:
        max_depth: as :func:`summarize`'s (Lightning's default 1).
    """

    def __init__(self, max_depth: int = 1) -> None:
        summarize(nn.Module(), max_depth)  # a bad max_depth fails here, not at fit
        self.max_depth = max_depth

    def on_fit_start(self, trainer: Trainer, module: Any) -> None:
        if trainer.runtime.is_rank_zero:
            trainer.runtime.print(str(summarize(module, self.max_depth, trainer.runtime.config.precision)))
