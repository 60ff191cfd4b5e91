"""2-process DDP on CPU (gloo): a plain DDP script written here against Runtime and Trainer.

    python benchmarks/ddp.py              # about 4 minutes on a quiet machine here
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

Timing, step-interleaved (see ``ReferenceClock``): in every launch, after each optimizer step of
the variant, both ranks run one optimizer step of a reference, the plain DDP loop on its own
model, data and process group. A variant step = rank 0's time between those hooks; "vs ref" =
the variant's mean step over the mean of the reference steps interleaved with it (warm-up epoch
and the first step of each epoch left out); the throughput ratio = plain's "vs ref" over the
variant's, same round, i.e. the variant against plain DDP, both measured against the same
reference, so that the machine's drift (up to 2× over tens of milliseconds on this VM) cancels.
Whole-process time = wall time of the launch command, start to exit (it includes the reference's
steps, the same work in every variant). Median and min–max over launches. All-reduces are counted
by a DDP communication hook (``register_comm_hook``; for the Trainer through
``strategy_options={"ddp_comm_hook": ...}``) that wraps PyTorch's own ``allreduce_hook``; the same
hook is on in every variant (not on the reference). The model's gradients fit one DDP bucket
(25 MiB), so one all-reduce per optimizer step is one hook call per step.
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


class ReferenceClock:
    """Step-interleaved timing: after each optimizer step of the measured variant (a step post-hook),
    every rank runs one optimizer step of the reference, a plain DDP loop on its own model, data
    and process group (``dist.new_group``, so its all-reduces never mix with the variant's). The
    variant's step = the gap between hooks; the reference's = the hook's ``next()``. Both run
    within milliseconds of each other on the same cores, so the machine's drift cancels in their
    ratio. Excluded from both: the warm-up epoch and the first step of every epoch (DataLoader
    iterator creation, the variant's epoch-end work)."""

    def __init__(self, args) -> None:
        self.args = args
        self.group = None
        self.reference = None
        self.k = 1
        self.enter: list[float] = []
        self.ref: list[float] = []
        self.exit: list[float] = []

    def attach(self, optimizer):
        optimizer.register_step_post_hook(self._hook)
        return optimizer

    def begin(self, k: int) -> None:
        """A new setting (accumulation ``k``): a fresh reference loop with the same accumulation."""
        self.close()
        self.k = k
        self.enter, self.ref, self.exit = [], [], []

    def _hook(self, optimizer, args, kwargs) -> None:
        t0 = time.perf_counter()
        if self.reference is None:
            self.reference = self._reference_steps(self.k)
        next(self.reference)
        t1 = time.perf_counter()
        self.enter.append(t0)
        self.ref.append(t1 - t0)
        self.exit.append(time.perf_counter())

    def _reference_steps(self, k: int):
        """The plain DDP loop (``plain_ddp_steps``) on its own model, data and process group."""
        import torch.distributed as dist

        if self.group is None:  # collective: every rank's first hook runs at the same optimizer step
            self.group = dist.new_group(backend="gloo")
        yield from plain_ddp_steps(*_plain_ddp_parts(self.args, self.group), k)

    def close(self) -> None:
        """Free the reference's DDP model while its process group still exists."""
        if self.reference is not None:
            self.reference.close()
            self.reference = None
            import gc

            gc.collect()

    def result(self) -> dict:
        """Mean variant and reference step (s) over the timed epochs, first steps of epochs left out."""
        per_epoch = -(-self.args.steps // self.k)  # optimizer steps per epoch (a short last group counts)
        keep = [j for j in range(per_epoch, len(self.enter)) if j % per_epoch]  # not warm-up, not first
        variant = [self.enter[j] - self.exit[j - 1] for j in keep]
        ref = [self.ref[j] for j in keep]
        if not keep:
            raise SystemExit(f"no timed step: give at least 2 optimizer steps per epoch (--steps >= {2 * self.k}) "
                             "and --epochs >= 1")
        return {"step_s": statistics.fmean(variant), "ref_s": statistics.fmean(ref), "timed_steps": len(keep),
                "steps": len(self.enter)}  # optimizer steps of the variant, warm-up included


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


def _plain_ddp_parts(args, process_group=None):
    """(DDP model, AdamW, DataLoader, DistributedSampler) of the plain loop, on ``process_group``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = _data(args)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    model = DDP(_model(args), process_group=process_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, DataLoader(dataset, batch_size=BATCH, sampler=sampler), sampler


def plain_ddp_steps(model, optimizer, loader, sampler, k: int):
    """A hand-written DDP loop with accumulation ``k`` (``no_sync()`` on the micro-batches before each
    boundary, loss divided by ``k``), one optimizer step per ``next()``, epoch after epoch from epoch 0."""
    import contextlib

    import torch
    from torch.nn import functional as F

    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(())
        for i, (x, y) in enumerate(loader):
            boundary = (i + 1) % k == 0 or i + 1 == len(loader)
            with (contextlib.nullcontext() if boundary else model.no_sync()):
                loss = F.cross_entropy(model(x), y)
                (loss / k).backward()
            loss_sum += loss.detach()
            if boundary:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                yield
        epoch += 1


def worker_plain(args) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model, optimizer, loader, sampler = _plain_ddp_parts(args)
    counter = AllReduceCounter()
    model.register_comm_hook(counter, counting_allreduce_hook)
    clock = ReferenceClock(args)
    clock.attach(optimizer)
    out = {}
    for k in ACCUMULATIONS:
        clock.begin(k)
        calls0 = counter.calls
        steps = plain_ddp_steps(model, optimizer, loader, sampler, k)
        for _ in range((1 + args.epochs) * -(-len(loader) // k)):
            next(steps)
        out[k] = {"allreduces": counter.calls - calls0, **clock.result()}
    clock.close()
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
    clock = ReferenceClock(args)
    model, optimizer = rt.setup(_model(args), lambda p: clock.attach(torch.optim.AdamW(p, lr=1e-3)))
    loader = rt.setup_dataloader(DataLoader(_data(args), batch_size=BATCH, shuffle=True))
    out = {}
    for k in ACCUMULATIONS:
        clock.begin(k)
        calls0 = counter.calls
        for epoch in range(1 + args.epochs):
            rt.set_epoch(loader, epoch)
            model.train()
            loss_sum = torch.zeros((), device=rt.device)
            for i, batch in enumerate(loader):
                x, y = rt.to_device(batch)
                boundary = (i + 1) % k == 0 or i + 1 == len(loader)
                with rt.no_backward_sync(model, enabled=not boundary):
                    with rt.autocast():
                        loss = F.cross_entropy(model(x), y)
                    rt.backward(loss / k)
                loss_sum += loss.detach()
                if boundary:
                    rt.step(optimizer)
                    optimizer.zero_grad(set_to_none=True)
        out[k] = {"allreduces": counter.calls - calls0, **clock.result()}
    clock.close()
    rt.teardown()
    return out


def worker_trainer(args) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from trainscale import Trainer

    counter = AllReduceCounter()
    clock = ReferenceClock(args)
    model = _model(args)
    out = {}
    with tempfile.TemporaryDirectory() as root:
        for k in ACCUMULATIONS:
            clock.begin(k)
            calls0 = counter.calls
            trainer = Trainer(accelerator="cpu", devices=2, max_epochs=1 + args.epochs, accumulate_grad_batches=k,
                              default_root_dir=root, enable_progress_bar=False, enable_checkpointing=False,
                              strategy_options={"ddp_comm_hook": counting_allreduce_hook, "ddp_comm_state": counter})
            trainer.fit(model, DataLoader(_data(args), batch_size=BATCH, shuffle=True),
                        optimizer=lambda p: clock.attach(torch.optim.AdamW(p, lr=1e-3)))
            out[k] = {"allreduces": counter.calls - calls0, **clock.result()}
    clock.close()
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
    parser.add_argument("--steps", type=int, default=None, help="micro-batches per rank per epoch (default 24)")
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
    args.steps = args.steps or (8 if args.quick else 24)  # >= 2 optimizer steps per epoch at accumulation 4
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

    header = (f"{'variant':<17} {'accum':>5} {'step ms':>8} {'step ms min–max':>16} {'vs ref':>6} {'samples/s':>9} "
              f"{'thru ratio':>10} {'ratio min–max':>13} {'process s':>9} {'proc ratio':>10} "
              f"{'opt steps':>9} {'all-reduces':>11} {'per step':>8}")
    print()
    print(header)
    print("-" * len(header))
    for k in ACCUMULATIONS:
        key = str(k)
        plain_vs_ref = [run[key]["step_s"] / run[key]["ref_s"] for run in results["plain"]]
        plain_wall = [run["wall_s"] for run in results["plain"]]
        for v in variants:
            step = [run[key]["step_s"] for run in results[v]]
            vs_ref = [run[key]["step_s"] / run[key]["ref_s"] for run in results[v]]
            thru_ratio = [p / x for p, x in zip(plain_vs_ref, vs_ref)]  # throughput = inverse step time
            wall = [run["wall_s"] for run in results[v]]
            proc_ratio = [w / p for w, p in zip(wall, plain_wall)]
            steps = results[v][0][key]["steps"]
            calls = results[v][0][key]["allreduces"]
            consistent = all(run[key]["steps"] == steps and run[key]["allreduces"] == calls for run in results[v])
            samples_per_s = 2 * BATCH * k / statistics.median(step)
            print(f"{v:<17} {k:>5} {statistics.median(step) * 1e3:>8.1f} "
                  f"{min(step) * 1e3:>7.1f}–{max(step) * 1e3:<8.1f} {statistics.median(vs_ref):>6.3f} "
                  f"{samples_per_s:>9.0f} {statistics.median(thru_ratio):>10.3f} "
                  f"{min(thru_ratio):>6.3f}–{max(thru_ratio):<6.3f} "
                  f"{statistics.median(wall):>9.2f} {statistics.median(proc_ratio):>10.3f} "
                  f"{steps:>9} {calls:>11} {calls / steps:>8.2f}{'' if consistent else ' (differs between launches!)'}")
    print(f"\n# step ms: rank 0's mean optimizer step ({'/'.join(str(results['plain'][0][str(k)]['timed_steps']) for k in ACCUMULATIONS)} "
          "timed steps per launch for accumulation " + "/".join(map(str, ACCUMULATIONS)) + "), median and min–max over launches;"
          "\n# vs ref: over the reference steps interleaved with it; thru ratio: plain's 'vs ref' over the variant's,"
          "\n# same round (throughput against plain DDP, both measured against the same reference); process s includes"
          "\n# the reference's steps (the same work in every variant)")
    print("\n# opt steps and all-reduces: rank 0, all epochs of the setting incl. warm-up, first launch; "
          "'per step' = all-reduces / optimizer steps (1.00 = exactly one per step)")
    print(f"# total {time.perf_counter() - t_start:.0f} s; load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
