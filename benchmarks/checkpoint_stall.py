"""How long a checkpoint blocks training: a synchronous DCP save against a background one (``async_save``).

    PYTHONPATH=src python benchmarks/checkpoint_stall.py [--quick] [--layers 8 --width 512 --rounds 5]

One job of 2 CPU ranks (gloo), started as ``python -m torch.distributed.run --standalone --nproc-per-node=2
benchmarks/checkpoint_stall.py --worker ...``: a GPT sharded by fsdp, SGD with momentum, through the Runtime
(the code the Trainer's ``checkpoint_async`` uses). After a warm-up save of each kind, each round:

- ``sync``: ``Runtime.save(path, state)``: seconds until it returns (every rank's shards written, the
  directory renamed, a barrier).
- ``async``: ``Runtime.save(path, state, asynchronous=True)``: seconds until it returns (the stall: the state
  collected and copied to host memory, the extra file written); then training steps go on until the write has
  ended (``AsyncSave.done()``), and ``wait_for_save()`` publishes it. Reported: the stall, the background
  write's seconds (``AsyncSave.write_s``), the steps trained meanwhile, and the median step time during
  the write against without one (on 2 shared cores the writer thread competes with training).

Each figure is rank 0's median over the rounds (min–max in brackets), with the checkpoint's bytes per rank.
``--quick`` runs a small model for one round (a smoke test). Run it against other sources with
``PYTHONPATH=<their src>``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def _step(rt, model, optimizer, batch) -> float:
    from trainscale.models import lm_loss

    started = time.perf_counter()
    x, y = batch
    loss = lm_loss(model(x), y)
    rt.backward(loss)
    rt.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def _round(rt, model, optimizer, batch, path: Path) -> dict:
    """One synchronous save, then one background save with training steps until its write has ended."""
    rt.barrier()
    started = time.perf_counter()
    rt.save(path / "sync", {"model": model, "optimizer": optimizer})
    sync_s = time.perf_counter() - started
    quiet = [_step(rt, model, optimizer, batch) for _ in range(3)]
    rt.barrier()
    started = time.perf_counter()
    pending = rt.save(path / "async", {"model": model, "optimizer": optimizer}, asynchronous=True)
    stall_s = time.perf_counter() - started
    busy = []
    while True:  # every rank steps until rank 0's write has ended (the same count on all ranks)
        ended = rt.broadcast_object(pending.done())
        if ended:
            break
        busy.append(_step(rt, model, optimizer, batch))
    rt.wait_for_save()
    return {"sync_s": sync_s, "stall_s": stall_s, "write_s": pending.write_s, "steps": len(busy),
            "step_s": statistics.median(busy) if busy else float("nan"), "quiet_step_s": statistics.median(quiet)}


def worker(args: argparse.Namespace) -> None:
    import torch

    from trainscale.models import GPT, GPTConfig
    from trainscale.runtime.runtime import Runtime

    rt = Runtime(accelerator="cpu", devices="auto", strategy="fsdp", timeout=300)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, context_length=64, n_layer=args.layers, n_head=8, n_embd=args.width)
    model, optimizer = rt.setup(GPT(config), lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9))
    batch = (torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64)))
    params = sum(p.numel() for p in model.parameters())  # DTensors count their global size
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainscale-ckpt-stall-", dir=args.dir) as tmp:
        root = Path(rt.broadcast_object(tmp))
        for i in range(args.rounds + 1):  # round 0 warms up (first-call costs, the gloo group of async saves)
            rows.append(_round(rt, model, optimizer, batch, root / f"round{i}"))
        shard_bytes = sum(f.stat().st_size for f in (root / "round0" / "sync").glob(f"__{rt.rank}_*.distcp"))
        rt.barrier()
    if rt.is_rank_zero:
        _report(rows[1:], params, shard_bytes, args)
    rt.teardown()


def _fmt(rows: list[dict], key: str, scale: float = 1.0, digits: int = 3) -> str:
    values = [r[key] * scale for r in rows]
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def _report(rows: list[dict], params: int, shard_bytes: int, args: argparse.Namespace) -> None:
    import torch

    ratio = [r["stall_s"] / r["sync_s"] for r in rows]
    print(f"## checkpoint stall: fsdp × 2 ranks (gloo, CPU), GPT {args.layers} layers × {args.width} "
          f"({params / 1e6:.1f}M parameters, SGD momentum), {shard_bytes / 2**20:.1f} MiB of shards per rank, "
          f"{len(rows)} rounds; torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'measure':28s} median [min–max]")
    print(f"{'sync save (s)':28s} {_fmt(rows, 'sync_s')}")
    print(f"{'async stall (s)':28s} {_fmt(rows, 'stall_s')}")
    print(f"{'stall / sync':28s} {statistics.median(ratio):.3f} [{min(ratio):.3f}–{max(ratio):.3f}]")
    print(f"{'async background write (s)':28s} {_fmt(rows, 'write_s')}")
    print(f"{'steps during the write':28s} {_fmt(rows, 'steps', digits=0)}")
    print(f"{'step, no write (ms)':28s} {_fmt(rows, 'quiet_step_s', 1e3, 1)}")
    print(f"{'step, write in flight (ms)':28s} {_fmt([r for r in rows if r['steps']] or rows, 'step_s', 1e3, 1)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model, one round (smoke test)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temporary directory)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.layers, args.width, args.rounds = 2, 64, 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HERE), "--worker",
           "--layers", str(args.layers), "--width", str(args.width), "--rounds", str(args.rounds),
           *(["--dir", args.dir] if args.dir else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
