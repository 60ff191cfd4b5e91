"""Code that runs on global rank 0 only, as Lightning's ``rank_zero_only`` and its ``rank_zero_*`` messages
(``lightning_utilities.core.rank_zero``, ``lightning.fabric.utilities.rank_zero``)::

    from trainscale.utilities import rank_zero_only, rank_zero_info

    @rank_zero_only
    def save_samples(images): ...          # runs on rank 0; None elsewhere

    rank_zero_info("epoch %d done", epoch)  # said once per job, not once per rank

``rank_zero_only.rank`` is this process's global rank: read from the launcher's environment when this module is first
imported (RANK, LOCAL_RANK, SLURM_PROCID, JSM_NAMESPACE_RANK, the first set; else 0, as Lightning's), then set to the
rank of the job the process joins by ``Runtime.launch`` (as Lightning's strategies set it), which also covers launchers
whose variables are others (mpirun) and forked ranks. Like Lightning's, it is one value per process, which you may set.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from typing import Any, Callable, TypeVar

_T = TypeVar("_T")
_log = logging.getLogger(__name__)
# where Lightning's _get_rank looks, in its order (SLURM_PROCID may be set outside an srun step: LOCAL_RANK first)
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def launcher_rank(env: dict[str, str] | os._Environ = os.environ) -> int:
    """The first of :data:`RANK_VARIABLES` set in ``env``, as an int; 0 when none is."""
    value = next((env[name] for name in RANK_VARIABLES if env.get(name) is not None), None)
    return 0 if value is None else int(value)


class RankZeroOnly:
    """The decorator ``rank_zero_only`` (one instance per process, holding :attr:`rank`): ``@rank_zero_only`` or
    ``rank_zero_only(fn, default)`` makes ``fn`` run on rank 0 only and return ``default`` (None) on the others.

    Attributes:
        rank: this process's global rank (see the module's docstring); None makes each call raise.
    """

    def __init__(self, rank: int | None) -> None:
        self.rank = rank

    def __call__(self, fn: Callable[..., _T], default: Any = None) -> Callable[..., Any]:
        @functools.wraps(fn)
        def on_rank_zero(*args: Any, **kwargs: Any) -> Any:
            if self.rank is None:  # read at the call, so that a rank set later counts
                raise RuntimeError("rank_zero_only.rank is None: set it to this process's global rank before use "
                                   "(trainscale sets it from the launcher's RANK and in Runtime.launch)")
            return fn(*args, **kwargs) if self.rank == 0 else default

        return on_rank_zero


rank_zero_only = RankZeroOnly(launcher_rank())


def log_info(log: logging.Logger, message: str, *args: Any, stacklevel: int = 1, **kwargs: Any) -> None:
    """``message`` (``%``-formatted with ``args``) at INFO through ``log`` where logging is set to show INFO
    (``logging.basicConfig(level=logging.INFO)``, pytest's ``caplog``), the record naming the caller ``stacklevel``
    frames up; printed to stdout otherwise, so that it is seen without a logging setup (Python's default shows
    warnings and errors only; Lightning gives its own loggers a handler at INFO for the same reason)."""
    if log.isEnabledFor(logging.INFO):
        log.info(message, *args, stacklevel=stacklevel + 1, **kwargs)
    else:
        print(message % args if args else message, flush=True)


@rank_zero_only
def rank_zero_info(message: str, *args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """Lightning's ``rank_zero_info``: :func:`log_info` through this module's logger, on rank 0 only.
    ``stacklevel`` counts as Lightning's (4: the caller)."""
    log_info(_log, message, *args, stacklevel=stacklevel - 1, **kwargs)


@rank_zero_only
def rank_zero_debug(message: str, *args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """Lightning's ``rank_zero_debug``: ``logging`` at DEBUG through this module's logger, on rank 0 only."""
    _log.debug(message, *args, stacklevel=stacklevel - 1, **kwargs)


@rank_zero_only
def rank_zero_warn(message: str | Warning, stacklevel: int = 4, **kwargs: Any) -> None:
    """Lightning's ``rank_zero_warn``: ``warnings.warn(message, **kwargs)`` (``category=``: UserWarning by default) on
    rank 0 only, attributed to the caller (``stacklevel`` counts as Lightning's: 4)."""
    warnings.warn(message, stacklevel=stacklevel - 1, **kwargs)
