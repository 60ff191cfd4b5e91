"""Progress-bar callbacks with Lightning's names: ``TQDMProgressBar(refresh_rate, leave)`` and ``RichProgressBar``,
both the Trainer's tqdm bar on rank zero (``loop/progress.py``) with their settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainscale.callbacks.base import Callback


class TQDMProgressBar(Callback):
    """The training bar's settings, as Lightning's ``TQDMProgressBar``.

    Args:
        refresh_rate: redraw every this many micro-batches (0: no bar at all).
        process_position: accepted for Lightning's signature; the bar is drawn on rank zero only.
        leave: keep each epoch's finished bar on the screen.

    Raises:
        ValueError: ``refresh_rate`` below 0.
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        if not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ValueError(f"refresh_rate={refresh_rate!r} must be an int >= 0 (0: no bar)")
        self.refresh_rate, self.process_position, self.leave = refresh_rate, process_position, leave

    @property
    def is_enabled(self) -> bool:
        return self.refresh_rate > 0

    @property
    def train_progress_bar(self) -> Any:
        """The tqdm bar of the running or last training epoch, as Lightning's (``.total``, ``.n``,
        ``.set_description(...)``); the Trainer draws and advances it.

        Raises:
            TypeError: no bar yet (before a fit's first epoch; on ranks other than zero and without tqdm there is
                none), in Lightning's words.
        """
        bar = getattr(self, "_train_progress_bar", None)
        if bar is None:
            raise TypeError(f"The `{type(self).__name__}._train_progress_bar` reference has not been set yet.")
        return bar

    @train_progress_bar.setter
    def train_progress_bar(self, bar: Any) -> None:
        self._train_progress_bar = bar

    def __getstate__(self) -> dict:
        """Pickled (``torch.save(trainer)``, a ``ddp_spawn`` launch) without the tqdm bar, which holds the terminal
        stream and does not pickle: ``train_progress_bar`` is unset in the copy."""
        return {k: v for k, v in self.__dict__.items() if k != "_train_progress_bar"}

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        self.trainer = trainer  # Lightning's ProgressBar.trainer, for get_metrics in its hooks

    @property
    def total_train_batches(self) -> int | float:
        """Training batches of this epoch's bar (Lightning's ``ProgressBar.total_train_batches``):
        ``trainer.num_training_batches``, or the steps left when only ``max_steps`` bounds the run; inf for an
        iterable data set."""
        trainer = self.trainer
        if trainer.max_epochs == -1 and trainer.max_steps > 0:
            return min(trainer.num_training_batches, trainer.max_steps - trainer.global_step)
        return trainer.num_training_batches

    @property
    def total_val_batches(self) -> int | float:
        """Validation batches of this epoch (Lightning's ``ProgressBar.total_val_batches``): the sum of
        ``trainer.num_val_batches``, 0 in an epoch that ``check_val_every_n_epoch`` skips or without validation."""
        trainer = self.trainer
        return sum(trainer.num_val_batches) if trainer.config.validates_in(trainer.current_epoch) else 0

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, float | int]:
        """Lightning's ``ProgressBar.get_metrics``: ``trainer.progress_bar_metrics`` (the values logged with
        ``prog_bar=True``, floats) and ``v_num``, the run directory's version N (``version_N``). For code that reads
        them; the Trainer's bar draws its postfix from the step records, not from this method."""
        version = Path(trainer.run_dir).name.removeprefix("version_") if trainer.run_dir is not None else ""
        return {**trainer.progress_bar_metrics, **({"v_num": int(version)} if version.isdigit() else {})}


class RichProgressBar(TQDMProgressBar):
    """Lightning's ``RichProgressBar(refresh_rate=1, leave=False, theme=None, console_kwargs=None)``: here the same
    tqdm bar as :class:`TQDMProgressBar` (rich is not used); ``theme`` and ``console_kwargs`` are accepted and
    ignored."""

    def __init__(self, refresh_rate: int = 1, leave: bool = False, theme: object = None,
                 console_kwargs: dict | None = None) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self.theme, self.console_kwargs = theme, console_kwargs
