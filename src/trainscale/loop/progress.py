"""A progress bar on rank zero only (tqdm, imported lazily; absent tqdm means no bar)."""

from __future__ import annotations

import sys


class ProgressBar:
    """``update()`` once per micro-batch; ``set_postfix`` at log intervals; ``close()`` at epoch end."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self._bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr,
                             mininterval=0.5)

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` micro-batches."""
        if self._bar is not None:
            self._bar.update(n)

    def set_postfix(self, **values) -> None:
        if self._bar is not None:
            self._bar.set_postfix(values, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
