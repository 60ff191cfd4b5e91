"""``Trainer.predict`` on 2 processes: seconds for 1,000 and 10,000 samples (the time should grow linearly).

A ``Linear(32, 10)`` predicts each sample of a synthetic set (batch 32) on 2 CPU processes (gloo, relaunched under
torchrun by ``Trainer(devices=2)``); the predictions of both ranks are gathered into dataset order on every rank
(``loop/evaluation.py``). After one warm-up predict, each size runs ``--repeats`` times; reported: the median
seconds, and the seconds per 1,000 samples (flat when the cost is linear).

    PYTHONPATH=src python benchmarks/predict.py                 # 1,000 and 10,000 samples
    PYTHONPATH=src python benchmarks/predict.py --quick         # 100 and 1,000, one repeat (smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time


def _job(sizes: list[int], repeats: int, out: str) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices=2, enable_progress_bar=False, default_root_dir=out, timeout=300)
    torch.manual_seed(0)
    model = nn.Linear(32, 10)

    def loader(n: int) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(n, 32), torch.zeros(n)), batch_size=32)

    trainer.predict(model, loader(64))  # warm-up: process group, first gather
    seconds: dict[int, list[float]] = {}
    for n in sizes:
        data = loader(n)
        for _ in range(repeats):
            trainer.runtime.barrier()
            start = time.perf_counter()
            predictions = trainer.predict(model, data)
            seconds.setdefault(n, []).append(time.perf_counter() - start)
            assert predictions.shape == (n, 10)
    if trainer.runtime.is_rank_zero:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"seconds": seconds, "torch": torch.__version__, "machine": platform.processor() or
                       platform.machine(), "cpus": os.cpu_count()}, f)
    trainer.runtime.teardown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000", help="sample counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 samples, one repeat")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [100, 1000] if args.quick else [int(s) for s in args.sizes.split(",")]
    repeats = 1 if args.quick else args.repeats
    if args.job:
        _job(sizes, repeats, args.out)
        return
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, __file__, "--job", "--out", out, "--sizes", ",".join(map(str, sizes)),
                   "--repeats", str(repeats)]
        subprocess.run(command, check=True)
        with open(os.path.join(out, "result.json")) as f:
            result = json.load(f)
    print(f"# Trainer.predict, 2 CPU processes (gloo), Linear(32, 10), batch 32; torch {result['torch']}, "
          f"{result['machine']}, {result['cpus']} CPUs; median of {repeats}")
    print(f"{'samples':>8} {'seconds':>9} {'s/1k samples':>13}")
    for n, times in result["seconds"].items():
        median = statistics.median(times)
        print(f"{int(n):>8} {median:>9.3f} {median / int(n) * 1000:>13.4f}")


if __name__ == "__main__":
    main()
