"""Stages for tests/test_gpu_check.py, run by benchmarks/gpu_check.py in a stage process of their own
(``Stage(body="tests/gpu_check_stages.py:FUNCTION")``)."""

import subprocess
import sys
import time

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def sleep_past_timeout(report, smoke, scratch) -> None:
    """Record a number, start two children that outlive any timeout (one in this process group, one in a
    session of its own, as pytest's or torchrun's workers are), record their pids, then sleep until killed."""
    report.numbers["measured_before_the_hang"] = 1.5
    same_group = subprocess.Popen(SLEEP)
    own_session = subprocess.Popen(SLEEP, start_new_session=True)
    report.numbers.update(child_pids=[same_group.pid, own_session.pid])
    report.check("a check made before the hang", 1.5, "> 1", True)
    time.sleep(600)
