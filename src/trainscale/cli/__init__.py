"""The ``trainscale`` command: run | demo | bench | plan | check | report | export | slurm | k8s | env.

Parsing imports nothing heavy: ``trainscale --help`` never imports torch. Each subcommand imports what it needs
when it runs. The commands that take the Trainer's flags (:data:`DECLARED`) parse with jsonargparse, their options
generated from the flag declarations (:mod:`trainscale.cli.flags`); the others with argparse.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainscale.cli.lightning_cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

__all__ = ["LightningCLI", "LightningArgumentParser", "SaveConfigCallback", "main", "build_parser"]

# Commands whose options are generated from the Trainer's flag declarations: module with HELP, build_parser, run.
DECLARED = {"demo": "trainscale.cli.demo", "bench": "trainscale.cli.bench", "plan": "trainscale.cli.plan",
            "check": "trainscale.cli.check"}


def __getattr__(name: str):
    if name in ("LightningCLI", "LightningArgumentParser", "SaveConfigCallback"):  # on first use: `trainscale --help`
        # reads no declaration
        from trainscale.cli import lightning_cli

        return getattr(lightning_cli, name)
    raise AttributeError(f"module 'trainscale.cli' has no attribute {name!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainscale",
        description="Scale a PyTorch training job from one device to many, and measure what it buys.")
    from trainscale import __version__

    parser.add_argument("--version", action="version", version=f"trainscale {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    run = sub.add_parser("run", help="run a script on N processes per node under torchrun", allow_abbrev=False,
                         description="Start SCRIPT on N processes (per node) with torchrun "
                                     "(python -m torch.distributed.run). Example: trainscale run -n 2 train.py --lr 1e-3")
    run.add_argument("-n", "--nproc-per-node", type=int, default=1, metavar="N",
                     help="processes on this node: one per GPU, or CPU processes (default 1)")
    run.add_argument("--nnodes", default="1", help="nodes in the job, N or MIN:MAX for elastic jobs (default 1)")
    run.add_argument("--node-rank", type=int, default=None, help="this node's rank (static rendezvous)")
    run.add_argument("--rdzv-backend", default=None, help="rendezvous backend (default c10d)")
    run.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                     help="rendezvous address, the same on every node (required for several nodes)")
    run.add_argument("--rdzv-id", default=None, help="job id shared by all nodes")
    run.add_argument("--max-restarts", type=int, default=0, help="restart failed workers up to this many times")
    run.add_argument("script", help="the Python script to run")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(func=_cmd_run)

    for name, module in DECLARED.items():  # their options come from the flag declarations: see main
        sub.add_parser(name, help=importlib.import_module(module).HELP, add_help=False)
    slurm = sub.add_parser("slurm", help="write an sbatch script: NODES x GPUS tasks launched by srun",
                           description="Write an sbatch script that runs SCRIPT on --nodes × --gpus-per-node tasks "
                                       "(srun, one task per GPU), checkpoints on SIGUSR1 90 s before the time limit and "
                                       "requeues itself. Example: trainscale slurm --nodes 2 --gpus-per-node 8 "
                                       "-o train.sbatch train.py --lr 1e-3; then: sbatch train.sbatch")
    slurm.add_argument("--nodes", type=int, required=True, help="machines")
    slurm.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (tasks) per machine")
    slurm.add_argument("--time", default="04:00:00",
                       help="time limit in SLURM's formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS "
                            "(default 04:00:00)")
    slurm.add_argument("--cpus-per-task", type=int, default=8, help="CPU cores per task (default 8)")
    slurm.add_argument("--partition", default=None, help="SLURM partition")
    slurm.add_argument("--account", default=None, help="SLURM account to charge")
    slurm.add_argument("--job-name", default="trainscale", help="job name (default trainscale)")
    slurm.add_argument("--signal-seconds", type=int, default=90,
                       help="send SIGUSR1 this long before the time limit (default 90)")
    slurm.add_argument("--cpu", action="store_true", help="request no GPU (CPU processes)")
    slurm.add_argument("--python", default="python", help="the Python on the nodes (default python)")
    slurm.add_argument("-o", "--output", default="-", help="file to write (default: standard output)")
    slurm.add_argument("script", help="the training script")
    slurm.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    slurm.set_defaults(func=_cmd_slurm)

    from trainscale.cli.k8s import add_parser as _add_k8s  # imports no torch

    _add_k8s(sub)
    report = sub.add_parser("report", help="plots and a text summary of a run directory",
                            description="Write report.txt and PNG plots (loss and accuracy, throughput, step-phase "
                                        "split, memory per rank, GPU utilisation; the plots need matplotlib: pip "
                                        "install 'trainscale[plot]') into RUN_DIR, and print where the time goes. "
                                        "Example: trainscale report runs/demo/version_0")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run directory holding metrics.jsonl")
    report.add_argument("--baseline", metavar="RUN_DIR_1", default=None,
                        help="the run directory of the same job on fewer devices (normally one): adds the speed-up "
                             "account, where the gap between the ideal and the measured step went")
    report.set_defaults(func=_cmd_report)

    export = sub.add_parser("export", help="write a checkpoint's model as a Hugging Face directory (safetensors)",
                            description="Write the model of a trainscale checkpoint (a file from single/ddp, or a "
                                        "sharded directory from fsdp/hsdp/tp) to OUT as config.json and safetensors "
                                        "files, which transformers' from_pretrained(OUT) loads. Needs: pip install "
                                        "'trainscale[hf]'. Example: trainscale export runs/version_0/checkpoints/last "
                                        "--format safetensors my-model")
    export.add_argument("checkpoint", metavar="CKPT", help="a checkpoint file or directory, or a run's checkpoints/last")
    export.add_argument("out", metavar="OUT", help="the directory to write (new, or empty)")
    export.add_argument("--format", default="safetensors", choices=("safetensors",),
                        help="safetensors: a Hugging Face model directory (default)")
    export.add_argument("--config", default=None, metavar="PATH",
                        help="config.json (or a directory holding one) to write with the weights; default: the "
                             "config the checkpoint holds (saved when the model was a transformers model)")
    export.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="a tokenizer directory (tokenizer.save_pretrained's, or the model directory it came "
                             "with) to write beside the weights")
    export.add_argument("--max-shard-size", default="50GB", metavar="SIZE",
                        help="the largest safetensors file, e.g. 5GB or a byte count; larger models are split, with "
                             "model.safetensors.index.json (default: 50GB, save_pretrained's)")
    export.add_argument("--no-verify", action="store_true",
                        help="do not check the checkpoint's SHA-256 files (one you trust that has none)")
    export.set_defaults(func=_cmd_export)

    env = sub.add_parser("env", help="print what this machine offers: versions, devices, backends, and the launcher "
                                      "detected (and why)")
    env.set_defaults(func=_cmd_env)
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    from trainscale.runtime import launch

    torchrun = launch.torchrun_args(args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
                                    rdzv_backend=args.rdzv_backend, rdzv_endpoint=args.rdzv_endpoint,
                                    max_restarts=args.max_restarts, run_id=args.rdzv_id)
    entry = [args.script, *args.script_args]
    launch.check_entry(entry)
    if args.rdzv_endpoint is not None:
        launch.check_rendezvous(args.rdzv_endpoint)
        print(f"trainscale run: waiting at the rendezvous {args.rdzv_endpoint} for {args.nnodes} node(s) "
              f"(job id {args.rdzv_id or 'none'}); start the same command on every node", file=sys.stderr, flush=True)
    return launch.run_torchrun(torchrun, entry, args.nproc_per_node, args.max_restarts)


def _cmd_slurm(args: argparse.Namespace) -> int:
    from trainscale.cli.output_file import check_output_file
    from trainscale.runtime.slurm import SBATCH_MARK, sbatch_script

    if not args.python.strip():
        raise ValueError("--python '' names no command: pass the Python on the nodes, e.g. --python python3 or "
                         "--python /opt/venv/bin/python")
    text = sbatch_script([args.python, args.script, *args.script_args], nodes=args.nodes,
                         gpus_per_node=args.gpus_per_node, job_name=args.job_name, time=args.time,
                         cpus_per_task=args.cpus_per_task, partition=args.partition,
                         signal_seconds=args.signal_seconds, cpu=args.cpu, account=args.account)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        check_output_file(args.output, args.script, SBATCH_MARK, "trainscale slurm", "job.sbatch")
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.output}: {args.nodes} node(s) × {args.gpus_per_node} task(s); submit with: "
              f"sbatch {args.output}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from trainscale.telemetry.report import PLOTS_SKIPPED, make_report

    written, text = make_report(args.run_dir, baseline=args.baseline)  # ValueError: main's one-line error
    print(text, end="")
    print("wrote " + ", ".join(str(p) for p in written))
    if not any(p.suffix == ".png" for p in written):
        print(PLOTS_SKIPPED)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from trainscale.export import export
    from trainscale.runtime.checkpoint_io import CheckpointError

    try:
        size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
        out = export(args.checkpoint, args.out, format=args.format, config=args.config, verify=not args.no_verify,
                     tokenizer=args.tokenizer, max_shard_size=size)
    except (FileNotFoundError, ModuleNotFoundError, CheckpointError) as err:
        print(f"trainscale export: error: {err}", file=sys.stderr)
        return 1
    architecture = json.loads((Path(out) / "config.json").read_text()).get("architectures", ["AutoModel"])[0]
    print(f"wrote {out}: load it with transformers.{architecture}.from_pretrained({str(out)!r})")
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    from trainscale.cli.env import print_env

    print_env()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DECLARED:
        command = importlib.import_module(DECLARED[argv[0]])
        args, func = command.build_parser(f"trainscale {argv[0]}").parse_args(argv[1:]), command.run
    else:
        args = build_parser().parse_args(argv)
        func = args.func
    try:
        return func(args)
    except ValueError as err:  # bad flags: a clear one-line error, not a traceback
        print(f"trainscale {argv[0]}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
