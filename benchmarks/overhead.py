"""What trainscale costs per step, against a plain PyTorch loop written here, on one process.

    python benchmarks/overhead.py             # both workloads, 3-5 minutes here (the VM's speed varies)
    python benchmarks/overhead.py --quick     # smoke run (a few seconds of training per workload)
    python benchmarks/overhead.py --workloads tiny   # microseconds per step, ~1 min

Workloads (synthetic data of MNIST's shape held in memory, a DataLoader with shuffle=True and no
workers, AdamW lr=1e-3, one thread per process):
- ``mlp``: MLP 784-128-10, batch 64, 51 steps per epoch. Each step is tiny, so per-step framework
  overhead dominates. 51, not 50: the Trainer's default step record and non-finite/signal check
  (``log_every_n_steps=50``) then fall between two timed steps of every epoch, so they are paid at
  the rate a long run pays them (at step 50 of a 50-step epoch they would follow the last timed step).
- ``convnet``: the tutorial ConvNet on 1×28×28, batch 100.
- ``tiny`` (not in the default run: ``--workloads tiny``): logistic regression 784→10, batch 8, 201
  steps per epoch. A step is ~0.35 ms here, most of it Python (DataLoader, autograd, optimizer
  calls), so a variant's extra microseconds per step are resolved to ~1 µs: the instrument for
  cutting the hot path. The "µs/step over plain" column gives them for every workload.

Variants, all built from the same seed, each with its own model, optimizer and DataLoader:
- ``plain``: a hand-written loop (``plain_steps``): batch ``.to(device)``, forward, cross-entropy,
  ``backward``, ``step``, ``zero_grad(set_to_none=True)``, epoch loss summed on the device (no host
  sync). Timed like the others against the reference, which runs the same loop: an A/A control.
- ``runtime``: the same loop through ``Runtime`` (setup, setup_dataloader, set_epoch, to_device,
  no_backward_sync, autocast, backward, step), as in the Runtime docstring.
- ``trainer``: ``Trainer.fit`` with its defaults: progress bar on (written to this process's stderr,
  which the driver sends to a log file), telemetry on (on a CPU without FLOP counting, see
  ``count_flops``), a JSONL/CSV step record every 50 steps, a checkpoint at each epoch end.
- ``trainer-lean``: the defaults with telemetry and progress bar off
  (``enable_telemetry=False, enable_progress_bar=False``).
- ``trainer-flops``: the defaults plus ``count_flops=True`` (FLOPs of the first micro-batch counted
  under ``FlopCounterMode``, as on a GPU by default): what counting FLOPs costs.

Timing, step-interleaved: the reference is the plain loop, written as a generator that runs one
step per ``next()`` on its own model, optimizer and DataLoader. An optimizer step post-hook on the
measured variant's optimizer (``PairClock``) runs one reference step after each of the variant's
steps, so variant and reference steps alternate every few milliseconds and share the machine's
state (this VM's speed drifts by up to 2× over tens of milliseconds, which epoch-by-epoch A/B
rounds could not cancel). A variant's step = from the end of the reference step in one hook to
the start of the next hook (zero_grad, loss bookkeeping, progress bar, fetching and moving the
next batch, forward, backward, step); the reference's step = the time of its ``next()``. The
first step of each epoch (DataLoader iterator creation) is left out of both. Each round runs one
epoch of every variant (in an order rotated each round) and gives each variant "vs ref": its mean
step over the mean of the reference steps interleaved with it. ``plain`` measured this way reads
~0.97, not 1.00 (a reference step run inside another loop's optimizer step is ~3 % slower here,
whatever that loop is; the cause was not found), so the reported *ratio* divides each variant's
"vs ref" by plain's of the same round: each variant against the plain loop, both measured by the
same instrument, the machine's drift cancelled by the reference. Two ratios are reported: from
each round's *mean* steps (what an epoch costs: the step that writes the step-50 record and runs
the non-finite/signal check is in it) and from its *median* steps (the "median step time",
as Fabric's parity test measures it: the typical step, which leaves that one-in-50 step out). The timing runs in
``PROCESSES`` (3) fresh processes one after the other, whose rounds are pooled: one process's
rounds share its memory layout and warm-up, and single-process runs of identical code gave Trainer
ratios from 1.035 to 1.054. Reported: medians and min–max over rounds, the IQR of the rounds'
ratios and a 95 % bootstrap interval of their median. Each Trainer round is a fresh
``Trainer(max_epochs=1).fit`` on the same model and optimizer; "outside loop" is the rest of that
call beyond its batch loop (its ``epoch_time_s``): setup, the epoch-end reduction, checkpoint, summary.

Memory: a separate fresh process per variant trains 3 epochs and reports its peak resident set
size (``ru_maxrss``: libraries, data, model, optimizer state, activations, the Trainer's checkpoint
buffers) and its peak private memory (``PrivatePeak``: resident minus file-backed pages, sampled
every 0.5 ms; file-backed pages are the shared libraries' code, which every process on the machine
maps from one page cache: PyTorch kernels a loop runs for the first time, e.g. FlopCounterMode's
dispatch path or ``torch.save``, add to RSS but not to private memory), with
``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`` so that glibc returns freed memory at once
(identical runs then agree within ~0.3 MiB); the ratios are against the plain process.
trainscale's modules are compiled to bytecode first (``compileall``), as installing a package does:
with ``PYTHONDONTWRITEBYTECODE=1`` (set on this machine) and no bytecode, every import compiles its
source again, and the compiler's memory would count as trainscale's (+1.7 MiB measured).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("plain", "runtime", "trainer", "trainer-lean", "trainer-flops")
TRAINER_FLAGS = {  # each Trainer variant's flags on top of the defaults
    "trainer": {},
    "trainer-lean": {"enable_telemetry": False, "enable_progress_bar": False},
    "trainer-flops": {"count_flops": True},
}
WORKLOADS = {  # name: (batch size, steps per epoch, rounds per timing process, quick rounds)
    "mlp": (64, 51, 26, 2),  # 51 steps: the Trainer's step-50 log and poll fall inside a timed step
    "convnet": (100, 6, 6, 1),  # 6 rounds x 3 processes: ~4.5 min in all when this VM runs at half speed
    "tiny": (8, 201, 10, 1),  # 201 steps: the step-50 record falls inside timed steps, 4 per epoch
}
PROCESSES = 3  # timing processes, run one after the other; their rounds are pooled
BOOTSTRAP = 2000


# --------------------------------------------------------------------------------------- child
def _make(workload: str, steps: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from trainscale.models import MLP, ConvNet

    batch = WORKLOADS[workload][0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch * steps, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (batch * steps,), generator=g)
    torch.manual_seed(0)
    model = {"mlp": MLP, "convnet": ConvNet}.get(workload, _tiny_model)()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)


def _tiny_model():
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))


def plain_steps(model, optimizer, loader):
    """The plain loop, one optimizer step per ``next()``, epoch after epoch (the ``plain`` variant
    and the reference both run it, on their own model, optimizer and DataLoader)."""
    import torch
    from torch.nn import functional as F

    device = torch.device("cpu")
    model.to(device)
    model.train()
    while True:
        loss_sum = torch.zeros((), device=device)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            yield


class PairClock:
    """Runs one reference step after each ``optimizer.step()`` of the variant (a step post-hook)
    and times both: the variant's steps are the gaps between hooks, the reference's the hooks'
    ``next()`` calls. The same instrument for every variant, outside the code it measures."""

    def __init__(self, optimizer, reference) -> None:
        self.reference = reference
        self.enter: list[float] = []  # hook entries: the end of each variant step
        self.ref: list[float] = []  # reference step durations, one per hook
        self.exit: list[float] = []  # hook exits: the start of the next variant step
        optimizer.register_step_post_hook(self._hook)

    def _hook(self, optimizer, args, kwargs) -> None:
        t0 = time.perf_counter()
        next(self.reference)
        t1 = time.perf_counter()
        self.enter.append(t0)
        self.ref.append(t1 - t0)
        self.exit.append(time.perf_counter())

    def per_step(self) -> tuple[float, float, float, float]:
        """(variant s, reference s) mean step time, then (variant s, reference s) median step time, over
        the epoch since the last call, first steps left out."""
        variant = [b - a for a, b in zip(self.exit, self.enter[1:])]  # steps 2..n of the variant
        ref = self.ref[1:]  # reference steps 2..n: the first of each epoch makes its DataLoader iterator
        self.enter, self.ref, self.exit = [], [], []
        return statistics.fmean(variant), statistics.fmean(ref), statistics.median(variant), statistics.median(ref)


class Plain:
    def __init__(self, workload: str, steps: int, reference=None) -> None:
        self.model, self.optimizer, self.loader = _make(workload, steps)
        self.clock = PairClock(self.optimizer, reference) if reference is not None else None
        self.steps = plain_steps(self.model, self.optimizer, self.loader)

    def epoch(self) -> dict:
        for _ in range(len(self.loader)):
            next(self.steps)
        return self._result(0.0)

    def _result(self, outside: float) -> dict:
        if self.clock is None:
            return {}
        step, ref, step_median, ref_median = self.clock.per_step()
        return {"step": step, "ref": ref, "step_median": step_median, "ref_median": ref_median, "outside": outside}


class WithRuntime(Plain):
    def __init__(self, workload: str, steps: int, reference=None) -> None:
        from trainscale import Runtime

        model, optimizer, loader = _make(workload, steps)
        self.clock = PairClock(optimizer, reference) if reference is not None else None
        self.rt = Runtime(accelerator="cpu", devices=1)
        self.model, self.optimizer = self.rt.setup(model, optimizer)
        self.loader = self.rt.setup_dataloader(loader)
        self.epochs = 0

    def epoch(self) -> dict:
        import torch
        from torch.nn import functional as F

        rt, model, optimizer = self.rt, self.model, self.optimizer
        rt.set_epoch(self.loader, self.epochs)
        model.train()
        loss_sum = torch.zeros((), device=rt.device)
        for batch in self.loader:
            x, y = rt.to_device(batch)
            with rt.no_backward_sync(model, enabled=False):  # accumulation 1: every step syncs
                with rt.autocast():
                    loss = F.cross_entropy(model(x), y)
                rt.backward(loss)
            rt.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        self.epochs += 1
        return self._result(0.0)


class WithTrainer(Plain):
    def __init__(self, workload: str, steps: int, variant: str, root: str, reference=None) -> None:
        self.model, self.optimizer, self.loader = _make(workload, steps)
        self.clock = PairClock(self.optimizer, reference) if reference is not None else None
        self.flags = TRAINER_FLAGS[variant]
        self.root = root

    def epoch(self) -> dict:
        from trainscale import Trainer

        t0 = time.perf_counter()
        trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, default_root_dir=self.root, **self.flags)
        trainer.fit(self.model, self.loader, optimizer=self.optimizer)
        call = time.perf_counter() - t0
        return self._result(call - trainer.history[-1]["epoch_time_s"])


def _child_timing(workloads: list[str], quick: bool, rounds: int | None, out: str) -> None:
    results = {}
    for workload in workloads:
        steps, n = _steps_rounds(workload, quick, rounds)
        results[workload] = {"steps": steps, "rounds": n, "results": _time_workload(workload, steps, n)}
    Path(out).write_text(json.dumps(results))


def _steps_rounds(workload: str, quick: bool, rounds: int | None) -> tuple[int, int]:
    _, steps, full_rounds, quick_rounds = WORKLOADS[workload]
    return (max(3, steps // 4) if quick else steps), rounds or (quick_rounds if quick else full_rounds)


def _time_workload(workload: str, steps: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as root:
        reference = plain_steps(*_make(workload, steps))  # one reference, advanced by every variant's hooks
        runners = {"plain": Plain(workload, steps, reference), "runtime": WithRuntime(workload, steps, reference),
                   **{v: WithTrainer(workload, steps, v, root, reference) for v in TRAINER_FLAGS}}
        for runner in runners.values():  # warm-up epoch (first-touch allocations, lazy imports)
            runner.epoch()
        results = {name: {"step": [], "ref": [], "step_median": [], "ref_median": [], "outside": []} for name in runners}
        names = list(runners)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotated: no variant always first
                for key, value in runners[name].epoch().items():
                    results[name][key].append(value)
    return results


class PrivatePeak:
    """Peak private memory: a thread samples ``/proc/self/statm`` every ~0.5 ms and keeps the largest
    resident − shared pages (= ``RssAnon``: heap, tensors, Python objects; not the file-backed
    pages of shared libraries, which every process using the same PyTorch code maps from the page
    cache). Spikes shorter than the sampling interval can be missed, alike in every variant."""

    def __init__(self) -> None:
        import threading

        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        self.peak = max(self.peak, (int(fields[1]) - int(fields[2])) * self.page)

    def _run(self) -> None:
        while not self._stop.wait(0.0005):
            self._sample()

    def __enter__(self) -> "PrivatePeak":
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)  # the sampler gets the GIL during Python-heavy stretches too
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)
        self._sample()


def _child_memory(workload: str, variant: str, steps: int, epochs: int, out: str) -> None:
    with PrivatePeak() as private, tempfile.TemporaryDirectory() as root:
        if variant == "plain":
            runner = Plain(workload, steps)
        elif variant == "runtime":
            runner = WithRuntime(workload, steps)
        else:
            runner = WithTrainer(workload, steps, variant, root)
        for _ in range(epochs):
            runner.epoch()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    Path(out).write_text(json.dumps({"peak_rss_bytes": peak_kib * 1024, "peak_private_bytes": private.peak}))


# -------------------------------------------------------------------------------------- driver
# glibc gives freed memory back to the OS at once, so peak RSS follows live memory rather than
# the allocator's caching (without this, peak RSS of identical runs varied by ~10 MiB here).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _compile_bytecode() -> None:
    """Compile trainscale's modules to ``__pycache__`` beside them, as installing a package does;
    children then read the bytecode even under ``PYTHONDONTWRITEBYTECODE=1`` (which only stops writing)."""
    import trainscale

    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.dirname(trainscale.__file__)], check=True,
                   stdout=subprocess.DEVNULL)


def _run_child(args: list[str], log: Path, extra_env: dict | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(extra_env or {})}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        with open(log, "a") as log_file:
            proc = subprocess.run([sys.executable, __file__, *args, "--out", str(out)], env=env,
                                  stdout=log_file, stderr=log_file)
        if proc.returncode != 0:
            sys.exit(f"child {args} failed (exit {proc.returncode}); its output:\n{log.read_text()[-4000:]}")
        return json.loads(out.read_text())


def _pool(runs: list[dict]) -> dict:
    """One timing result from several processes: their rounds concatenated, variant by variant.
    A process's rounds share its memory layout and warm-up; identical one-process runs gave Trainer ratios
    from 1.035 to 1.054 here (medians of 20–60 rounds), more apart than their rounds' spread suggests."""
    pooled = json.loads(json.dumps(runs[0]))
    for run in runs[1:]:
        for workload, res in run.items():
            pooled[workload]["rounds"] += res["rounds"]
            for variant, lists in res["results"].items():
                for key, values in lists.items():
                    pooled[workload]["results"][variant][key] += values
    return pooled


def median_interval(values: list[float]) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the median of ``values`` (rounds resampled with replacement)."""
    import random

    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP))
    return medians[int(0.025 * BOOTSTRAP)], medians[int(0.975 * BOOTSTRAP) - 1]


def _fmt_range(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    return f"{min(values) * scale:.{digits}f}–{max(values) * scale:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: few rounds and steps")
    parser.add_argument("--workloads", default="mlp,convnet", help="comma-separated: mlp, convnet, tiny")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per variant in each timing process (default per workload)")
    parser.add_argument("--processes", type=int, default=None,
                        help=f"timing processes whose rounds are pooled (default {PROCESSES}, 1 with --quick)")
    parser.add_argument("--log", default=None, help="file for the children's output (progress bar, prints)")
    parser.add_argument("--child", choices=("timing", "memory"), help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        import torch

        torch.set_num_threads(1)
        if args.child == "timing":
            _child_timing(args.workload.split(","), args.quick, args.rounds, args.out)
        else:
            _child_memory(args.workload, args.variant, args.steps, args.epochs, args.out)
        return

    import platform
    from importlib.metadata import version  # not `import torch`: only the children need it

    log = Path(args.log or Path(tempfile.gettempdir()) / f"trainscale-overhead-{os.getpid()}.log")
    log.write_text("")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    print(f"# overhead: torch {version('torch')}, Python {platform.python_version()}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start, 1 thread per process"
          f"{', QUICK (smoke run, numbers not meaningful)' if args.quick else ''}")
    print(f"# children's output (progress bars, prints): {log}")
    t_start = time.perf_counter()
    quick = ["--quick"] if args.quick else []
    rounds = ["--rounds", str(args.rounds)] if args.rounds else []
    processes = args.processes or (1 if args.quick else PROCESSES)
    timing = _pool([_run_child(["--child", "timing", "--workload", ",".join(workloads), *quick, *rounds], log)
                    for _ in range(processes)])
    if not args.quick:
        _compile_bytecode()
    for workload in workloads:
        batch = WORKLOADS[workload][0]
        steps, n_rounds = timing[workload]["steps"], timing[workload]["rounds"]
        memory = {}
        if not args.quick:  # a fresh process per variant: peak RSS is per process
            memory = {v: _run_child(["--child", "memory", "--workload", workload, "--variant", v,
                                     "--steps", str(steps), "--epochs", "3"], log, MALLOC_ENV) for v in VARIANTS}
        res = timing[workload]["results"]
        print(f"\n## {workload}: batch {batch}, {steps} steps per epoch, {n_rounds} rounds; each variant's steps "
              f"interleaved with the reference's (median, min–max over rounds)")
        header = (f"{'variant':<13} {'ms/step':>8} {'min–max':>13} {'vs ref':>6} {'ratio':>6} {'ratio 95 % CI':>13} "
                  f"{'ratio IQR':>11} {'med ratio':>9} {'med 95 % CI':>13} {'µs/step over plain':>18} "
                  f"{'outside loop s':>14} {'peak RSS MiB':>12} "
                  f"{'RSS extra':>9} {'private MiB':>11} {'priv extra':>10}")
        print(header)
        print("-" * len(header))
        plain_vs_ref = [t / r for t, r in zip(res["plain"]["step"], res["plain"]["ref"])]
        plain_med = [t / r for t, r in zip(res["plain"]["step_median"], res["plain"]["ref_median"])]
        for v in VARIANTS:
            step_ms = [t * 1e3 for t in res[v]["step"]]
            vs_ref = [t / r for t, r in zip(res[v]["step"], res[v]["ref"])]
            ratios = [x / p for x, p in zip(vs_ref, plain_vs_ref)]  # against plain, same round, same instrument
            q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
            low, high = median_interval(ratios)
            med = [t / r / p for t, r, p in zip(res[v]["step_median"], res[v]["ref_median"], plain_med)]
            med_low, med_high = median_interval(med)
            # the median step's extra time in µs: (variant - plain) against the same reference, at its speed
            extra_us = [(t / r - p) * r * 1e6 for t, r, p in zip(res[v]["step_median"], res[v]["ref_median"], plain_med)]
            if memory:
                rss, private = (memory[v][key] / memory["plain"][key] for key in ("peak_rss_bytes", "peak_private_bytes"))
                mem = (f"{memory[v]['peak_rss_bytes'] / 2**20:>12.1f} {(rss - 1) * 100:>+7.2f} % "
                       f"{memory[v]['peak_private_bytes'] / 2**20:>11.1f} {(private - 1) * 100:>+8.2f} %")
            else:
                mem = f"{'(skipped)':>12} {'-':>9} {'(skipped)':>11} {'-':>10}"
            print(f"{v:<13} {statistics.median(step_ms):>8.3f} {_fmt_range(step_ms, digits=2):>13} "
                  f"{statistics.median(vs_ref):>6.3f} {statistics.median(ratios):>6.3f} {low:>6.3f}–{high:<6.3f} "
                  f"{q1:>5.3f}–{q3:<5.3f} {statistics.median(med):>9.3f} {med_low:>6.3f}–{med_high:<6.3f} "
                  f"{statistics.median(extra_us):>18.1f} {statistics.median(res[v]['outside']):>14.3f} {mem}")
    print("\n# vs ref: the variant's mean step over the mean of the reference steps interleaved with it (per round);"
          "\n# ratio: that over plain's 'vs ref' in the same round, i.e. the variant against the plain loop measured"
          "\n# the same way (plain's own 'vs ref' shows the instrument's bias: the reference runs inside a hook);"
          "\n# mean steps: what an epoch costs, the step-50 record and check included;"
          f"\n# ratio 95 % CI: of the median ratio, {BOOTSTRAP} bootstrap resamples of the rounds; ratio IQR: of the rounds;"
          "\n# med ratio: the same ratio from each round's median steps (the 'median step time'; a step in"
          "\n# 50 that writes the record is an outlier it leaves out), med 95 % CI: its bootstrap interval;"
          "\n# µs/step over plain: the median step's extra time, (variant/ref - plain/ref) x the reference's median step,"
          "\n# per round (medians of the round's steps), median over rounds"
          "\n# RSS extra, priv extra: peak RSS and peak private memory over the plain process's, in per cent")
    print(f"\n# total {time.perf_counter() - t_start:.0f} s; load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
