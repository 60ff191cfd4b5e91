"""How much slower is ``strategy="ddp_spawn"`` than ``ddp`` (script relaunched under torchrun)?

Both run the same job — ``Trainer(accelerator="cpu", devices=2).fit`` of the MLP on synthetic
28×28 data for one epoch, no validation, no checkpoint — as a fresh ``python`` command, alternating,
``--repeats`` times each. Reported: the whole command's wall time (process starts, imports, pickling,
training, exit) and the training loop's own time (the summary's ``epoch_time_s``), medians, and the
ratio ddp_spawn / ddp.

    PYTHONPATH=src python benchmarks/ddp_spawn_startup.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _job(strategy: str, out: str, samples: int) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from trainscale.models import MLP
    from trainscale.loop.trainer import Trainer

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, 1, 28, 28, generator=g), torch.randint(0, 10, (samples,), generator=g))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, enable_progress_bar=False,
                      enable_checkpointing=False, default_root_dir=out, timeout=120)
    torch.manual_seed(0)
    summary = trainer.fit(MLP(), DataLoader(data, batch_size=32, shuffle=True), optimizer=_sgd)
    if summary is not None and (strategy == "ddp_spawn" or int(os.environ.get("RANK", "0")) == 0):
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(summary, f)


def _sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--job", choices=["ddp", "ddp_spawn"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        _job(args.job, args.out, args.samples)
        return
    wall: dict[str, list[float]] = {"ddp": [], "ddp_spawn": []}
    loop: dict[str, list[float]] = {"ddp": [], "ddp_spawn": []}
    for _ in range(args.repeats):
        for strategy in wall:
            with tempfile.TemporaryDirectory() as out:
                t0 = time.perf_counter()
                subprocess.run([sys.executable, os.path.abspath(__file__), "--job", strategy, "--out", out,
                                "--samples", str(args.samples)], check=True)
                wall[strategy].append(time.perf_counter() - t0)
                with open(os.path.join(out, "result.json")) as f:
                    loop[strategy].append(sum(json.load(f)["epoch_time_s"]))
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"{args.samples} samples, 2 ranks, {args.repeats} repeats (medians)")
    for strategy in wall:
        print(f"{strategy:10s} command {statistics.median(wall[strategy]):6.2f} s   "
              f"training loop {statistics.median(loop[strategy]):6.2f} s   all: "
              + ", ".join(f"{w:.2f}" for w in wall[strategy]))
    print(f"ratio ddp_spawn/ddp: command {statistics.median(wall['ddp_spawn']) / statistics.median(wall['ddp']):.2f}, "
          f"training loop {statistics.median(loop['ddp_spawn']) / statistics.median(loop['ddp']):.2f}")


if __name__ == "__main__":
    main()
