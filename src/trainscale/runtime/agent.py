"""torchrun's agent, with the exit code of every failed worker written down for ``launch.failure_report``.

``python -m trainscale.runtime.agent ARGS`` runs ``torch.distributed.run.main(ARGS)``, torchrun itself. When
the workers fail for good, torchrun raises ``ChildFailedError`` (after printing its summary); its failures,
``{global rank: ProcessFailure}``, are then also written as JSON to ``<EXITS_ENV directory>/EXITS_FILE``
and the error is raised on. A worker that ends without a Python exception (``os._exit(3)``, a crash in C
code, the OOM killer's SIGKILL) records no error of its own (``worker.py``): its exit code is known to the
agent only, and this file is how ``trainscale run`` and a relaunched script name it.

Importing this module does not import torch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

EXITS_ENV = "TRAINSCALE_EXITS_DIR"  # set by launch.run_torchrun to its log directory
EXITS_FILE = "trainscale_exits.json"


def main(argv: list[str]) -> None:
    """Run torchrun with ``argv``; on ``ChildFailedError`` write ``[{rank, local_rank, exitcode}]`` of each failed
    worker to ``EXITS_FILE`` (when ``EXITS_ENV`` is set) and raise it on."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except ChildFailedError as err:
        directory = os.environ.get(EXITS_ENV)
        if directory:
            exits = [{"rank": rank, "local_rank": failure.local_rank, "exitcode": failure.exitcode}
                     for rank, failure in sorted(err.failures.items())]
            Path(directory, EXITS_FILE).write_text(json.dumps(exits))
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
