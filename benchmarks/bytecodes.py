"""Python work per optimizer step, counted exactly: bytecodes executed and C functions called.

    python benchmarks/bytecodes.py                    # the variants of overhead.py on its MLP workload (~30 s)
    python benchmarks/bytecodes.py --detail trainer   # plus where a variant's extra bytecodes run
    python benchmarks/bytecodes.py --quick            # smoke run

Why: on this VM step *times* drift by ±2–4 % per round (see overhead.py), so a change that saves
1 % of a step needs minutes of interleaved rounds to show, and one that saves 0.2 % never does.
Bytecode counts are deterministic: the same code gives the same count on every run, so each cut
of per-step Python work (a call, an attribute lookup through ``nn.Module.__getattr__``, a list
allocated per step) shows at once. They count work, not time: a bytecode costs ~10–100 ns depending
on the instruction and on the caches (inside a training step, whose compute evicts the interpreter's
data, the same Python runs several times slower than in a warm loop), and C work (tensor ops,
``.to()``) counts as one call whatever it costs. Use it to find and check cuts; use overhead.py's
ratios for what they are worth in time.

Method: ``sys.settrace`` with ``frame.f_trace_opcodes = True`` counts every bytecode of every Python
frame; ``sys.setprofile`` counts ``c_call`` events. An optimizer step post-hook splits the counts
into steps; per epoch, steps 2..n are kept (the first holds the epoch's setup: DataLoader iterator,
Trainer setup). Each variant (built as in overhead.py, same model, data and optimizer) trains
``EPOCHS`` epochs after a warm-up epoch. "mean" includes the step that writes the step-50 record
(the MLP epoch has 51 steps); "median" is the typical step. The tracer's own hook is not counted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (the variants and workloads of benchmarks/overhead.py)

EPOCHS = 3


class Counter:
    """Counts bytecodes and C calls between optimizer steps (and, with ``detail``, bytecodes per function)."""

    def __init__(self, detail: bool) -> None:
        self.ops = 0
        self.calls = 0
        self.detail = detail
        self.active = False  # per-function counts only inside steps 2..n-1 of an epoch
        self.by_function: collections.Counter = collections.Counter()

    def trace(self, frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.ops += 1
            if self.active:
                code = frame.f_code
                self.by_function[f"{code.co_filename.split('site-packages/')[-1]}:{code.co_name}"] += 1
        return self.trace

    def profile(self, frame, event, arg):
        if event == "c_call":
            self.calls += 1


def count_variant(runner, steps_per_epoch: int, detail: bool) -> dict:
    """Bytecodes and C calls per step of ``runner`` (an overhead.py variant) over ``EPOCHS`` epochs."""
    counter = Counter(detail)
    marks: list[tuple[int, int]] = []

    def hook(*_):
        marks.append((counter.ops, counter.calls))
        counter.active = detail and 1 <= len(marks) < steps_per_epoch

    handle = runner.optimizer.register_step_post_hook(hook)
    ops, calls = [], []
    for _ in range(EPOCHS):
        marks.clear()
        sys.settrace(counter.trace)
        sys.setprofile(counter.profile)
        try:
            runner.epoch()
        finally:
            sys.settrace(None)
            sys.setprofile(None)
        ops += [b[0] - a[0] for a, b in zip(marks, marks[1:])]
        calls += [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    handle.remove()
    steps_counted = max(1, (steps_per_epoch - 2) * EPOCHS)
    return {"mean": statistics.fmean(ops), "median": statistics.median(ops), "calls": statistics.fmean(calls),
            "functions": {k: v / steps_counted for k, v in counter.by_function.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: short epochs")
    parser.add_argument("--detail", default=None, help="a variant whose extra bytecodes per function to list")
    parser.add_argument("--top", type=int, default=25, help="functions listed with --detail")
    args = parser.parse_args()
    if args.detail is not None and args.detail not in overhead.VARIANTS:
        parser.error(f"--detail {args.detail!r}: choose from {', '.join(overhead.VARIANTS)}")

    import torch

    torch.set_num_threads(1)
    steps = 12 if args.quick else overhead.WORKLOADS["mlp"][1]
    detail = args.detail is not None
    with tempfile.TemporaryDirectory() as root, open(os.devnull, "w") as quiet, \
            contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):  # the Trainer's prints and bar
        runners = {"plain": overhead.Plain("mlp", steps), "runtime": overhead.WithRuntime("mlp", steps),
                   **{v: overhead.WithTrainer("mlp", steps, v, root) for v in overhead.TRAINER_FLAGS}}
        for runner in runners.values():  # warm-up: first-touch allocations, lazy imports, FLOP counting
            runner.epoch()
        results = {name: count_variant(runner, steps, detail) for name, runner in runners.items()}

    plain = results["plain"]
    print(f"# bytecodes: torch {torch.__version__}, Python {sys.version.split()[0]}; MLP 784-128-10, batch 64, "
          f"{steps} steps per epoch, {EPOCHS} epochs per variant after a warm-up epoch"
          f"{', QUICK (smoke run)' if args.quick else ''}")
    header = f"{'variant':<13} {'bytecodes/step':>14} {'over plain':>10} {'median step':>11} {'over plain':>10} {'C calls/step':>12} {'over plain':>10}"
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(f"{name:<13} {r['mean']:>14.1f} {r['mean'] - plain['mean']:>+10.1f} {r['median']:>11.1f} "
              f"{r['median'] - plain['median']:>+10.1f} {r['calls']:>12.1f} {r['calls'] - plain['calls']:>+10.1f}")
    print("\n# bytecodes/step: mean over steps 2..n of each epoch (the step-50 record included); median step: the"
          "\n# typical step; C calls: c_call events of sys.setprofile (tensor ops and builtins, whatever their cost)")
    if detail:
        mine, base = results[args.detail]["functions"], plain["functions"]
        extra = sorted(((v - base.get(k, 0.0), k) for k, v in mine.items()), reverse=True)
        print(f"\n## {args.detail}: bytecodes per step over plain, by function (steps 2..n-1 of each epoch)")
        for value, name in extra[:args.top]:
            print(f"{value:>8.1f}  {name}")


if __name__ == "__main__":
    main()
