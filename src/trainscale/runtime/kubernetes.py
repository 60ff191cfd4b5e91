"""Kubernetes: reading the world of a pod started as ``python train.py``.

The operators start one container per pod and give it the pod's place in the job, not a rank per process:

- Kubeflow PyTorchJob (training-operator v1, pkg/controller.v1/pytorch/envvar.go and master.go):
  MASTER_ADDR and PET_MASTER_ADDR (the service of the master pod, ``<job>-master-0``), MASTER_PORT and
  PET_MASTER_PORT (the ``pytorchjob-port``, 23456 by default), RANK and PET_NODE_RANK (the pod's index:
  master 0, worker i → i + 1), PET_NNODES (the pods), PET_NPROC_PER_NODE (``nprocPerNode``: a count, or
  "auto", its default) and WORLD_SIZE = pods × nprocPerNode (× 1 when it is not a count). It expects the
  container to run ``torchrun``, which reads the PET_* variables as its flags. No LOCAL_RANK.
- Kubeflow TrainJob (Trainer v2, pkg/runtime/framework/plugins/torch/torch.go): PET_NNODES, PET_NPROC_PER_NODE
  (a count, "auto" or "gpu"), PET_NODE_RANK (the job completion index), PET_MASTER_ADDR and PET_MASTER_PORT
  (29400); no RANK or WORLD_SIZE.
- Volcano (the ``pytorch`` job plugin): MASTER_ADDR, MASTER_PORT (23456), WORLD_SIZE (the pods), RANK (the
  pod's index) and, as on every Volcano pod, VC_TASK_INDEX.
- Older PyTorchJob versions set MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK only; every pod has
  KUBERNETES_SERVICE_HOST.

trainscale reads them as a per-node launch (``World.per_node``): each pod runs its node's processes, one
(the pod's process is the rank: rank = node rank) or several (started with torchrun's static rendezvous
at the master address, ``launch.start_node_ranks``). Elastic PyTorchJobs (PET_RDZV_ENDPOINT) are left to
``torchrun`` in the container. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Mapping

from trainscale.runtime.world import launcher_error, read_int

KUBE_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PET_NNODES", "PET_NODE_RANK",
             "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_RDZV_ENDPOINT", "VC_TASK_INDEX",
             "KUBERNETES_SERVICE_HOST")
# torchrun's --nproc-per-node words: trainscale lets `devices` decide for each of them.
_NPROC_WORDS = ("auto", "cpu", "gpu")


def _kind(env: Mapping[str, str]) -> str | None:
    """Which operator started this pod's process, or None when it is not such a pod."""
    if "PET_NNODES" in env or "PET_NODE_RANK" in env:
        return "Kubeflow PyTorchJob pod" if "RANK" in env else "Kubeflow TrainJob pod"
    if "RANK" not in env or "WORLD_SIZE" not in env or "LOCAL_RANK" in env:
        return None  # a rank's own variables (torchrun's, Ray's): not a pod-level launch
    if "VC_TASK_INDEX" in env:
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
    seen = ", ".join(n for n in ("RANK", "WORLD_SIZE", "PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE",
                                 "VC_TASK_INDEX") if n in env)
    return dict(world_size=nodes * declared, rank=node_rank * declared, local_rank=0, local_world_size=declared,
                node_rank=node_rank, master_addr=addr, master_port=port, launcher="kubernetes",
                group_world_size=nodes, per_node=per_node,
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
