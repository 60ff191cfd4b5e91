"""``trainscale check``'s runs for tests/test_check.py with their ranks forked from the warm forkserver
(tests/helpers.py: ``run_distributed``) instead of fresh interpreters under torchrun: the check's worker
(``main --config JOB.json``), its trace and error files, and everything the command does around the runs, as
the product runs them. Only the process start differs; ``test_the_demo_convnet_passes[ddp]`` runs the command
whole, through torchrun."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from tests.helpers import run_distributed

# What _child sets and a one-device launch_job run does not have: that run is a plain process, no launcher
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _rank(rank: int, module: str, config: str, devices: int) -> None:
    if devices == 1:
        for name in LAUNCHER_VARS:
            os.environ.pop(name, None)
    importlib.import_module(module).main(["--config", config])


def launch_job(module: str, config: Path, devices: int, log_path: Path, timeout: float,
               threads: int | None = None) -> tuple[int | None, bool, int]:
    """:func:`trainscale.jobs.launcher.launch_job`'s contract; a rank that raises fails the test with its traceback
    (``run_distributed``), the output goes to the test's capture instead of ``log_path``."""
    log_path.write_text("ranks forked from the test session's forkserver (tests/check_launch.py)\n")
    run_distributed(_rank, module, str(config), devices, world_size=devices, timeout=timeout)
    return 0, False, 1
