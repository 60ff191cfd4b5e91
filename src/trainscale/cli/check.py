"""``trainscale check``: the same K steps on 1 device and on N processes, compared (see :mod:`trainscale.check`)."""

from __future__ import annotations

import argparse
import os
import sys

EXIT_MISMATCH, EXIT_RUN_FAILED = 1, 3
HELP = ("is the N-device run learning the same thing as the 1-device run? loss and gradient norm compared step by "
        "step, causes named")
DESCRIPTION = ("Run K optimizer steps on 1 device and on N processes with the same seed, weights and samples (the same "
               "global batch; with --lr-scaling the same per-device batch and the lr scaled in the reference), compare "
               "loss, gradient norm, learning rate and samples step by step and the weights, validation metrics, "
               "buffers and eval outputs at the end; a difference beyond the tolerance is explained by the usual causes "
               "(unsynchronised BatchNorm, per-rank loss normalisation, LR not scaled, padding duplicates, means of "
               "means). --devices: the N-device run's (2 or more); --strategy: ddp or fsdp; --precision: 32-true "
               "(others need --rtol). Exit code 0: agree, 1: differ, 2: bad flags, 3: a run failed. Guide: "
               "docs/check.md. Example: trainscale check --devices 2 --strategy fsdp --steps 5")


def build_parser(prog: str = "trainscale check"):
    """The options of ``trainscale check``: the Trainer's flags from their declarations (the values ``check``
    accepts are checked there), then its own."""
    from trainscale.cli.flags import add_trainer_flags, new_parser

    check = new_parser(prog, DESCRIPTION)
    check.add_argument("--entry", default=None, metavar="PKG.MODULE:FUNCTION",
                       help="your workload, bench's contract plus an optional 'trainer' dict of Trainer flags "
                            "(default: the ConvNet on MNIST-5k without BatchNorm)")
    add_trainer_flags(check, ["accelerator", "devices", "strategy", "precision", "seed"],
                      defaults={"devices": 2, "strategy": "ddp", "seed": 0})
    check.add_argument("--steps", type=int, default=5, help="optimizer steps compared")
    check.add_argument("--batch-size", type=int, default=32,
                       help="global batch; with --lr-scaling the per-device batch")
    check.add_argument("--lr-scaling", default=None, choices=("linear", "sqrt"),
                       help="keep the per-device batch and expect the job's lr scaled to the global batch by this rule")
    check.add_argument("--rtol", type=float, default=None, help="relative tolerance (default 1e-4 for 32-true)")
    check.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it is killed")
    check.add_argument("--out", default=None, help="run directory (default runs/check/version_N)")
    return check


def run(args: argparse.Namespace) -> int:
    """Print the report; 0 when the runs agree, 1 when they differ, 3 when a run failed."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # --entry modules are found in the current directory
    from trainscale.check import CheckRunError, check

    try:
        result = check(args.entry, devices=args.devices, strategy=args.strategy, steps=args.steps,
                       batch_size=args.batch_size, lr_scaling=args.lr_scaling, precision=args.precision,
                       accelerator=args.accelerator, seed=args.seed, rtol=args.rtol, timeout=args.timeout,
                       out=args.out)
    except CheckRunError as err:
        print(f"trainscale check: {err}", file=sys.stderr)
        return EXIT_RUN_FAILED
    print(result.text)
    print(f"wrote {result.out / 'report.txt'}, {result.out / 'report.json'}")
    return 0 if result.passed else EXIT_MISMATCH
