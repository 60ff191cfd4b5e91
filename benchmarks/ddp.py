"""2-process DDP on CPU (gloo): a plain DDP script written here against Runtime and Trainer.

    python benchmarks/ddp.py              # 4-5 minutes here (the VM's speed varies)
    python benchmarks/ddp.py --quick      # smoke run

Workload: the tutorial ConvNet (``--workload mlp`` for the MLP 784-128-10), batch 64 per rank,
synthetic data of MNIST's shape in memory, ``DistributedSampler(shuffle=True)``, AdamW lr=1e-3,
one thread per process (OMP_NUM_THREADS=1), accumulation 1 and 4.

Variants:
- ``plain``: a hand-written DDP loop (``plain_ddp_steps``): ``init_process_group("gloo")``,
  ``DistributedDataParallel``, ``no_sync()`` on the micro-batches before each accumulation boundary,
  loss divided by the accumulation, epoch loss summed on the device.
- ``plain-2`` (throughput only): a second, identical plain loop: an A/A control, whose ratio shows
  what the instrument reads for no difference at all.
- ``runtime``: the same loop through ``Runtime``.
- ``trainer``: ``Trainer(devices=2).fit`` (progress bar and checkpointing off, telemetry on: the
  same work as the loops; see overhead.py for their cost).
- ``trainer-relaunch`` (whole-process time only): the same, started as ``python ddp.py``:
  ``Trainer(devices=2)`` re-executes the script under torchrun itself.

Throughput, one torchrun launch: every rank builds plain, plain-2, runtime and trainer side by side and
runs one epoch of each per round, in an order rotated each round, after a warm-up round (none with
``--quick``), for accumulation 1 then 4. Every variant builds its model, optimizer and data afresh for each epoch (the
Trainer: a fresh ``Trainer(max_epochs=1)``): with objects kept for the whole run, each loop
keeps one memory layout for all rounds, and two identical plain loops read
1.7 % and 2.8 % apart with 95 % intervals that excluded 1 (36 rounds). Step-interleaved
timing (``StepClock``): after each optimizer step of a variant, both ranks run one optimizer step
of a shared reference, the plain DDP loop on its own model, data and process group. A variant's
step = rank 0's time between two such hooks (steps 2..n of each epoch: the first makes the
DataLoader iterator); "vs ref" = the median over all its timed steps of (its step / the reference
step right after it); the throughput ratio = plain's "vs ref" over the variant's: each variant
against plain DDP, both measured against the same reference in the same processes, so that the
machine's drift (up to 2× over tens of milliseconds on this VM) and differences between launches
cancel. The 95 % interval resamples rounds (bootstrap). Launch-to-launch spread (±3 %, measured in
an earlier version that launched each variant separately) no longer enters the ratio.

Whole-process time: each variant launched on its own (``launches`` times, order rotated), ``1 +
epochs`` epochs at each accumulation without a reference; wall time of the launch command, start
to exit, against plain's launch of the same round.

All-reduces are counted by a DDP communication hook (``register_comm_hook``; for the Trainer
through ``strategy_options={"ddp_comm_hook": ...}``) that wraps PyTorch's own ``allreduce_hook``,
on in every variant (not on the reference); optimizer steps by a step post-hook. The model's
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


class Reference:
    """The plain DDP loop (``plain_ddp_steps``) on its own model, data and process group
    (``dist.new_group``, so its all-reduces never mix with the variants'), advanced one optimizer
    step at a time by the variants' clocks. One reference per launch, shared by every variant."""

    def __init__(self, args) -> None:
        self.args = args
        self.group = None
        self.steps = None
        self.k = 1

    def set_accumulation(self, k: int) -> None:
        self.close()
        self.k = k

    def step(self) -> None:
        if self.steps is None:
            import torch.distributed as dist

            if self.group is None:  # collective: every rank's first step comes at the same point
                self.group = dist.new_group(backend="gloo")
            self.steps = plain_ddp_steps(*_plain_ddp_parts(self.args, self.group), self.k)
        next(self.steps)

    def close(self) -> None:
        """Free the reference's DDP model while its process group still exists."""
        if self.steps is not None:
            self.steps.close()
            self.steps = None
            import gc

            gc.collect()


class StepClock:
    """Step-interleaved timing of one variant: an optimizer step post-hook runs one reference step
    after each optimizer step of the variant and times both. The variant's step = the gap between
    hooks (everything the variant does from one optimizer step to the next); the reference's = the
    hook's reference step. Both run within milliseconds of each other on the same cores, so the
    machine's drift (up to 2× over tens of milliseconds on this VM) cancels in their ratio."""

    def __init__(self, reference: Reference) -> None:
        self.reference = reference
        self.enter: list[float] = []  # hook entries: the end of each variant step
        self.ref: list[float] = []  # reference step durations
        self.exit: list[float] = []  # hook exits: the start of the next variant step
        self.cpu_enter: list[float] = []  # process CPU time (all threads) at the same points
        self.cpu_ref: list[float] = []
        self.cpu_exit: list[float] = []

    def attach(self, optimizer):
        optimizer.register_step_post_hook(self._hook)
        return optimizer

    def _hook(self, optimizer, args, kwargs) -> None:
        c0 = time.process_time()
        t0 = time.perf_counter()
        self.reference.step()
        t1 = time.perf_counter()
        c1 = time.process_time()
        self.enter.append(t0)
        self.ref.append(t1 - t0)
        self.cpu_enter.append(c0)
        self.cpu_ref.append(c1 - c0)
        self.cpu_exit.append(time.process_time())
        self.exit.append(time.perf_counter())

    def take(self) -> tuple[list[float], list[float], list[float], list[float]]:
        """Steps 2..n of the epoch since the last call (the first makes the DataLoader iterator), paired
        by index: (variant wall s, reference wall s, variant CPU s, reference CPU s)."""
        variant = [b - a for a, b in zip(self.exit, self.enter[1:])]
        ref = self.ref[1:]
        cpu = [b - a for a, b in zip(self.cpu_exit, self.cpu_enter[1:])]
        cpu_ref = self.cpu_ref[1:]
        if not variant:
            raise SystemExit("no timed step: give at least 2 optimizer steps per epoch (--steps >= 8)")
        self.enter, self.ref, self.exit, self.cpu_enter, self.cpu_ref, self.cpu_exit = [], [], [], [], [], []
        return variant, ref, cpu, cpu_ref


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


class Counters:
    """All-reduces (a DDP comm hook's state) and optimizer steps (a step post-hook) of one variant."""

    def __init__(self) -> None:
        self.allreduces = AllReduceCounter()
        self.steps = 0

    def attach(self, optimizer):
        optimizer.register_step_post_hook(self._count)
        return optimizer

    def _count(self, optimizer, args, kwargs) -> None:
        self.steps += 1

    def snapshot(self) -> tuple[int, int]:
        return self.steps, self.allreduces.calls


def _ddp_options(counters: Counters) -> dict:
    return {"ddp_comm_hook": counting_allreduce_hook, "ddp_comm_state": counters.allreduces}


class PlainVariant:
    """The plain DDP loop on the default process group. Each ``epoch`` builds its model, optimizer and
    data afresh, as the Trainer variant's fresh ``fit`` does (see ``worker_interleaved``)."""

    def __init__(self, args, counters: Counters, clock: StepClock | None) -> None:
        self.args, self.counters, self.clock = args, counters, clock

    def epoch(self, k: int) -> None:
        model, optimizer, loader, sampler = _plain_ddp_parts(self.args)
        model.register_comm_hook(self.counters.allreduces, counting_allreduce_hook)
        self.counters.attach(optimizer)
        if self.clock is not None:
            self.clock.attach(optimizer)
        steps = plain_ddp_steps(model, optimizer, loader, sampler, k)
        for _ in range(-(-len(loader) // k)):  # optimizer steps per epoch (a short last group counts)
            next(steps)


class RuntimeVariant:
    """The same loop through ``Runtime`` (setup, setup_dataloader, set_epoch, to_device,
    no_backward_sync, autocast, backward, step)."""

    def __init__(self, args, counters: Counters, clock: StepClock | None) -> None:
        from trainscale import Runtime

        self.args, self.counters, self.clock = args, counters, clock
        self.rt = Runtime(accelerator="cpu", strategy_options=_ddp_options(counters))

    def epoch(self, k: int) -> None:
        import torch
        from torch.nn import functional as F
        from torch.utils.data import DataLoader

        def build(params):
            optimizer = self.counters.attach(torch.optim.AdamW(params, lr=1e-3))
            return self.clock.attach(optimizer) if self.clock is not None else optimizer

        rt = self.rt  # model, optimizer and data built afresh each epoch, as in the other variants
        model, optimizer = rt.setup(_model(self.args), build)
        loader = rt.setup_dataloader(DataLoader(_data(self.args), batch_size=BATCH, shuffle=True))
        rt.set_epoch(loader, 0)
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


class TrainerVariant:
    """``Trainer(devices=2).fit``, progress bar and checkpointing off (telemetry on, as by default).
    Interleaved: a fresh ``Trainer(max_epochs=1)`` and model per epoch; per launch: one fit per setting."""

    def __init__(self, args, counters: Counters, clock: StepClock | None, root: str) -> None:
        self.args, self.counters, self.clock, self.root = args, counters, clock, root
        self.trainer = None

    def fit(self, k: int, epochs: int) -> None:
        import torch
        from torch.utils.data import DataLoader

        from trainscale import Trainer

        def build(params):
            optimizer = self.counters.attach(torch.optim.AdamW(params, lr=1e-3))
            return self.clock.attach(optimizer) if self.clock is not None else optimizer

        self.trainer = Trainer(accelerator="cpu", devices=2, max_epochs=epochs, accumulate_grad_batches=k,
                               default_root_dir=self.root, enable_progress_bar=False, enable_checkpointing=False,
                               strategy_options=_ddp_options(self.counters))
        self.trainer.fit(_model(self.args), DataLoader(_data(self.args), batch_size=BATCH, shuffle=True),
                         optimizer=build)

    def epoch(self, k: int) -> None:
        self.fit(k, 1)


def worker_interleaved(args) -> None:
    """Every variant in one launch, epoch by epoch, the order rotated each round; each optimizer step
    of a variant is followed by one of the shared reference. The first ``args.warmup_rounds`` rounds of each setting
    warm up (not timed)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")  # the plain script's; Runtime and Trainer use the group they find
    reference = Reference(args)
    names = ["plain", "plain-2"] + [v for v in ("runtime", "trainer") if v in args.variants.split(",")]
    counters = {name: Counters() for name in names}
    clocks = {name: StepClock(reference) for name in names}
    out = {}
    with tempfile.TemporaryDirectory() as root:
        builders = {"plain": lambda: PlainVariant(args, counters["plain"], clocks["plain"]),
                    "plain-2": lambda: PlainVariant(args, counters["plain-2"], clocks["plain-2"]),  # A/A control
                    "runtime": lambda: RuntimeVariant(args, counters["runtime"], clocks["runtime"]),
                    "trainer": lambda: TrainerVariant(args, counters["trainer"], clocks["trainer"], root)}
        variants = {name: builders[name]() for name in names}
        for k in ACCUMULATIONS:
            reference.set_accumulation(k)
            res = {name: {"step_s": [], "ref_s": [], "cpu_s": [], "cpu_ref_s": [], "steps": 0, "allreduces": 0}
                   for name in names}
            for r in range(args.warmup_rounds + args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:  # rotated: no variant always first
                    steps0, calls0 = counters[name].snapshot()
                    variants[name].epoch(k)
                    step_s, ref_s, cpu_s, cpu_ref_s = clocks[name].take()
                    steps1, calls1 = counters[name].snapshot()
                    res[name]["steps"] += steps1 - steps0
                    res[name]["allreduces"] += calls1 - calls0
                    if r >= args.warmup_rounds:
                        res[name]["step_s"].append(step_s)  # per round: the timed steps, in order
                        res[name]["ref_s"].append(ref_s)
                        res[name]["cpu_s"].append(cpu_s)
                        res[name]["cpu_ref_s"].append(cpu_ref_s)
            out[k] = res
        if int(os.environ["RANK"]) == 0:
            Path(args.out).write_text(json.dumps(out))
        dist.barrier()
    os._exit(0)  # skip interpreter teardown: many DDP models and gloo groups, nothing left to save


def worker_launch(args) -> dict:
    """One variant per launch, for whole-process time: ``1 + epochs`` epochs at each accumulation."""
    counters = Counters()
    out = {}
    with tempfile.TemporaryDirectory() as root:
        if args.worker == "plain":
            import torch.distributed as dist

            dist.init_process_group("gloo")
            variant = PlainVariant(args, counters, None)
        elif args.worker == "runtime":
            variant = RuntimeVariant(args, counters, None)
        else:
            variant = TrainerVariant(args, counters, None, root)
        for k in ACCUMULATIONS:
            steps0, calls0 = counters.snapshot()
            if isinstance(variant, TrainerVariant):
                variant.fit(k, 1 + args.epochs)
            else:
                for _ in range(1 + args.epochs):
                    variant.epoch(k)
            steps1, calls1 = counters.snapshot()
            out[k] = {"steps": steps1 - steps0, "allreduces": calls1 - calls0}
        if args.worker == "plain":
            import gc

            del variant  # DDP freed before its process group: freed after it, teardown can deadlock
            gc.collect()
            dist.destroy_process_group()
        elif args.worker == "runtime":
            variant.rt.teardown()
        else:
            variant.trainer.runtime.teardown()
    return out


def worker_main(args) -> None:
    import torch

    torch.set_num_threads(1)
    if args.worker == "interleaved":
        worker_interleaved(args)
        return
    result = worker_launch(args)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(result))


# --------------------------------------------------------------------------------------- driver
def _launch(variant: str, args, out: Path, log: Path) -> float:
    worker = ["--worker", variant, "--out", str(out), "--steps", str(args.steps), "--epochs", str(args.epochs),
              "--rounds", str(args.rounds), "--warmup-rounds", str(args.warmup_rounds), "--workload", args.workload,
              "--variants", args.variants]
    if variant == "trainer-relaunch":
        cmd = [sys.executable, __file__, *worker]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, *worker]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    for attempt in (1, 2):  # a gloo worker rarely aborts at exit ("terminate called without an active exception",
        t0 = time.perf_counter()  # pytorch/pytorch#190489): such a launch is run once more, and said so
        with open(log, "a") as log_file:
            proc = subprocess.run(cmd, env=env, stdout=log_file, stderr=log_file, timeout=600)
        wall = time.perf_counter() - t0
        if proc.returncode == 0:
            return wall
        print(f"# {variant} launch {attempt} failed (exit {proc.returncode}); see {log}", file=sys.stderr)
    sys.exit(f"{variant} launch failed twice (exit {proc.returncode}); output:\n{log.read_text()[-4000:]}")


BOOTSTRAP = 2000


def paired_median(res: dict, rounds: list[int] | None = None, cpu: bool = False) -> float:
    """Median over timed steps of (variant step / the reference step that followed it), over ``rounds``
    (indices, repeats allowed; default all); wall time, or process CPU time with ``cpu``. Fabric's
    DDP parity test compares median step times too."""
    steps, ref = (res["cpu_s"], res["cpu_ref_s"]) if cpu else (res["step_s"], res["ref_s"])
    rounds = range(len(steps)) if rounds is None else rounds
    return statistics.median(t / r for i in rounds for t, r in zip(steps[i], ref[i]))


def bootstrap_ratio(plain: dict, variant: dict, cpu: bool = False) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of ``paired_median(plain) / paired_median(variant)``: rounds
    resampled with replacement, the same rounds for both (a round's variants ran side by side)."""
    import random

    rng = random.Random(0)
    n = len(plain["step_s"])
    ratios = []
    for _ in range(BOOTSTRAP):
        rounds = [rng.randrange(n) for _ in range(n)]
        ratios.append(paired_median(plain, rounds, cpu) / paired_median(variant, rounds, cpu))
    ratios.sort()
    return ratios[int(0.025 * BOOTSTRAP)], ratios[int(0.975 * BOOTSTRAP) - 1]


def _per_step(steps: int, allreduces: int) -> str:
    return f"{steps:>9} {allreduces:>11} {allreduces / steps if steps else float('nan'):>8.2f}"


def _print_process_table(variants: list[str], walls: dict, counts: dict, launches: int, epochs: int) -> None:
    print(f"\n## Whole-process time: {launches} launch(es) per variant, each 1 + {epochs} epochs at accumulation "
          f"{' then '.join(map(str, ACCUMULATIONS))}, no reference")
    header = (f"{'variant':<17} {'process s':>9} {'min–max':>13} {'proc ratio':>10} "
              + " ".join(f"{'steps/all-reduces (acc ' + str(k) + ')':>26}" for k in ACCUMULATIONS))
    print(header)
    print("-" * len(header))
    for v in variants:
        ratios = [w / p for w, p in zip(walls[v], walls["plain"])]
        first = counts[v][0]
        consistent = all(c == first for c in counts[v])
        cells = " ".join(f"{first[str(k)]['steps']:>12}/{first[str(k)]['allreduces']:<13}" for k in ACCUMULATIONS)
        print(f"{v:<17} {statistics.median(walls[v]):>9.2f} {min(walls[v]):>6.2f}–{max(walls[v]):<6.2f} "
              f"{statistics.median(ratios):>10.3f} {cells}{'' if consistent else ' (differs between launches!)'}")
    print("\n# process s: wall time of the launch command, start to exit (trainer-relaunch: `python ddp.py`, which"
          "\n# re-executes itself under torchrun); proc ratio: over plain's launch of the same round")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 round and no warm-up round, short epochs, 1 launch per variant")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds per accumulation after a warm-up round (default 16, quick 1)")
    parser.add_argument("--launches", type=int, default=None,
                        help="launches per variant for whole-process time (default 1; 0: skip)")
    parser.add_argument("--no-throughput", action="store_true",
                        help="skip the interleaved throughput launch (only the whole-process launches)")
    parser.add_argument("--workload", choices=("convnet", "mlp"), default="convnet")
    parser.add_argument("--steps", type=int, default=None, help="micro-batches per rank per epoch (default 16)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs per accumulation after a warm-up epoch, in each process-time launch (default 1)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {', '.join(VARIANTS)} (plain is always run: the reference)")
    parser.add_argument("--launch-variants", default=None,
                        help="the variants launched for whole-process time, if not those of --variants")
    parser.add_argument("--log", default=None, help="file for the launches' output")
    parser.add_argument("--worker", choices=("interleaved", *VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--warmup-rounds", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return

    import platform
    from importlib.metadata import version  # not `import torch`: only its workers need it

    launch_variants = args.launch_variants or args.variants
    unknown = (set(args.variants.split(",")) | set(launch_variants.split(","))) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    variants = ["plain"] + [v for v in VARIANTS[1:] if v in launch_variants.split(",")]  # launched
    interleaved = ["plain", "plain-2"] + [v for v in ("runtime", "trainer") if v in args.variants.split(",")]
    args.rounds = args.rounds or (1 if args.quick else 16)  # 10 rounds: one run read 0.952 [0.939–0.972], the next 36 1.001
    args.warmup_rounds = 0 if args.quick else 1  # a smoke run's numbers are not read: no warm-up round
    launches = args.launches if args.launches is not None else 1
    args.steps = args.steps or (8 if args.quick else 16)
    if args.steps < 8:
        parser.error("--steps must be >= 8 (2 optimizer steps per epoch at accumulation 4)")
    args.epochs = args.epochs or 1
    log = Path(args.log or Path(tempfile.gettempdir()) / f"trainscale-ddp-{os.getpid()}.log")
    log.write_text("")
    print(f"# ddp: 2 processes, gloo, torch {version('torch')}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start, 1 thread per process"
          f"{', QUICK (smoke run, numbers not meaningful)' if args.quick else ''}")
    print(f"# workload {args.workload}, batch {BATCH} per rank, {args.steps} micro-batches per rank per epoch; log: {log}")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "interleaved.json"
        if not args.no_throughput:
            wall_interleaved = _launch("interleaved", args, out, log)
            inter = json.loads(out.read_text())
        walls = {v: [] for v in variants}
        counts = {}
        for r in range(launches):
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:  # rotated each round
                out = Path(tmp) / f"{v}-{r}.json"
                walls[v].append(_launch(v, args, out, log))
                counts.setdefault(v, []).append(json.loads(out.read_text()))

    if not args.no_throughput:
        print(f"\n## Throughput: one launch, {', '.join(interleaved)} epoch by epoch in rotated order, "
              f"{args.rounds} rounds per accumulation after {args.warmup_rounds} warm-up round(s) "
              f"({wall_interleaved:.0f} s)")
        header = (f"{'variant':<17} {'accum':>5} {'step ms':>8} {'timed':>6} {'vs ref':>6} {'samples/s':>9} "
                  f"{'thru ratio':>10} {'95 % interval':>13} {'CPU ratio':>9} {'95 % interval':>13} "
                  f"{'opt steps':>9} {'all-reduces':>11} {'per step':>8}")
        print(header)
        print("-" * len(header))
        for k in ACCUMULATIONS:
            res = inter[str(k)]
            plain = res["plain"]
            for v in interleaved:
                steps = [t for rnd in res[v]["step_s"] for t in rnd]
                vs_ref = paired_median(res[v])
                ratio = paired_median(plain) / vs_ref  # throughput = inverse step time
                low, high = bootstrap_ratio(plain, res[v])
                cpu_ratio = paired_median(plain, cpu=True) / paired_median(res[v], cpu=True)
                cpu_low, cpu_high = bootstrap_ratio(plain, res[v], cpu=True)
                print(f"{v:<17} {k:>5} {statistics.median(steps) * 1e3:>8.1f} {len(steps):>6} {vs_ref:>6.3f} "
                      f"{2 * BATCH * k / statistics.median(steps):>9.0f} {ratio:>10.3f} {low:>6.3f}–{high:<6.3f} "
                      f"{cpu_ratio:>9.3f} {cpu_low:>6.3f}–{cpu_high:<6.3f} "
                      f"{_per_step(res[v]['steps'], res[v]['allreduces'])}")
        print("\n# step ms: rank 0's median optimizer step (steps 2..n of each epoch; timed: how many, all rounds);"
              "\n# plain-2: a second, identical plain loop (A/A control: its ratio is the instrument's error);"
              "\n# vs ref: median over those steps of (step / the reference step right after it); thru ratio: plain's"
              "\n# 'vs ref' over the variant's (throughput against plain DDP, both measured against the same reference);"
              f"\n# 95 % interval: of the ratio, {BOOTSTRAP} bootstrap resamples of the rounds (percentiles 2.5, 97.5);"
              "\n# CPU ratio: the same with rank 0's process CPU time (all threads) instead of wall time: work, not waiting;"
              "\n# opt steps, all-reduces: rank 0, all rounds incl. warm-up; per step 1.00 = exactly one per optimizer step")

    if launches:
        _print_process_table(variants, walls, counts, launches, args.epochs)
    print(f"# total {time.perf_counter() - t_start:.0f} s; load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
