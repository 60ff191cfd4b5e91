"""How fast a signal becomes a checkpoint, and how fast a job with a stuck rank ends.

    PYTHONPATH=src python benchmarks/preemption.py [--quick]

Every case is one job of 2 CPU ranks (gloo) started as ``python -m torch.distributed.run --standalone
--nproc-per-node=2 benchmarks/preemption.py --worker ...``: a ``Trainer`` with ``log_every_n_steps=50``,
no step checkpoints, whose ``training_step`` sleeps to make its steps last ``--step-s`` seconds.

- ``0.7 s steps``, ``50 ms steps``: after 10 optimizer steps, SIGTERM to torchrun's agent, which sends
  SIGTERM to its workers and SIGKILL 30 s later (``torch.distributed.elastic``). Measured: seconds from
  the SIGTERM to the checkpoint's file (its modification time; "none" when no checkpoint was written)
  and to the job's end.
- ``stuck rank, SIGTERM``: rank 1 stalls for good in step 5 (rank 0 then waits in the gradient
  all-reduce); SIGTERM to the agent 2 s later. Measured: seconds from the SIGTERM to the job's end.
- ``stuck rank, timeout``: the same stall, no signal, ``timeout=10`` s: seconds from the stall to the
  job's end (rank 0's collective timeout, the agent's SIGTERM to rank 1, rank 1's exit).

``--quick`` runs the 50 ms case only. Run it against other sources with ``PYTHONPATH=<their src>``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def worker(args: argparse.Namespace) -> None:
    """One rank: a linear model whose steps sleep ``args.step_s``; rank 0 writes its step count to
    ``OUT/progress``; with ``--stall-at`` rank 1 writes ``OUT/stuck`` and blocks in that step."""
    import threading

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from trainscale import Trainer

    out, rank = Path(args.out), int(os.environ["RANK"])

    class Sleepy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 2)

        def training_step(self, batch):
            step = trainer.global_step
            if rank == 0:
                (out / "progress").write_text(str(step))
            if args.stall_at is not None and rank == 1 and step == args.stall_at:
                (out / "stuck").write_text(str(time.time()))
                threading.Event().wait()
            time.sleep(args.step_s)
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

    trainer = Trainer(devices="auto", max_epochs=1, log_every_n_steps=50, enable_progress_bar=False,
                      default_root_dir=out / "runs", timeout=args.timeout, seed=0)
    data = TensorDataset(torch.randn(8000, 8), torch.randint(0, 2, (8000,)))
    trainer.fit(Sleepy(), DataLoader(data, batch_size=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))


def _wait_for(path: Path, job: subprocess.Popen, at_least: int | None = None, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and job.poll() is None:
        if path.exists() and (at_least is None or int(path.read_text() or 0) >= at_least):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the job never wrote {path} (exit code {job.poll()})")


def run_case(step_s: float, *, stall: bool, signal_job: bool, timeout: float = 300) -> dict:
    """One job; returns seconds from the SIGTERM (or the stall) to the checkpoint file and to the end."""
    with tempfile.TemporaryDirectory(prefix="trainscale-preemption-") as tmp:
        out = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HERE),
               "--worker", "--out", tmp, "--step-s", str(step_s), "--timeout", str(timeout)]
        if stall:
            cmd += ["--stall-at", "5"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(out / "log.txt", "w") as log:
            job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                if stall:
                    _wait_for(out / "stuck", job)
                    start = float((out / "stuck").read_text())
                    if signal_job:
                        time.sleep(2.0)
                else:
                    _wait_for(out / "progress", job, at_least=10)
                if signal_job:
                    start = time.time()
                    job.send_signal(signal.SIGTERM)
                code = job.wait(timeout=600)
            finally:
                if job.poll() is None:
                    job.kill()
        ended = time.time() - start
        ckpts = sorted((out / "runs").glob("version_*/checkpoints/*.ckpt"), key=lambda p: p.stat().st_mtime)
        to_ckpt = ckpts[-1].stat().st_mtime - start if ckpts else None
        return {"to_checkpoint_s": to_ckpt, "to_end_s": ended, "exit_code": code,
                "checkpoint": ckpts[-1].name if ckpts else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 50 ms case only")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--step-s", type=float, default=0.05, help=argparse.SUPPRESS)
    parser.add_argument("--stall-at", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=300, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    cases = [("50 ms steps", dict(step_s=0.05, stall=False, signal_job=True))]
    if not args.quick:
        cases = [("0.7 s steps", dict(step_s=0.7, stall=False, signal_job=True)), *cases,
                 ("stuck rank, SIGTERM", dict(step_s=0.05, stall=True, signal_job=True)),
                 ("stuck rank, timeout", dict(step_s=0.05, stall=True, signal_job=False, timeout=10))]
    print(f"{'case':22s} {'to checkpoint s':>16s} {'to job end s':>13s} {'exit':>5s}  checkpoint")
    for name, kwargs in cases:
        r = run_case(**kwargs)
        ckpt = f"{r['to_checkpoint_s']:16.1f}" if r["to_checkpoint_s"] is not None else f"{'none':>16s}"
        print(f"{name:22s} {ckpt} {r['to_end_s']:13.1f} {r['exit_code']:5d}  {r['checkpoint']}", flush=True)


if __name__ == "__main__":
    main()
