"""``trainscale bench``: the scaling sweep from the command line (see :mod:`trainscale.bench`)."""

from __future__ import annotations

import argparse
import os
import sys


def run_bench(args: argparse.Namespace) -> int:
    """Run the sweep, print the tables and the advice on stdout.

    Returns:
        0 when every cell ran, 1 when some cell failed, 130 when interrupted (resume with ``--resume``).
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # --entry modules are found in the current directory, as with `python -m`
    from trainscale.bench import sweep
    from trainscale.bench.grid import DEFAULT_BATCH_SIZES
    from trainscale.jobs.workload import WORKLOADS

    workload = getattr(args, "workload", None)
    if workload is not None and args.entry is not None:
        print(f"trainscale bench: give --workload ({workload}) or --entry ({args.entry}), not both", file=sys.stderr)
        return 2
    entry = WORKLOADS[workload] if workload is not None else args.entry
    try:
        result = sweep(entry, devices=args.devices, batch_sizes=args.batch_sizes or DEFAULT_BATCH_SIZES,
                       strategies=args.strategy, precisions=args.precision, scaling=args.scaling,
                       epochs=args.epochs, steps=args.steps, warmup_steps=args.warmup_steps, timeout=args.timeout,
                       out=args.out, resume=args.resume, target_accuracy=args.target_accuracy,
                       accelerator=args.accelerator, seed=args.seed, progress=not args.quiet,
                       plots=not args.no_plots, predict=args.plan)
    except KeyboardInterrupt:
        print("\ntrainscale bench: interrupted; the finished cells are kept in results.jsonl: rerun the same "
              "command with --resume (and the same --out) to complete the sweep", file=sys.stderr)
        return 130
    print(result.tables)
    if result.accounts:
        print("\nWhere the speed-up went, per step (= the ideal step; C exposed communication, D data wait, W waiting "
              "for the slowest rank, O per-step fixed overhead, S compute slowdown, ? residual):")
        print(result.accounts)
    print("\nAdvice:")
    for sentence in result.advice:
        print(f"- {sentence}")
    print(f"\nresults: {result.out}/results.csv, results.json, report.md")
    return 0 if all(r.get("status") == "ok" for r in result.rows) else 1
