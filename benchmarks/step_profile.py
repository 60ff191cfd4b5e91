"""Where the Trainer's per-step overhead goes, counted rather than timed: Python bytecodes and calls per
optimizer step, per function, of each variant of ``benchmarks/overhead.py`` against the plain loop.

    python benchmarks/step_profile.py                      # tiny workload: plain, runtime, trainer-lean, trainer
    python benchmarks/step_profile.py --workload mlp --top 30
    python benchmarks/step_profile.py --quick              # smoke run (fewer steps)

Why counts: on this 2-core VM a step's time drifts by up to 2x over tens of milliseconds, and two runs of
``overhead.py --workloads tiny`` on identical code read 31 and 38 µs over plain, so a change of 3 µs cannot be
seen in a timing. The bytecodes a step executes do not depend on the machine's load: the same code gives the same
count. Each variant trains one warm-up epoch of ``overhead.py``'s workload, then ``sys.settrace`` with
``frame.f_trace_opcodes = True`` (https://docs.python.org/3/library/sys.html#sys.settrace) counts every bytecode
and call of optimizer steps 10 to 10 + ``--steps`` of the second epoch (started and stopped by an optimizer step
post-hook, so the epoch's start and end are outside). Native work (kernels, autograd, the allocator) is not
counted: use it for the Python of the loop, the part the per-step budget is about (docs/performance.md). On
this machine, 1 000 extra bytecodes of the tiny workload's loop cost about 30 µs (a calibration from
``valgrind --tool=callgrind`` instruction counts, docs/performance.md), so the count converts to time only roughly.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead  # noqa: E402  (this directory's benchmark: the workloads and the variants)

VARIANTS = ("plain", "runtime", "trainer-lean", "trainer")
START = 10  # the first counted optimizer step of the second epoch


def _runner(variant: str, workload: str, steps: int, root: str):
    if variant == "plain":
        return overhead.Plain(workload, steps)
    if variant == "runtime":
        return overhead.WithRuntime(workload, steps)
    return overhead.WithTrainer(workload, steps, variant, root)


def _where(code) -> str:
    """``package/module.py:function`` for a code object (site-packages and src/ prefixes dropped)."""
    path = code.co_filename.replace(os.sep, "/")
    for marker in ("site-packages/", "src/", "benchmarks/"):
        path = path.split(marker)[-1]
    return f"{path}:{code.co_name}"


def count(variant: str, workload: str, steps: int) -> tuple[collections.Counter, collections.Counter]:
    """(bytecodes, calls) per function over ``steps`` optimizer steps of ``variant`` (see the module docstring)."""
    ops: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            ops[_where(frame.f_code)] += 1
        elif event == "call":
            calls[_where(frame.f_code)] += 1
        return tracer

    state = {"counting": False, "step": 0}

    def hook(optimizer, args, kwargs) -> None:
        if state["counting"]:
            state["step"] += 1
            if state["step"] == START:
                sys.settrace(tracer)
            elif state["step"] == START + steps:
                sys.settrace(None)

    with tempfile.TemporaryDirectory() as root:
        runner = _runner(variant, workload, START + steps + 1, root)
        runner.optimizer.register_step_post_hook(hook)
        runner.epoch()  # warm-up: lazy imports, first-call caches
        state["counting"] = True
        runner.epoch()
    sys.settrace(None)
    return ops, calls


def _report(results: dict, steps: int, top: int) -> None:
    plain_ops, plain_calls = results["plain"]
    per = lambda counter: sum(counter.values()) / steps  # noqa: E731
    print(f"{'variant':14s} {'bytecodes/step':>15s} {'over plain':>11s} {'calls/step':>11s} {'over plain':>11s}")
    for name, (ops, calls) in results.items():
        print(f"{name:14s} {per(ops):15.0f} {per(ops) - per(plain_ops):+11.0f} {per(calls):11.1f} "
              f"{per(calls) - per(plain_calls):+11.1f}")
    for name, (ops, calls) in results.items():
        if name == "plain":
            continue
        own = sum(v for k, v in ops.items() if k.startswith("trainscale/")) / steps
        print(f"\n## {name}: bytecodes/step by function, against plain (trainscale's own code: {own:.0f}/step)")
        rows = sorted(set(ops) | set(plain_ops), key=lambda k: -abs(ops[k] - plain_ops[k]))[:top]
        for key in rows:
            extra = (ops[key] - plain_ops[key]) / steps
            if abs(extra) >= 0.5:
                print(f"{extra:+8.1f}  ({(calls[key] - plain_calls[key]) / steps:+5.2f} calls)  {key}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="tiny", choices=sorted(overhead.WORKLOADS))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; plain is always counted")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps counted per variant")
    parser.add_argument("--top", type=int, default=25, help="functions listed per variant")
    parser.add_argument("--quick", action="store_true", help="20 steps (a smoke run)")
    args = parser.parse_args(argv)
    steps = 20 if args.quick else args.steps
    import torch

    torch.set_num_threads(1)
    variants = ["plain", *[v for v in args.variants.split(",") if v and v != "plain"]]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variant(s) {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    print(f"# step_profile: {args.workload}, {steps} optimizer steps counted per variant, torch {torch.__version__}, "
          f"Python {sys.version.split()[0]}")
    log = Path(tempfile.gettempdir()) / f"trainscale-step-profile-{os.getpid()}.log"
    with open(log, "w") as sink:  # the Trainer's progress bar and prints, away from the table
        saved = os.dup(2), os.dup(1)
        os.dup2(sink.fileno(), 2)
        os.dup2(sink.fileno(), 1)
        try:
            results = {v: count(v, args.workload, steps) for v in variants}
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 2)
            os.dup2(saved[1], 1)
    print(f"# children's output: {log}\n")
    _report(results, steps, args.top)


if __name__ == "__main__":
    main()
