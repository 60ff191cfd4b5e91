"""A progress bar on rank zero only (tqdm, imported lazily; absent tqdm means no bar)."""

from __future__ import annotations

import math
import sys
from typing import Any


class ProgressBar:
    """``update()`` once per micro-batch; ``set_postfix`` at log intervals; ``close()`` at epoch end."""

    def __init__(self, enabled: bool, total: int, desc: str, refresh_rate: int = 1, leave: bool = False) -> None:
        """``refresh_rate``: redraw every this many micro-batches (a ``TQDMProgressBar``'s; 0: no bar); ``leave``: keep
        the finished bar on the screen."""
        self._bar = None
        self._every, self._pending = max(refresh_rate, 1), 0
        if enabled and refresh_rate > 0:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=desc, leave=leave, dynamic_ncols=True, file=sys.stderr,
                             mininterval=0.5)

    @property
    def tqdm(self) -> Any:
        """The tqdm bar itself; None where none is drawn."""
        return self._bar

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` micro-batches (drawn every ``refresh_rate``)."""
        if self._bar is not None:
            self._pending += n
            if self._pending >= self._every:
                self._bar.update(self._pending)
                self._pending = 0

    def set_postfix(self, **values) -> None:
        if self._bar is not None:
            self._bar.set_postfix(values, refresh=False)

    def __getstate__(self) -> dict:
        """A pickled bar (``torch.save(trainer)``) draws nothing: tqdm's bar holds the terminal stream."""
        return dict(self.__dict__, _bar=None)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(self._pending)
            self._bar.close()


def epoch_bar(callback: Any, rank_zero: bool, remaining: float, desc: str) -> ProgressBar:
    """A training epoch's bar, drawn on rank zero with the settings of ``callback`` (the Trainer's
    ``progress_bar_callback``; None: no bar). Its total is Lightning's, ``callback.total_train_batches`` (the steps
    left when only ``max_steps`` bounds the run, an iterable's too), at most the epoch's ``remaining`` micro-batches
    (fewer in a resumed epoch; inf: unknown). The callback's ``train_progress_bar`` is its tqdm bar from here on."""
    if callback is None:
        return ProgressBar(False, None, desc)
    total = min(remaining, callback.total_train_batches)
    bar = ProgressBar(rank_zero, None if total == math.inf else int(total), desc, refresh_rate=callback.refresh_rate,
                      leave=callback.leave)
    if bar.tqdm is not None:
        callback.train_progress_bar = bar.tqdm
    return bar
