"""What the SHA-256 record of a sharded (DCP) checkpoint costs, in seconds per GB written and read.

    PYTHONPATH=src python benchmarks/checkpoint_digests.py [--quick] [--mb 1024 --rounds 3]

One process (a gloo group of one), a model of ``--mb`` MB of fp32 weights saved by ``DCPCheckpointer``
(the fsdp/model_parallel checkpoint) into a temporary directory, then loaded with ``verify=True`` and
``verify=False``. Prints, best of ``--rounds``: the save, the part of it that hashes the written files
(``_sha256`` over the shard files, as ``_ShardWriter`` does after writing them: read back from the page
cache), the two loads and their difference (the verification). On several ranks each rank hashes and
verifies its own shards, in parallel. ``--quick``: 64 MB, one round (a smoke test).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainscale.runtime.strategies import dcp_checkpoint


def best_of(rounds: int, fn) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=1024, help="MB of fp32 weights (default 1024)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="64 MB, one round (smoke test)")
    args = p.parse_args()
    mb, rounds = (64, 1) if args.quick else (args.mb, args.rounds)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    dist.init_process_group("gloo", rank=0, world_size=1)
    layers = max(1, mb // 16)  # 16 MB tensors
    model = nn.ParameterList(nn.Parameter(torch.randn(4 * 2**20)) for _ in range(layers))
    checkpointer = dcp_checkpoint.DCPCheckpointer(0, "fsdp")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        save_s = best_of(rounds, lambda: checkpointer.save(path, {"model": model}))
        files = sorted(p for p in path.iterdir() if p.suffix == ".distcp")
        gb = sum(f.stat().st_size for f in files) / 1e9
        hash_s = best_of(rounds, lambda: [dcp_checkpoint._sha256(f) for f in files])
        verified_s = best_of(rounds, lambda: checkpointer.load(path, {"model": model}, verify=True))
        unverified_s = best_of(rounds, lambda: checkpointer.load(path, {"model": model}, verify=False))
    dist.destroy_process_group()
    print(f"## sharded checkpoint of {gb:.3f} GB ({len(files)} shard file(s)), best of {rounds}; "
          f"torch {torch.__version__}, {os.cpu_count()} CPU(s)")
    print(f"{'what':<24}{'seconds':>10}{'s per GB':>10}")
    for name, seconds in (("save (with digests)", save_s), ("hash at save", hash_s),
                          ("load verify=True", verified_s), ("load verify=False", unverified_s),
                          ("verify at load", verified_s - unverified_s)):
        print(f"{name:<24}{seconds:>10.3f}{seconds / gb:>10.3f}")


if __name__ == "__main__":
    main()
