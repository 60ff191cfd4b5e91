"""Lightning's ``lightning.pytorch.utilities.exceptions`` name that training code catches: ``SIGTERMException``."""

from __future__ import annotations

import signal


class SIGTERMException(SystemExit):
    """What ``fit`` raises after SIGTERM, exit code 143 (128 + SIGTERM), as Lightning's: catch it, or read it in a
    callback's ``on_exception``. trainscale raises it once the checkpoint that follows the signal is written (it is
    then also a ``trainscale.faults.signals.Preempted``, with the checkpoint's ``path``)."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)
