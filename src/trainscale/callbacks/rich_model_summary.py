"""Lightning's ``RichModelSummary``: the ``ModelSummary`` table drawn with rich."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from trainscale.callbacks.model_summary import ModelSummary, Summary, readable_count, summarize

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer


class RichModelSummary(ModelSummary):
    """``RichModelSummary(max_depth=1, **summarize_kwargs)``, as Lightning's ``callbacks.RichModelSummary``: the
    layers and parameter counts of :class:`ModelSummary`, printed on rank zero at ``on_fit_start`` as a rich table
    (columns " ", "Name", "Type", "Params") and a grid of the totals ("Trainable params", "Non-trainable params",
    "Total params", "Total estimated model params size (MB)"). ``summarize_kwargs``: ``header_style`` (rich's style
    of the header row; default "bold magenta", Lightning's). rich is imported when the table is drawn. With it in
    ``callbacks``, the Trainer adds no ``ModelSummary`` of its own. No "Mode" or FLOPs columns (as ``ModelSummary``).

    Raises:
        ModuleNotFoundError: rich is not installed (Lightning's message, naming the pip command).
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if importlib.util.find_spec("rich") is None:
            raise ModuleNotFoundError("`RichModelSummary` requires `rich` to be installed. Install it by running "
                                      "`pip install -U rich`.")
        super().__init__(max_depth)
        self._summarize_kwargs = summarize_kwargs

    def on_fit_start(self, trainer: Trainer, module: Any) -> None:
        if trainer.runtime.is_rank_zero:
            print_rich(summarize(module, self.max_depth, trainer.runtime.config.precision), **self._summarize_kwargs)


def print_rich(summary: Summary, header_style: str = "bold magenta") -> None:
    """``summary`` as Lightning's ``RichModelSummary.summarize`` draws it, to stdout through a rich ``Console``."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(header_style=header_style)
    table.add_column(" ", style="dim")
    table.add_column("Name", justify="left", no_wrap=True)
    table.add_column("Type")
    table.add_column("Params", justify="right")
    for i, layer in enumerate(summary.layers):
        table.add_row(str(i), layer.name, layer.type, readable_count(layer.params))
    console.print(table)
    grid = Table.grid(expand=True)
    grid.add_column()
    for label, value in (("Trainable params", readable_count(summary.trainable_params)),
                         ("Non-trainable params", readable_count(summary.total_params - summary.trainable_params)),
                         ("Total params", readable_count(summary.total_params)),
                         ("Total estimated model params size (MB)", f"{summary.size_mb:.3f}")):
        grid.add_row(f"[bold]{label}[/]: {value:<10}")
    console.print(grid)
