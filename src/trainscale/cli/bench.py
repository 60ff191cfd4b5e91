"""``trainscale bench``: the scaling sweep from the command line (see :mod:`trainscale.bench`)."""

from __future__ import annotations

import argparse
import os
import sys

HELP = "scaling sweep: devices × batch sizes, a table of epoch time, gain and efficiency, advice"
DESCRIPTION = ("Run each cell (devices × batch size × strategy × precision) as a fresh torchrun job, time an epoch "
               "after a warm-up, and print batches/epoch, epoch time, gain and scaling efficiency with advice. Files in "
               "--out: results.jsonl/.json/.csv, report.md, scaling.png. Example: trainscale bench --devices 1,2 "
               "--batch-sizes 16,64,256 --steps 100; a language model under every strategy: trainscale bench --workload "
               "lm --strategy ddp,fsdp,hsdp,tp --devices 1,4 --batch-sizes 8 --steps 20 (adds tokens/s and FLOPs/token)")


def build_parser(prog: str = "trainscale bench"):
    """The options of ``trainscale bench``: the swept and fixed Trainer flags from their declarations, then its own."""
    from trainscale.cli.flags import add_sweep_flag, add_trainer_flags, ints, new_parser

    bench = new_parser(prog, DESCRIPTION)
    bench.add_argument("--entry", default=None, metavar="PKG.MODULE:FUNCTION",
                       help="your workload: a function returning {'model', 'train', 'val', 'loss_fn', 'optimizer', "
                            "'dataloader', 'flops_per_token'} (default: the ConvNet on MNIST-5k)")
    bench.add_argument("--workload", default=None, choices=("convnet", "lm"),
                       help="a built-in workload instead of --entry: convnet (the default; MNIST-5k) or lm (the "
                            "reference GPT 'mini' on byte-level Shakespeare; tokens/s and FLOPs/token in the table)")
    add_sweep_flag(bench, "devices", "device counts, e.g. 1,2 (default: 1 and powers of two up to the GPUs, or CPU "
                                     "cores)", None, element=int)
    bench.add_argument("--batch-sizes", type=ints, default=None,
                       help="batch sizes (default 4,8,16,32,64,128,256,512): per device (weak) or global (strong)")
    add_sweep_flag(bench, "strategy", "strategies, comma-separated", ["ddp"])
    add_sweep_flag(bench, "precision", "precisions, comma-separated, e.g. 32-true,bf16-mixed", ["32-true"])
    bench.add_argument("--scaling", choices=("weak", "strong"), default="weak",
                       help="weak: fixed per-device batch (default); strong: fixed global batch")
    bench.add_argument("--epochs", type=int, default=1, help="epochs timed per cell")
    bench.add_argument("--steps", type=int, default=None,
                       help="time N optimizer steps instead of whole epochs (epoch time then estimated)")
    bench.add_argument("--warmup-steps", type=int, default=5, help="untimed steps first in each cell")
    bench.add_argument("--timeout", type=float, default=900.0, help="seconds per cell before it is killed")
    bench.add_argument("--target-accuracy", type=float, default=None,
                       help="validation accuracy for the time-to-accuracy advice, e.g. 0.95")
    add_trainer_flags(bench, ["accelerator", "seed"], defaults={"seed": 0})
    bench.add_argument("--out", default=None, help="run directory (default runs/bench/version_N)")
    bench.add_argument("--resume", action="store_true", help="complete the sweep in --out (default: the newest), "
                                                             "skipping cells already recorded")
    bench.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    bench.add_argument("--plan", action="store_true",
                       help="also predict each cell with `trainscale plan --probe` and add predicted_epoch_time_s, "
                            "predicted_peak_bytes and predicted_error to results.csv and the table")
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return bench


def run(args: argparse.Namespace) -> int:
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
