"""What trainscale costs per step, against a plain PyTorch loop written here, on one process.

    python benchmarks/overhead.py             # both workloads, about 3 minutes here
    python benchmarks/overhead.py --quick     # smoke run (a few seconds of training per workload)

Workloads (synthetic data of MNIST's shape held in memory, a DataLoader with shuffle=True and no
workers, AdamW lr=1e-3, one thread per process):
- ``mlp``: MLP 784-128-10, batch 64. Each step is tiny, so per-step framework overhead dominates.
- ``convnet``: the tutorial ConvNet on 1×28×28, batch 100.

Variants, all built from the same seed, each with its own model, optimizer and DataLoader:
- ``plain``: the reference, a hand-written loop: batch ``.to(device)``, forward, cross-entropy,
  ``backward``, ``step``, ``zero_grad(set_to_none=True)``, epoch loss summed on the device (no host sync).
- ``runtime``: the same loop through ``Runtime`` (setup, setup_dataloader, set_epoch, to_device,
  no_backward_sync, autocast, backward, step), as in the Runtime docstring.
- ``trainer``: ``Trainer.fit`` with its defaults: progress bar on (written to this process's stderr,
  which the driver sends to a log file), a JSONL step record every 50 steps, a checkpoint at each
  epoch end.
- ``trainer-lean``: ``Trainer.fit`` with ``enable_progress_bar=False, enable_checkpointing=False``.

Timing: one child process runs, per workload, one warm-up epoch per variant, then ``rounds`` rounds
of one epoch per variant (A/B/C/D, B/C/D/A, C/D/A/B, ...: the order rotates each round so that no
variant always runs first or after the same neighbour), so that machine load drifts alike over all
variants. Step time = the interval between the ends of
consecutive ``optimizer.step()`` calls (an optimizer step post-hook, the same in every variant;
see ``StepClock``), averaged over the epoch's steps: wall time (``perf_counter``) and this
process's CPU time (``process_time``, which waiting for a busy CPU does not inflate). Each Trainer
round is a fresh ``Trainer(max_epochs=1).fit`` on the same model and optimizer. Ratios are taken per
round against the same round's plain epoch (paired), then the median and min–max over rounds.
"Outside loop" is the rest of a ``Trainer(...)`` + ``fit`` call beyond its batch loop (its
``epoch_time_s``): setup, the epoch-end reduction, checkpoint, summary.

Memory: a separate fresh process per variant trains 3 epochs and reports its peak resident set
size (``ru_maxrss``: libraries, data, model, optimizer state, activations, the Trainer's checkpoint
buffers), with ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`` so that glibc returns freed
memory at once (identical runs then agree within ~0.3 MiB); the ratio is against the plain process.
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

VARIANTS = ("plain", "runtime", "trainer", "trainer-lean")
WORKLOADS = {  # name: (batch size, steps per epoch, rounds, quick rounds)
    "mlp": (64, 25, 60, 2),
    "convnet": (100, 5, 16, 1),
}


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
    model = MLP() if workload == "mlp" else ConvNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)


class StepClock:
    """Wall and CPU time between consecutive ``optimizer.step()`` ends, read by an optimizer step
    post-hook: the same instrument in every variant, outside the code it measures. Each interval
    holds one whole step cycle: zero_grad, loss bookkeeping, progress bar, fetching the next batch,
    moving it, forward, backward, step."""

    def __init__(self, optimizer) -> None:
        self.marks: list[tuple[float, float]] = []
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.marks.append(
            (time.perf_counter(), time.process_time())))

    def per_step(self) -> tuple[float, float]:
        """(wall s, CPU s) per step over the marks since the last call."""
        (w0, c0), (w1, c1) = self.marks[0], self.marks[-1]
        n = len(self.marks) - 1
        self.marks = []
        return (w1 - w0) / n, (c1 - c0) / n


class Plain:
    def __init__(self, workload: str, steps: int) -> None:
        import torch

        self.model, self.optimizer, self.loader = _make(workload, steps)
        self.clock = StepClock(self.optimizer)
        self.device = torch.device("cpu")
        self.model.to(self.device)

    def epoch(self) -> dict:
        import torch
        from torch.nn import functional as F

        model, optimizer, device = self.model, self.optimizer, self.device
        model.train()
        loss_sum = torch.zeros((), device=device)
        for x, y in self.loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        wall, cpu = self.clock.per_step()
        return {"wall": wall, "cpu": cpu, "outside": 0.0}


class WithRuntime:
    def __init__(self, workload: str, steps: int) -> None:
        from trainscale import Runtime

        model, optimizer, loader = _make(workload, steps)
        self.clock = StepClock(optimizer)
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
        wall, cpu = self.clock.per_step()
        return {"wall": wall, "cpu": cpu, "outside": 0.0}


class WithTrainer:
    def __init__(self, workload: str, steps: int, lean: bool, root: str) -> None:
        self.model, self.optimizer, self.loader = _make(workload, steps)
        self.clock = StepClock(self.optimizer)
        self.lean = lean
        self.root = root

    def epoch(self) -> dict:
        from trainscale import Trainer

        t0 = time.perf_counter()
        trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, default_root_dir=self.root,
                          enable_progress_bar=not self.lean, enable_checkpointing=not self.lean)
        trainer.fit(self.model, self.loader, optimizer=self.optimizer)
        call = time.perf_counter() - t0
        wall, cpu = self.clock.per_step()
        return {"wall": wall, "cpu": cpu, "outside": call - trainer.history[-1]["epoch_time_s"]}


def _child_timing(workloads: list[str], quick: bool, rounds: int | None, out: str) -> None:
    results = {}
    for workload in workloads:
        steps, n = _steps_rounds(workload, quick, rounds)
        results[workload] = {"steps": steps, "rounds": n, "results": _time_workload(workload, steps, n)}
    Path(out).write_text(json.dumps(results))


def _steps_rounds(workload: str, quick: bool, rounds: int | None) -> tuple[int, int]:
    _, steps, full_rounds, quick_rounds = WORKLOADS[workload]
    return (max(2, steps // 4) if quick else steps), rounds or (quick_rounds if quick else full_rounds)


def _time_workload(workload: str, steps: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as root:
        runners = {"plain": Plain(workload, steps), "runtime": WithRuntime(workload, steps),
                   "trainer": WithTrainer(workload, steps, lean=False, root=root),
                   "trainer-lean": WithTrainer(workload, steps, lean=True, root=root)}
        for runner in runners.values():  # warm-up epoch (first-touch allocations, lazy imports)
            runner.epoch()
        results = {name: {"wall": [], "cpu": [], "outside": []} for name in runners}
        names = list(runners)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotated: no variant always first
                for key, value in runners[name].epoch().items():
                    results[name][key].append(value)
    return results


def _child_memory(workload: str, variant: str, steps: int, epochs: int, out: str) -> None:
    with tempfile.TemporaryDirectory() as root:
        if variant == "plain":
            runner = Plain(workload, steps)
        elif variant == "runtime":
            runner = WithRuntime(workload, steps)
        else:
            runner = WithTrainer(workload, steps, lean=variant == "trainer-lean", root=root)
        for _ in range(epochs):
            runner.epoch()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    Path(out).write_text(json.dumps({"peak_rss_bytes": peak_kib * 1024}))


# -------------------------------------------------------------------------------------- driver
# glibc gives freed memory back to the OS at once, so peak RSS follows live memory rather than
# the allocator's caching (without this, peak RSS of identical runs varied by ~10 MiB here).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


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


def _fmt_range(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    return f"{min(values) * scale:.{digits}f}–{max(values) * scale:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: few rounds and steps")
    parser.add_argument("--workloads", default="mlp,convnet", help="comma-separated: mlp, convnet")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant (default per workload)")
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

    import torch

    log = Path(args.log or Path(tempfile.gettempdir()) / f"trainscale-overhead-{os.getpid()}.log")
    log.write_text("")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    print(f"# overhead: torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start, 1 thread per process"
          f"{', QUICK (smoke run, numbers not meaningful)' if args.quick else ''}")
    print(f"# children's output (progress bars, prints): {log}")
    t_start = time.perf_counter()
    quick = ["--quick"] if args.quick else []
    rounds = ["--rounds", str(args.rounds)] if args.rounds else []
    timing = _run_child(["--child", "timing", "--workload", ",".join(workloads), *quick, *rounds], log)
    for workload in workloads:
        batch = WORKLOADS[workload][0]
        steps, n_rounds = timing[workload]["steps"], timing[workload]["rounds"]
        memory = {}
        if not args.quick:  # a fresh process per variant: peak RSS is per process
            memory = {v: _run_child(["--child", "memory", "--workload", workload, "--variant", v,
                                     "--steps", str(steps), "--epochs", "3"], log, MALLOC_ENV)["peak_rss_bytes"]
                      for v in VARIANTS}
        res = timing[workload]["results"]
        print(f"\n## {workload}: batch {batch}, {steps} steps per epoch, {n_rounds} interleaved rounds "
              f"(median, min–max over rounds; ratios paired per round with plain)")
        header = (f"{'variant':<13} {'wall ms/step':>12} {'min–max':>13} {'ratio':>6} {'ratio min–max':>13} "
                  f"{'CPU ms/step':>11} {'CPU ratio':>9} {'CPU ratio min–max':>17} "
                  f"{'outside loop s':>14} {'peak RSS MiB':>12} {'mem ratio':>9}")
        print(header)
        print("-" * len(header))
        for v in VARIANTS:
            wall_ms = [t * 1e3 for t in res[v]["wall"]]
            cpu_ms = [t * 1e3 for t in res[v]["cpu"]]
            ratios = [t / p for t, p in zip(res[v]["wall"], res["plain"]["wall"])]
            cpu_ratios = [t / p for t, p in zip(res[v]["cpu"], res["plain"]["cpu"])]
            mem = (f"{memory[v] / 2**20:>12.1f} {memory[v] / memory['plain']:>9.3f}" if memory
                   else f"{'(skipped)':>12} {'-':>9}")
            print(f"{v:<13} {statistics.median(wall_ms):>12.3f} {_fmt_range(wall_ms, digits=2):>13} "
                  f"{statistics.median(ratios):>6.3f} {_fmt_range(ratios):>13} "
                  f"{statistics.median(cpu_ms):>11.3f} {statistics.median(cpu_ratios):>9.3f} "
                  f"{_fmt_range(cpu_ratios):>17} {statistics.median(res[v]['outside']):>14.3f} {mem}")
    print(f"\n# total {time.perf_counter() - t_start:.0f} s; load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
