"""``trainscale plan``: predicted memory per device and time per epoch (see :mod:`trainscale.plan`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

HELP = "will it fit, and how fast: memory per device and epoch time per strategy and device count"
DESCRIPTION = ("Predict, per strategy and device count, the bytes per device of parameters, gradients, optimizer "
               "state, activations and the peak (traced on fake tensors: nothing is allocated), whether it fits, and, "
               "given a link, the time per step and epoch, gain and efficiency from one measured device plus a "
               "communication model. Guide: docs/plan.md. Example: trainscale plan --devices 1,8,64 --batch-sizes 32 "
               "--device-memory 80GB --bandwidth 400GB/s,latency=10us")


def build_parser(prog: str = "trainscale plan"):
    """The options of ``trainscale plan``: the Trainer's flags from their declarations, then its own."""
    from trainscale.cli.flags import add_sweep_flag, add_trainer_flags, ints, new_parser

    plan = new_parser(prog, DESCRIPTION)
    plan.add_argument("--entry", default=None, metavar="PKG.MODULE:FUNCTION",
                      help="your workload, bench's contract (default: the ConvNet on MNIST-5k)")
    add_sweep_flag(plan, "devices", "device counts (default 1,2,4,8; with --gpu: nodes × gpus-per-node)", None,
                   element=int)
    plan.add_argument("--batch-sizes", type=ints, default=[32], help="per-device batch sizes")
    add_sweep_flag(plan, "strategy", "strategies, comma-separated", ["ddp", "fsdp"])
    add_trainer_flags(plan, ["precision"])
    plan.add_argument("--device-memory", default=None, metavar="SIZE",
                      help="memory per device, e.g. 80GB (default: the visible GPU's, else this machine's RAM)")
    plan.add_argument("--bandwidth", default=None, metavar="BW[,latency=T]",
                      help="bus bandwidth of the fabric, e.g. 400GB/s,latency=10us (nccl-tests' busbw)")
    plan.add_argument("--probe", action="store_true",
                      help="measure this machine: the link between 2 processes, then a short 2-process DDP run of "
                           "the workload (its step and its overlap of communication and backward)")
    plan.add_argument("--overlap", type=float, default=None,
                      help="share of backward that hides communication, 0..1 (default: measured by --probe's DDP "
                           "run, else 0: none, an upper bound)")
    plan.add_argument("--device-flops", type=float, default=None, metavar="FLOPS",
                      help="FLOP/s of a device you are not on, e.g. 989e12 (H100 SXM, dense bf16): compute time "
                           "from the step's counted FLOPs (a lower bound) instead of a run on this machine")
    plan.add_argument("--gpu", default=None, metavar="NAME",
                      help="a catalogue GPU you are not on (a100-40gb, a100-80gb, h100-sxm, h100-pcie, h100-hbm2e-500w, "
                           "h200, b200, l4, mi300x, v100): each traced operator costed on it, with an interval and the "
                           "constants' sources; its memory and links unless --device-memory/--bandwidth are given")
    plan.add_argument("--nodes", type=int, default=1, help="nodes of --gpu")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    plan.add_argument("--interconnect", default=None, metavar="NAME",
                      help="network between nodes, per GPU: ib-100, ib-200, ib-400, roce-100, roce-200, roce-400")
    plan.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    return plan


def run(args: argparse.Namespace) -> int:
    """Print the plan's tables; 0 when some configuration fits, 1 when none does."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # --entry modules are found in the current directory
    if args.bandwidth and args.probe:
        raise ValueError("give --bandwidth or --probe, not both")
    if args.gpu and (args.probe or args.device_flops):
        raise ValueError("--gpu models a GPU you are not on: give it without --probe and --device-flops")
    from trainscale.plan import plan

    devices = args.devices or ([args.nodes * args.gpus_per_node] if args.gpu else [1, 2, 4, 8])
    result = plan(entry=args.entry, devices=devices, batch_sizes=args.batch_sizes, strategies=args.strategy,
                  precision=args.precision, device_memory=args.device_memory, link=args.bandwidth,
                  probe=args.probe, overlap=args.overlap, device_flops=args.device_flops, gpu=args.gpu,
                  nodes=args.nodes, devices_per_node=args.gpus_per_node, interconnect=args.interconnect)
    print(result.table())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([r.as_dict() for r in result.rows], f, indent=2)
    return 0 if result.smallest() is not None else 1
