"""A rank killed (SIGKILL) while a checkpoint is written, and SIGTERM while a sharded (DCP) write is under way:
what is left on disk, whether a process survives, and whether ``ckpt_path="last"`` resumes exactly.

    PYTHONPATH=src:. python benchmarks/kill_during_save.py [CASE ...]

Every case is a job of 2 CPU ranks (gloo) started with ``trainscale run -n 2 tests/fault_script.py`` (a ConvNet,
2 epochs of 12 steps, a checkpoint every 5 steps and at each epoch end, ``timeout=20``), whose rank R's write
of the step-10 checkpoint is held by a test hook (``--hold-save-at 10 --hold-rank R``): a checkpoint file stops
half written (ddp: rank 0 writes it), a sharded one once rank R's shards are on disk (before ``.metadata`` and
the rename), in the main thread (synchronous save) or the writer thread (``--checkpoint-async``). Cases:

- ``ddp-sync-0``, ``fsdp-sync-1``, ``fsdp-async-1``, ``fsdp-async-0``: SIGKILL to rank R alone while it is held.
- ``fsdp-sync-0-term``: rank 0 held for 3 s, SIGTERM to ``trainscale run`` meanwhile (torchrun passes it on).

Measured for each: the job's exit code and seconds from the signal to its end; processes of the job still
alive 0.5 s later; the files left in ``checkpoints/`` and what ``last`` names; then ``--resume``
(``ckpt_path="last"``): its exit code, the checkpoint it resumed from, and whether the final weights of both
ranks equal those of an uninterrupted run of the same job, bit for bit. A background save under ddp has no
case: ``checkpoint_async=True`` is refused there when the Trainer is built.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINSCALE = str(Path(sys.executable).parent / "trainscale")
SCRIPT = str(ROOT / "tests" / "fault_script.py")
CASES = ["ddp-sync-0", "fsdp-sync-1", "fsdp-async-1", "fsdp-async-0", "fsdp-sync-0-term"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "TORCHELASTIC", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _job(strategy: str, out: Path, *extra: str) -> list[str]:
    return [TRAINSCALE, "run", "-n", "2", SCRIPT, "--strategy", strategy, "--timeout", "20", "--out", str(out), *extra]


def _same_weights(a: Path, b: Path) -> bool:
    import torch

    return all(torch.equal(torch.load(a / f"final-rank{r}.pt")[k], v)
               for r in (0, 1) for k, v in torch.load(b / f"final-rank{r}.pt").items())


def run_case(name: str, tmp: Path, uninterrupted: Path) -> dict:
    from trainscale.jobs.launcher import _alive, _descendants

    strategy, mode, rank, *rest = name.split("-")
    term = rest == ["term"]
    out = tmp / name
    cmd = _job(strategy, out, *(["--checkpoint-async"] if mode == "async" else []))
    hold = ["--hold-save-at", "10", "--hold-rank", rank, *(["--hold-for", "3"] if term else [])]
    job = subprocess.Popen(cmd + hold, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                           cwd=ROOT, start_new_session=True)
    held = out / f"held-rank{rank}"
    while not held.exists():
        if job.poll() is not None:
            raise RuntimeError(f"{name}: the job ended before its write was held:\n{job.stdout.read()[-3000:]}")
        time.sleep(0.1)
    processes = _descendants(job.pid)
    start = time.monotonic()
    os.kill(job.pid, signal.SIGTERM) if term else os.kill(int(held.read_text()), signal.SIGKILL)
    try:
        code = job.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        code = "hang"
    ended = time.monotonic() - start
    time.sleep(0.5)
    checkpoints = out / "runs" / "version_0" / "checkpoints"
    last = (checkpoints / "last").read_text().strip() if (checkpoints / "last").exists() else None
    files = sorted(p.name for p in checkpoints.iterdir())  # before the resume's saves
    resumed = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    log = resumed.stdout + resumed.stderr
    source = next((line.split("checkpoints/")[-1] for line in log.splitlines() if "resumed from" in line), None)
    return {"case": name, "exit": code, "ended_s": round(ended, 1), "left": [p for p in processes if _alive(p)],
            "files": files, "last": last, "resume_exit": resumed.returncode,
            "resumed_from": source, "exact": resumed.returncode == 0 and _same_weights(out, uninterrupted)}


def main() -> None:
    cases = sys.argv[1:] or CASES
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {CASES}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        uninterrupted = {}
        for strategy in sorted({c.split("-")[0] for c in cases}):
            uninterrupted[strategy] = tmp / f"uninterrupted-{strategy}"
            subprocess.run(_job(strategy, uninterrupted[strategy]), check=True, capture_output=True, env=_env(),
                           cwd=ROOT, timeout=300)
        for name in cases:
            print(run_case(name, tmp, uninterrupted[name.split("-")[0]]), flush=True)


if __name__ == "__main__":
    main()
