"""2-process DDP on CPU (gloo): a plain DDP script written here against Runtime and Trainer.

    python benchmarks/ddp.py              # about 3 minutes on a quiet machine here
    python benchmarks/ddp.py --quick      # smoke run

Workload: the tutorial ConvNet (``--workload mlp`` for the MLP 784-128-10), batch 64 per rank,
synthetic data of MNIST's shape in memory, ``DistributedSampler(shuffle=True)``, AdamW lr=1e-3,
one thread per process (OMP_NUM_THREADS=1). Every launch trains ``1 + epochs`` epochs with
accumulation 1, then ``1 + epochs`` epochs with accumulation 4 (the first epoch of each is a
warm-up and is not counted).

Variants (each launch a fresh job; launches interleaved, the order rotated each round so that no
variant always runs first or after the same neighbour):
- ``plain``: ``torchrun --nproc-per-node=2`` of a hand-written DDP loop: ``init_process_group("gloo")``,
  ``DistributedDataParallel``, ``no_sync()`` on the micro-batches before each accumulation boundary,
  loss divided by the accumulation, epoch loss summed on the device.
- ``runtime``: the same loop through ``Runtime`` (torchrun as above).
- ``trainer``: ``Trainer(devices=2).fit`` started by torchrun as above (progress bar and
  checkpointing off: the same work as the loops, see overhead.py for their cost).
- ``trainer-relaunch``: the same, started as ``python ddp.py``: ``Trainer(devices=2)`` re-executes the
  script under torchrun itself (the whole-process time then includes one more Python start and
  ``import torch`` in the first process).

Numbers: epoch time = rank 0's wall time of the epoch's batch loop (the ranks wait for each other
in every all-reduce); throughput = samples of all ranks per second; whole-process time = wall time of
the launch command, start to exit. Ratios are paired per round against the same round's plain
launch, then the median and min–max over rounds. All-reduces are counted by a DDP communication
hook (``register_comm_hook``; for the Trainer through ``strategy_options={"ddp_comm_hook": ...}``)
that wraps PyTorch's own ``allreduce_hook``; the same hook is on in every variant. The model's
gradients fit one DDP bucket (25 MiB), so one all-reduce per optimizer step is one hook call per step.
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
from pathlib import Path

VARIANTS = ("plain", "runtime", "trainer", "trainer-relaunch")
BATCH = 64
ACCUMULATIONS = (1, 4)


class AllReduceCounter:
    """A DDP comm hook's state: counts bucket all-reduces, then runs PyTorch's ``allreduce_hook``."""

    def __init__(self) -> None:
        self.calls = 0


def counting_allreduce_hook(state: AllReduceCounter, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.calls += 1
    return allreduce_hook(None, bucket)  # None: the default process group


# -------------------------------------------------------------------------------------- workers
def _data(args):
    import torch
    from torch.utils.data import TensorDataset

    n = 2 * BATCH * args.steps
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def _model(args):
    import torch

    from trainscale.models import MLP, ConvNet

    torch.manual_seed(0)
    return MLP() if args.workload == "mlp" else ConvNet()


def worker_plain(args) -> dict:
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group("gloo")
    dataset = _data(args)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    model = DDP(_model(args))
    counter = AllReduceCounter()
    model.register_comm_hook(counter, counting_allreduce_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = {}
    for k in ACCUMULATIONS:
        times, steps, calls0 = [], 0, counter.calls
        for epoch in range(1 + args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            loss_sum = torch.zeros(())
            t0 = time.perf_counter()
            for i, (x, y) in enumerate(loader):
                boundary = (i + 1) % k == 0 or i + 1 == len(loader)
                with (contextlib.nullcontext() if boundary else model.no_sync()):
                    loss = F.cross_entropy(model(x), y)
                    (loss / k).backward()
                if boundary:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    steps += 1
                loss_sum += loss.detach()
            times.append(time.perf_counter() - t0)
        out[k] = {"epoch_s": times[1:], "steps": steps, "allreduces": counter.calls - calls0}
    dist.destroy_process_group()
    return out


def worker_runtime(args) -> dict:
    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader

    from trainscale import Runtime

    counter = AllReduceCounter()
    rt = Runtime(accelerator="cpu", strategy_options={"ddp_comm_hook": counting_allreduce_hook,
                                                      "ddp_comm_state": counter})
    model, optimizer = rt.setup(_model(args), lambda p: torch.optim.AdamW(p, lr=1e-3))
    loader = rt.setup_dataloader(DataLoader(_data(args), batch_size=BATCH, shuffle=True))
    out = {}
    for k in ACCUMULATIONS:
        times, steps, calls0 = [], 0, counter.calls
        for epoch in range(1 + args.epochs):
            rt.set_epoch(loader, epoch)
            model.train()
            loss_sum = torch.zeros((), device=rt.device)
            t0 = time.perf_counter()
            for i, batch in enumerate(loader):
                x, y = rt.to_device(batch)
                boundary = (i + 1) % k == 0 or i + 1 == len(loader)
                with rt.no_backward_sync(model, enabled=not boundary):
                    with rt.autocast():
                        loss = F.cross_entropy(model(x), y)
                    rt.backward(loss / k)
                if boundary:
                    rt.step(optimizer)
                    optimizer.zero_grad(set_to_none=True)
                    steps += 1
                loss_sum += loss.detach()
            times.append(time.perf_counter() - t0)
        out[k] = {"epoch_s": times[1:], "steps": steps, "allreduces": counter.calls - calls0}
    rt.teardown()
    return out


def worker_trainer(args) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from trainscale import Trainer

    counter = AllReduceCounter()
    model = _model(args)
    out = {}
    with tempfile.TemporaryDirectory() as root:
        for k in ACCUMULATIONS:
            calls0 = counter.calls
            trainer = Trainer(accelerator="cpu", devices=2, max_epochs=1 + args.epochs, accumulate_grad_batches=k,
                              default_root_dir=root, enable_progress_bar=False, enable_checkpointing=False,
                              strategy_options={"ddp_comm_hook": counting_allreduce_hook, "ddp_comm_state": counter})
            trainer.fit(model, DataLoader(_data(args), batch_size=BATCH, shuffle=True),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
            out[k] = {"epoch_s": [h["epoch_time_s"] for h in trainer.history[1:]], "steps": trainer.global_step,
                      "allreduces": counter.calls - calls0}
    trainer.runtime.teardown()
    return out


def worker_main(args) -> None:
    import torch

    torch.set_num_threads(1)
    fn = {"plain": worker_plain, "runtime": worker_runtime, "trainer": worker_trainer,
          "trainer-relaunch": worker_trainer}[args.worker]
    result = fn(args)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(result))


# --------------------------------------------------------------------------------------- driver
def _launch(variant: str, args, out: Path, log: Path) -> float:
    worker = ["--worker", variant, "--out", str(out), "--steps", str(args.steps), "--epochs", str(args.epochs),
              "--workload", args.workload]
    if variant == "trainer-relaunch":
        cmd = [sys.executable, __file__, *worker]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, *worker]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    for attempt in (1, 2):  # gloo workers rarely abort at exit ("terminate called without an active
        t0 = time.perf_counter()  # exception", shared/FACTS): such a launch is run once more, and said so
        with open(log, "a") as log_file:
            proc = subprocess.run(cmd, env=env, stdout=log_file, stderr=log_file, timeout=600)
        wall = time.perf_counter() - t0
        if proc.returncode == 0:
            return wall
        print(f"# {variant} launch {attempt} failed (exit {proc.returncode}); see {log}", file=sys.stderr)
    sys.exit(f"{variant} launch failed twice (exit {proc.returncode}); output:\n{log.read_text()[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 1 short epoch per setting")
    parser.add_argument("--rounds", type=int, default=None, help="launches per variant (default 3, quick 1)")
    parser.add_argument("--workload", choices=("convnet", "mlp"), default="convnet")
    parser.add_argument("--steps", type=int, default=None, help="micro-batches per rank per epoch (default 16)")
    parser.add_argument("--epochs", type=int, default=None, help="timed epochs per setting (default 2)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {', '.join(VARIANTS)} (plain is always run: the reference)")
    parser.add_argument("--log", default=None, help="file for the launches' output")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return

    import platform

    import torch

    variants = ["plain"] + [v for v in VARIANTS[1:] if v in args.variants.split(",")]
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    rounds = args.rounds or (1 if args.quick else 3)
    args.steps = args.steps or (4 if args.quick else 16)
    args.epochs = args.epochs or (1 if args.quick else 2)
    log = Path(args.log or Path(tempfile.gettempdir()) / f"trainscale-ddp-{os.getpid()}.log")
    log.write_text("")
    print(f"# ddp: 2 processes, gloo, torch {torch.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start, 1 thread per process"
          f"{', QUICK (smoke run, numbers not meaningful)' if args.quick else ''}")
    print(f"# workload {args.workload}, batch {BATCH} per rank, {args.steps} micro-batches per rank per epoch, "
          f"{args.epochs} timed epochs per setting, {rounds} interleaved launches per variant; log: {log}")
    t_start = time.perf_counter()
    results = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:  # rotated each round
                out = Path(tmp) / f"{v}-{r}.json"
                wall = _launch(v, args, out, log)
                results[v].append({"wall_s": wall, **json.loads(out.read_text())})

    samples = 2 * BATCH * args.steps  # per epoch, all ranks
    header = (f"{'variant':<17} {'accum':>5} {'epoch s':>8} {'epoch s min–max':>16} {'samples/s':>9} "
              f"{'thru ratio':>10} {'ratio min–max':>13} {'process s':>9} {'proc ratio':>10} "
              f"{'opt steps':>9} {'all-reduces':>11} {'per step':>8}")
    print()
    print(header)
    print("-" * len(header))
    for k in ACCUMULATIONS:
        key = str(k)
        plain_epoch = [statistics.median(run[key]["epoch_s"]) for run in results["plain"]]
        plain_wall = [run["wall_s"] for run in results["plain"]]
        for v in variants:
            epoch = [statistics.median(run[key]["epoch_s"]) for run in results[v]]
            thru_ratio = [p / e for p, e in zip(plain_epoch, epoch)]  # throughput ratio = inverse time ratio
            wall = [run["wall_s"] for run in results[v]]
            proc_ratio = [w / p for w, p in zip(wall, plain_wall)]
            steps = results[v][0][key]["steps"]
            calls = results[v][0][key]["allreduces"]
            consistent = all(run[key]["steps"] == steps and run[key]["allreduces"] == calls for run in results[v])
            print(f"{v:<17} {k:>5} {statistics.median(epoch):>8.3f} {min(epoch):>7.3f}–{max(epoch):<8.3f} "
                  f"{samples / statistics.median(epoch):>9.0f} {statistics.median(thru_ratio):>10.3f} "
                  f"{min(thru_ratio):>6.3f}–{max(thru_ratio):<6.3f} "
                  f"{statistics.median(wall):>9.2f} {statistics.median(proc_ratio):>10.3f} "
                  f"{steps:>9} {calls:>11} {calls / steps:>8.2f}{'' if consistent else ' (differs between launches!)'}")
    print("\n# opt steps and all-reduces: rank 0, all epochs of the setting incl. warm-up, first launch; "
          "'per step' = all-reduces / optimizer steps (1.00 = exactly one per step)")
    print(f"# total {time.perf_counter() - t_start:.0f} s; load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
