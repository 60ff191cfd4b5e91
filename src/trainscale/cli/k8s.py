"""``trainscale k8s``: a Kubeflow PyTorchJob manifest for NODES pods × GPUS processes (nothing talks to a cluster)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    """Register ``trainscale k8s`` on the subcommand parsers ``sub`` (imports no torch)."""
    k8s = sub.add_parser(
        "k8s", help="write a Kubeflow PyTorchJob manifest: NODES pods x GPUS processes",
        description="Write a Kubeflow PyTorchJob (kubeflow.org/v1) that runs `python SCRIPT ARGS` in NODES pods; "
                    "trainscale reads the operator's variables and starts GPUS processes per pod with torchrun. Pods "
                    "restart on failure; a checkpoint volume (a ReadWriteMany claim) is mounted in every pod. Nothing "
                    "is sent to a cluster. Example: trainscale k8s --nodes 2 --gpus-per-node 8 --image "
                    "registry.example/team/train:1 -o job.yaml train.py --lr 1e-3; then: kubectl apply -f job.yaml")
    k8s.add_argument("--nodes", type=int, required=True, help="pods (machines)")
    k8s.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (processes) per pod")
    k8s.add_argument("--image", required=True, help="the container image holding torch, trainscale and the script")
    k8s.add_argument("--job-name", default="trainscale", help="the PyTorchJob's name, a DNS label (default trainscale)")
    k8s.add_argument("--cpus-per-node", type=int, default=None, help="CPU cores requested per pod (default 8 per GPU)")
    k8s.add_argument("--memory-per-node", default=None, metavar="QUANTITY", help="memory per pod, e.g. 200Gi")
    k8s.add_argument("--max-restarts", type=int, default=3, help="pod restarts before the job fails (default 3)")
    k8s.add_argument("--checkpoint-claim", default=None, metavar="NAME",
                     help="an existing PersistentVolumeClaim for checkpoints (default: the manifest creates "
                          "JOB_NAME-checkpoints, ReadWriteMany)")
    k8s.add_argument("--checkpoint-size", default="100Gi", help="size of the claim it creates (default 100Gi)")
    k8s.add_argument("--checkpoint-dir", default="/checkpoints", help="where pods mount it (default /checkpoints)")
    k8s.add_argument("--shm-size", default=None, metavar="QUANTITY",
                     help="sizeLimit of the memory-backed /dev/shm in each pod (default 16Gi; it counts against the "
                          "pod's memory)")
    k8s.add_argument("--cpu", action="store_true", help="request no GPU (GPUS CPU processes per pod)")
    k8s.add_argument("--python", default="python", help="the Python in the image (default python)")
    k8s.add_argument("-o", "--output", default="-", help="file to write (default: standard output)")
    k8s.add_argument("script", help="the training script (its path in the image)")
    k8s.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    k8s.set_defaults(func=run_k8s)


def run_k8s(args: argparse.Namespace) -> int:
    from trainscale.runtime.kubernetes import SHM_SIZE, pytorchjob_manifest, to_yaml

    docs = pytorchjob_manifest([args.python, args.script, *args.script_args], nodes=args.nodes,
                               gpus_per_node=args.gpus_per_node, image=args.image, job_name=args.job_name,
                               cpus_per_node=args.cpus_per_node, memory=args.memory_per_node, cpu=args.cpu,
                               max_restarts=args.max_restarts, checkpoint_claim=args.checkpoint_claim,
                               checkpoint_size=args.checkpoint_size, checkpoint_dir=args.checkpoint_dir,
                               shm_size=SHM_SIZE if args.shm_size is None else args.shm_size)
    claim = args.checkpoint_claim or f"{args.job_name}-checkpoints"
    text = to_yaml(docs, (f"Checkpoints: the claim {claim} is mounted at {args.checkpoint_dir} in every pod; have the "
                          f"script write there (Trainer(default_root_dir='{args.checkpoint_dir}/runs')) and resume with "
                          "fit(..., ckpt_path='last') after a restart.",))
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    from trainscale.cli.output_file import check_output_file
    from trainscale.runtime.kubernetes import MANIFEST_MARK

    check_output_file(args.output, args.script, MANIFEST_MARK, "trainscale k8s", "job.yaml")
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.output}: PyTorchJob {args.job_name}, {args.nodes} pod(s) × {args.gpus_per_node} "
          f"process(es); submit with: kubectl apply -f {args.output}")
    return 0
