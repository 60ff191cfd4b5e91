"""torchrun's agent, with the exit code of every failed worker written down, and (for a relaunched script) the
failing rank's own error printed last.

``python -m trainscale.runtime.agent ARGS`` runs ``torch.distributed.run.main(ARGS)``, torchrun itself. When
the workers fail for good, torchrun raises ``ChildFailedError`` (after printing its summary); its failures,
``{global rank: ProcessFailure}``, are then also written as JSON to ``<EXITS_ENV directory>/EXITS_FILE``.
A worker that ends without a Python exception (``os._exit(3)``, a crash in C code, the OOM killer's SIGKILL)
records no error of its own (``worker.py``): its exit code is known to the agent only, and this file is how
``launch.failure_report`` names it.

``python -m trainscale.runtime.agent --trainscale-report ARGS`` (what a script asking for ``devices=N`` outside a
launcher becomes: ``launch.become_torchrun``) does the same in a log directory of its own, then prints
``launch.failure_report`` last, after torchrun's summary, as ``trainscale run`` does, and exits 1.

Importing this module does not import torch.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

EXITS_ENV = "TRAINSCALE_EXITS_DIR"  # the directory of EXITS_FILE (launch.run_torchrun's log directory)
EXITS_FILE = "trainscale_exits.json"
REPORT_FLAG = "--trainscale-report"


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


def main_reporting(argv: list[str], label: str = "trainscale") -> int:
    """:func:`main` with ``--log-dir`` set to a temporary directory (removed at the end): after a failure, the
    first failed rank's own error and the ranks that ended without one (``launch.failure_report``) are printed
    last on stderr. Returns the exit status: 0, or 1 after a failure."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from trainscale.runtime.launch import failure_report

    log_dir = tempfile.mkdtemp(prefix="trainscale-run-")
    os.environ[EXITS_ENV] = log_dir
    try:
        main([f"--log-dir={log_dir}", *argv])
        return 0
    except ChildFailedError:
        traceback.print_exc()  # torchrun's summary, as the uncaught error prints it under plain torchrun
        report = failure_report(log_dir, label)
        if report:
            print(report, file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == [REPORT_FLAG]:
        sys.exit(main_reporting(sys.argv[2:]))
    main(sys.argv[1:])
