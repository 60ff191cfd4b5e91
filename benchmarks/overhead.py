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

Timing: one child process runs, per workload, one warm-up epoch per variant, then ``rounds`` rounds of
one epoch per variant in the order plain, runtime, trainer, trainer-lean (A/B/C/D/A/B/C/D...), so
machine load drifts alike over all variants. Step time = the wall time of the epoch's batch loop
divided by its steps (for the Trainer, its ``epoch_time_s``, measured around the same loop); each
Trainer round is a fresh ``Trainer(max_epochs=1).fit`` on the same model and optimizer. The ratio is
taken per round against the same round's plain epoch (paired), then the median and min–max over rounds.
"Outside loop" is the rest of a ``Trainer(...)`` + ``fit`` call: setup, the epoch-end reduction,
checkpoint, summary (paid once per fit, or per epoch for the epoch-end part).

Memory: a separate fresh process per variant trains ``mem_epochs`` epochs and reports its peak
resident set size (``ru_maxrss``); the ratio is against the plain process.
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
    "mlp": (64, 100, 15, 2),
    "convnet": (100, 10, 8, 1),
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


class Plain:
    def __init__(self, workload: str, steps: int) -> None:
        import torch

        self.model, self.optimizer, self.loader = _make(workload, steps)
        self.device = torch.device("cpu")
        self.model.to(self.device)

    def epoch(self) -> tuple[float, float]:
        import torch
        from torch.nn import functional as F

        model, optimizer, device = self.model, self.optimizer, self.device
        model.train()
        loss_sum = torch.zeros((), device=device)
        t0 = time.perf_counter()
        for x, y in self.loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        t = time.perf_counter() - t0
        return t, t


class WithRuntime:
    def __init__(self, workload: str, steps: int) -> None:
        from trainscale import Runtime

        model, optimizer, loader = _make(workload, steps)
        self.rt = Runtime(accelerator="cpu", devices=1)
        self.model, self.optimizer = self.rt.setup(model, optimizer)
        self.loader = self.rt.setup_dataloader(loader)
        self.epochs = 0

    def epoch(self) -> tuple[float, float]:
        import torch
        from torch.nn import functional as F

        rt, model, optimizer = self.rt, self.model, self.optimizer
        t0 = time.perf_counter()
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
        t = time.perf_counter() - t0
        self.epochs += 1
        return t, t


class WithTrainer:
    def __init__(self, workload: str, steps: int, lean: bool, root: str) -> None:
        self.model, self.optimizer, self.loader = _make(workload, steps)
        self.lean = lean
        self.root = root

    def epoch(self) -> tuple[float, float]:
        from trainscale import Trainer

        t0 = time.perf_counter()
        trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, default_root_dir=self.root,
                          enable_progress_bar=not self.lean, enable_checkpointing=not self.lean)
        trainer.fit(self.model, self.loader, optimizer=self.optimizer)
        call = time.perf_counter() - t0
        return trainer.history[-1]["epoch_time_s"], call


def _child_timing(workloads: list[str], quick: bool, rounds: int | None, out: str) -> None:
    results = {}
    for workload in workloads:
        steps, n = _steps_rounds(workload, quick, rounds)
        results[workload] = {"steps": steps, "rounds": n, "results": _time_workload(workload, steps, n)}
    Path(out).write_text(json.dumps(results))


def _steps_rounds(workload: str, quick: bool, rounds: int | None) -> tuple[int, int]:
    _, steps, full_rounds, quick_rounds = WORKLOADS[workload]
    return (max(2, steps // 5) if quick else steps), rounds or (quick_rounds if quick else full_rounds)


def _time_workload(workload: str, steps: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as root:
        runners = {"plain": Plain(workload, steps), "runtime": WithRuntime(workload, steps),
                   "trainer": WithTrainer(workload, steps, lean=False, root=root),
                   "trainer-lean": WithTrainer(workload, steps, lean=True, root=root)}
        for runner in runners.values():  # warm-up epoch (first-touch allocations, lazy imports)
            runner.epoch()
        results = {name: {"loop_s": [], "call_s": []} for name in runners}
        for _ in range(rounds):
            for name, runner in runners.items():
                loop, call = runner.epoch()
                results[name]["loop_s"].append(loop)
                results[name]["call_s"].append(call)
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
def _run_child(args: list[str], log: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
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
                                     "--steps", str(steps), "--epochs", "3"], log)["peak_rss_bytes"]
                      for v in VARIANTS}
        res = timing[workload]["results"]
        plain_loop = res["plain"]["loop_s"]
        print(f"\n## {workload}: batch {batch}, {steps} steps per epoch, {n_rounds} interleaved rounds "
              f"(median, min–max over rounds)")
        header = (f"{'variant':<13} {'step ms':>8} {'step ms min–max':>16} {'ratio':>6} {'ratio min–max':>13} "
                  f"{'outside loop s':>14} {'peak RSS MiB':>12} {'mem ratio':>9}")
        print(header)
        print("-" * len(header))
        for v in VARIANTS:
            loop = res[v]["loop_s"]
            step_ms = [t / steps * 1e3 for t in loop]
            ratios = [t / p for t, p in zip(loop, plain_loop)]
            outside = [c - t for c, t in zip(res[v]["call_s"], loop)]
            mem = (f"{memory[v] / 2**20:>12.1f} {memory[v] / memory['plain']:>9.3f}" if memory
                   else f"{'(skipped)':>12} {'-':>9}")
            print(f"{v:<13} {statistics.median(step_ms):>8.3f} {_fmt_range(step_ms):>16} "
                  f"{statistics.median(ratios):>6.3f} {_fmt_range(ratios):>13} "
                  f"{statistics.median(outside):>14.3f} {mem}")
    print(f"\n# total {time.perf_counter() - t_start:.0f} s; load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
