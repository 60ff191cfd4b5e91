"""Kubernetes: reading the world of a pod started as ``python train.py``.

The operators start one container per pod and give it the pod's place in the job, not a rank per process:

- Kubeflow PyTorchJob (training-operator v1, pkg/controller.v1/pytorch/envvar.go and master.go):
  MASTER_ADDR and PET_MASTER_ADDR (the service of the master pod, ``<job>-master-0``), MASTER_PORT and
  PET_MASTER_PORT (the ``pytorchjob-port``, 23456 by default), RANK and PET_NODE_RANK (the pod's index:
  master 0, worker i → i + 1), PET_NNODES (the pods), PET_NPROC_PER_NODE (``nprocPerNode``: a count, or
  "auto", its default) and WORLD_SIZE = pods × nprocPerNode (× 1 when it is not a count). It expects the
  container to run ``torchrun``, which reads the PET_* variables as its flags. No LOCAL_RANK.
- Kubeflow TrainJob (Trainer v2, pkg/runtime/framework/plugins/torch/torch.go): PET_NNODES, PET_NPROC_PER_NODE
  (a count, "auto" or "gpu"), PET_NODE_RANK (the job completion index), PET_MASTER_ADDR
  (``<job>-node-0-0.<job>``) and PET_MASTER_PORT (``constants.ContainerTrainerPort``, 29500); no RANK or
  WORLD_SIZE. With numProcPerNode "auto" (its default) on a pod whose resources name no GPU, the operator writes
  the pod's CPU count as PET_NPROC_PER_NODE: on CPU that count is what the operator read off the pod, not a
  request of processes, so an explicit ``devices`` wins over it (``World.per_node_may_be_cpus``).
- Volcano (the ``pytorch`` job plugin, pkg/controllers/job/plugins/distributed-framework/pytorch): MASTER_ADDR,
  MASTER_PORT (23456), WORLD_SIZE (the pods), RANK (the pod's index). The ``svc`` plugin it runs with gives every
  pod VC_<TASK>_HOSTS and VC_<TASK>_NUM for each task (plugins/svc/const.go); VC_TASK_INDEX comes only with the
  ``env`` plugin.
- Older PyTorchJob versions set MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK only; every pod has
  KUBERNETES_SERVICE_HOST.

trainscale reads them as a per-node launch (``World.per_node``): each pod runs its node's processes, one
(the pod's process is the rank: rank = node rank) or several (started with torchrun's static rendezvous
at the master address, ``launch.start_node_ranks``). Elastic PyTorchJobs (PET_RDZV_ENDPOINT) are left to
``torchrun`` in the container. Nothing here imports torch.
"""

from __future__ import annotations

import re
from typing import Mapping

from trainscale.runtime.world import launcher_error, read_int

KUBE_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PET_NNODES", "PET_NODE_RANK",
             "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_RDZV_ENDPOINT", "VC_TASK_INDEX",
             "KUBERNETES_SERVICE_HOST")
# torchrun's --nproc-per-node words: trainscale lets `devices` decide for each of them.
_NPROC_WORDS = ("auto", "cpu", "gpu")


TRAINJOB = "Kubeflow TrainJob pod"
_VOLCANO_HOSTS = re.compile(r"VC_[A-Z0-9_]+_HOSTS")  # the svc plugin's VC_<TASK>_HOSTS


def _kind(env: Mapping[str, str]) -> str | None:
    """Which operator started this pod's process, or None when it is not such a pod."""
    if "PET_NNODES" in env or "PET_NODE_RANK" in env:
        if "RANK" in env or "PET_RDZV_ENDPOINT" in env:  # v1 sets RANK, and PET_RDZV_* when elastic
            return "Kubeflow PyTorchJob pod"
        if all(n in env for n in ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR")):  # Trainer v2 sets all three
            return TRAINJOB
        return "pod with torchrun's PET_* variables"
    if "RANK" not in env or "WORLD_SIZE" not in env or "LOCAL_RANK" in env:
        return None  # a rank's own variables (torchrun's, Ray's): not a pod-level launch
    if "VC_TASK_INDEX" in env or any(_VOLCANO_HOSTS.fullmatch(name) for name in env):
        return "Volcano pod"
    if "KUBERNETES_SERVICE_HOST" in env:
        return "Kubernetes pod"
    return None


def read(env: Mapping[str, str]) -> dict | None:
    """The World fields of a pod's process (a per-node launch), or None when this is not one.

    Raises:
        ValueError: an elastic PyTorchJob, a missing rendezvous address on several pods, or variables that
            disagree (RANK against PET_NODE_RANK, WORLD_SIZE against PET_NNODES × PET_NPROC_PER_NODE).
    """
    kind = _kind(env)
    if kind is None:
        return None
    pod = _Pod(env, kind)
    nodes, node_rank = pod.nodes_and_rank()
    per_node = pod.per_node()
    declared = int(per_node) if per_node.isdigit() else 1
    if "WORLD_SIZE" in env and "PET_NNODES" in env and pod.int("WORLD_SIZE") != nodes * declared:
        raise pod.error(f"WORLD_SIZE={env['WORLD_SIZE']} but PET_NNODES × PET_NPROC_PER_NODE = {nodes} × "
                        f"{env.get('PET_NPROC_PER_NODE', 1)}: the pods would not agree on the job's size")
    addr, port = pod.rendezvous(nodes)
    names = ("RANK", "WORLD_SIZE", "PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "VC_TASK_INDEX")
    seen = ", ".join([*(f"{n}={env[n]}" for n in names if n in env),
                      *sorted(f"{n}={env[n]}" for n in env if _VOLCANO_HOSTS.fullmatch(n))])
    return dict(world_size=nodes * declared, rank=node_rank * declared, local_rank=0, local_world_size=declared,
                node_rank=node_rank, master_addr=addr, master_port=port, launcher="kubernetes",
                group_world_size=nodes, per_node=per_node, per_node_may_be_cpus=kind == TRAINJOB,
                detected_from=f"{seen} without LOCAL_RANK (a {kind}: one process per pod)")


class _Pod:
    """The variables of one pod's process, read with errors that name the operator assumed."""

    def __init__(self, env: Mapping[str, str], kind: str) -> None:
        self.env, self.launcher = env, f"kubernetes ({kind})"

    def error(self, problem: str) -> ValueError:
        return launcher_error(self.launcher, self.env, KUBE_VARS, problem)

    def int(self, name: str, default: int | None = None) -> int:
        return read_int(self.env, name, self.launcher, KUBE_VARS, default)

    def nodes_and_rank(self) -> tuple[int, int]:
        """(pods, this pod's index): PET_NNODES / PET_NODE_RANK, else (Volcano, older PyTorchJobs) WORLD_SIZE / RANK."""
        env = self.env
        if "PET_RDZV_ENDPOINT" in env and "PET_NODE_RANK" not in env:
            raise self.error("an elastic PyTorchJob (PET_RDZV_ENDPOINT) gives no node rank: run the container's "
                             "command as `torchrun train.py ...`, which reads the operator's PET_* variables as "
                             "its flags")
        if ":" in env.get("PET_NNODES", ""):
            raise self.error("PET_NNODES is an elastic range: run the container's command as `torchrun train.py ...`")
        nodes = self.int("PET_NNODES") if "PET_NNODES" in env else self.int("WORLD_SIZE")
        node_rank = self.int("PET_NODE_RANK") if "PET_NODE_RANK" in env else self.int("RANK")
        if "RANK" in env and "PET_NODE_RANK" in env and self.int("RANK") != node_rank:
            raise self.error(f"RANK={env['RANK']} and PET_NODE_RANK={node_rank} disagree (both are the pod's index)")
        if not 0 <= node_rank < nodes:
            raise self.error(f"the pod's index {node_rank} must lie in [0, {nodes}) (the job's pods)")
        return nodes, node_rank

    def per_node(self) -> str:
        """PET_NPROC_PER_NODE as a count ("2"), or "auto" for torchrun's words and when it is not set."""
        value = self.env.get("PET_NPROC_PER_NODE", "auto").strip().lower() or "auto"
        if value in _NPROC_WORDS:
            return "auto"
        if not value.isdigit() or int(value) < 1:
            raise self.error(f"PET_NPROC_PER_NODE={value!r} must be a count >= 1 or one of {', '.join(_NPROC_WORDS)}")
        return value

    def rendezvous(self, nodes: int) -> tuple[str, int]:
        """The first pod's host and port: PET_MASTER_ADDR/PORT (torchrun's), else MASTER_ADDR/PORT; required
        on several pods."""
        addr = self.env.get("PET_MASTER_ADDR") or self.env.get("MASTER_ADDR")
        port = "PET_MASTER_PORT" if self.env.get("PET_MASTER_PORT") else "MASTER_PORT"
        if nodes > 1 and (not addr or not self.env.get(port)):
            raise self.error(f"{nodes} pods but no rendezvous address: MASTER_ADDR/PET_MASTER_ADDR and "
                             "MASTER_PORT/PET_MASTER_PORT must name the first pod's host and port")
        return addr or "127.0.0.1", self.int(port, 29500)


# -- trainscale k8s: a PyTorchJob manifest ---------------------------------------------------------------------
MANIFEST_MARK = "# Written by `trainscale k8s`"
# A DNS-1123 label short enough for the operator's "<name>-worker-<index>" pod and service names (63 at most).
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
PYTORCHJOB_PORT = 23456  # the operator's default port of the container port "pytorchjob-port"
SHM_SIZE = "16Gi"  # /dev/shm's sizeLimit: room for DataLoader workers' batches and NCCL's buffers, and a bound


def pytorchjob_manifest(command: list[str], *, nodes: int, gpus_per_node: int, image: str,
                        job_name: str = "trainscale", cpus_per_node: int | None = None, memory: str | None = None,
                        cpu: bool = False, max_restarts: int = 3, checkpoint_claim: str | None = None,
                        checkpoint_size: str = "100Gi", checkpoint_dir: str = "/checkpoints",
                        shm_size: str = SHM_SIZE) -> list[dict]:
    """The Kubernetes objects of a job on ``nodes`` pods × ``gpus_per_node`` processes: a Kubeflow PyTorchJob
    (kubeflow.org/v1), preceded by its checkpoint volume's PersistentVolumeClaim unless ``checkpoint_claim``
    names an existing one.

    Each pod runs ``command`` (``python train.py ...``) in the container "pytorch" with the port
    "pytorchjob-port" (the operator looks both up by name); trainscale reads the operator's variables
    (``read``) and starts ``nprocPerNode`` processes per pod with torchrun. Pods restart ``OnFailure``, at most
    ``max_restarts`` times (``runPolicy.backoffLimit``). The claim (ReadWriteMany: every pod writes to it) is
    mounted at ``checkpoint_dir``; /dev/shm is a memory volume of at most ``shm_size`` (DataLoader workers and
    NCCL use it, and a container's default is 64 MiB; without a limit it could fill the node's memory when the
    pod has no memory limit, and what it holds counts against the pod's memory). With ``cpu=True`` the pods ask
    for no GPU and run ``gpus_per_node`` CPU processes.

    Raises:
        ValueError: non-positive counts, an empty command, program or image, a name that is not a DNS label, a
            size that is not a Kubernetes quantity or is zero, or a relative ``checkpoint_dir``.
    """
    _check_manifest_flags(command, nodes, gpus_per_node, image, job_name, cpus_per_node, memory, max_restarts,
                          checkpoint_claim, checkpoint_size, checkpoint_dir, shm_size)
    claim = checkpoint_claim or f"{job_name}-checkpoints"
    limits = {} if cpu else {"nvidia.com/gpu": gpus_per_node}
    default_cpus = gpus_per_node if cpu else 8 * gpus_per_node
    requests = {"cpu": str(default_cpus if cpus_per_node is None else cpus_per_node)}
    if memory:
        requests["memory"] = limits["memory"] = memory
    container = {"name": "pytorch", "image": image, "command": list(command),
                 "ports": [{"name": "pytorchjob-port", "containerPort": PYTORCHJOB_PORT}],
                 "resources": {"requests": requests, **({"limits": limits} if limits else {})},
                 "volumeMounts": [{"name": "checkpoints", "mountPath": checkpoint_dir},
                                  {"name": "dshm", "mountPath": "/dev/shm"}]}
    template = {"spec": {"containers": [container],
                         "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}},
                                     {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}}]}}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if nodes > 1:
        replicas["Worker"] = {"replicas": nodes - 1, "restartPolicy": "OnFailure", "template": template}
    labels = {"app.kubernetes.io/name": job_name, "app.kubernetes.io/managed-by": "trainscale"}
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": job_name, "labels": labels},
           "spec": {"nprocPerNode": str(gpus_per_node), "runPolicy": {"backoffLimit": max_restarts},
                    "pytorchReplicaSpecs": replicas}}
    if checkpoint_claim:
        return [job]
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "labels": labels},
           "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": checkpoint_size}}}}
    return [pvc, job]


def _check_manifest_flags(command, nodes, gpus_per_node, image, job_name, cpus_per_node, memory, max_restarts,
                          checkpoint_claim, checkpoint_size, checkpoint_dir, shm_size) -> None:
    counts = {"--nodes": nodes, "--gpus-per-node": gpus_per_node,
              "--cpus-per-node": 1 if cpus_per_node is None else cpus_per_node}
    bad = [f"{flag} {value}" for flag, value in counts.items() if value < 1]
    if bad or max_restarts < 0:
        raise ValueError(f"{', '.join(bad) or f'--max-restarts {max_restarts}'}: counts must be >= 1 "
                         "(--max-restarts >= 0)")
    if not command:
        raise ValueError("no command: pass the training script and its arguments, e.g. train.py --lr 1e-3")
    if not command[0].strip():
        raise ValueError("--python '' names no program: give the Python in the image, e.g. python or /opt/venv/bin/python")
    if not image.strip() or any(c.isspace() for c in image):
        raise ValueError(f"--image {image!r} must name a container image (registry/name:tag), without spaces")
    _check_names({"--job-name": job_name, "--checkpoint-claim": checkpoint_claim},
                 {"--checkpoint-size": checkpoint_size, "--memory-per-node": memory, "--shm-size": shm_size})
    if not checkpoint_dir.startswith("/"):
        raise ValueError(f"--checkpoint-dir {checkpoint_dir!r} must be an absolute path in the container")


def _check_names(names: dict, sizes: dict) -> None:
    """DNS labels and Kubernetes quantities (None: not given)."""
    for flag, name in names.items():
        if name is not None and not _NAME.fullmatch(name):
            raise ValueError(f"{flag} {name!r} must be a DNS label of at most 40 characters: lowercase letters, "
                             "digits and '-', starting and ending with a letter or digit")
    for flag, size in sizes.items():
        if size is not None and not _QUANTITY.fullmatch(size):
            raise ValueError(f"{flag} {size!r} is not a Kubernetes quantity, e.g. 100Gi or 512Mi")
        if size is not None and float(re.match(r"[0-9.]+", size).group()) == 0:
            raise ValueError(f"{flag} {size!r} is zero: give a size, e.g. 100Gi or 512Mi")


def to_yaml(documents: list[dict], comments: tuple[str, ...] = ()) -> str:
    """The documents as YAML, written by PyYAML's safe dumper (block style, keys in the manifest's order, no
    aliases, no line folding) with every string value double-quoted: Kubernetes reads manifests with a YAML 1.2
    parser, for which a plain ``1e-3`` or ``0o17`` in a command line is a number. After :data:`MANIFEST_MARK` (how
    ``trainscale k8s -o`` recognises a file of its own) and ``comments``."""
    import yaml

    class ManifestDumper(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:
            return True

        def represent_mapping(self, tag, mapping, flow_style=None):
            node = super().represent_mapping(tag, mapping, flow_style)
            for key, _ in node.value:
                key.style = None  # keys plain: only values are quoted
            return node

    ManifestDumper.add_representer(
        str, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"'))
    head = [f"{MANIFEST_MARK}. Submit it with `kubectl apply -f FILE` (the Kubeflow training operator runs it).",
            *(f"# {line}" for line in comments)]
    body = yaml.dump_all(documents, Dumper=ManifestDumper, sort_keys=False, explicit_start=True,
                         default_flow_style=False, allow_unicode=True, width=1 << 30)
    return "\n".join(head) + "\n" + body
