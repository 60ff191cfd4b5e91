"""A progress bar on rank zero only (tqdm, imported lazily; absent tqdm means no bar)."""

from __future__ import annotations

import sys


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
