"""The process world: who this process is in a distributed job, read once from the launcher's environment.

One small reader per launcher, tried in this order; the first that recognises its launcher gives the World.
A reader that recognises its launcher but finds the variables incomplete or in conflict raises ``ValueError``
naming the launcher it assumed and the variables it saw (docs/clusters.md puts them side by side):

1. torchrun / TorchElastic: TORCHELASTIC_RUN_ID, which torchrun's agent sets for each worker beside RANK,
   WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
   (https://pytorch.org/docs/stable/elastic/run.html#environment-variables). A torchrun started inside
   any other launcher's job wins over it.
2. SLURM (``slurm.read``): tasks started by ``srun``, unless their variables are those of an ``mpirun``'s
   daemons or of a launcher that sets RANK/WORLD_SIZE itself (Ray, DeepSpeed) inside the allocation.
3. Kubernetes (``kubernetes.read``): a pod of a Kubeflow PyTorchJob or TrainJob, or of a Volcano job,
   started as ``python train.py`` (one process per pod, which starts the pod's ranks when it has several).
4. MPI (``mpi.read``): ``mpirun``/``mpiexec`` of Open MPI, MPICH/Intel MPI and MVAPICH.
5. LSF (``lsf.read``): ``jsrun``.
6. Ray Train: RANK, WORLD_SIZE, LOCAL_RANK... in a Ray worker (RAY_RAYLET_PID); Ray creates the process
   group itself.
7. torchrun's variables set by another program (DeepSpeed's launcher, a script of one's own): RANK,
   WORLD_SIZE and LOCAL_RANK, with MASTER_ADDR and MASTER_PORT.
8. None of them: a world of one process. WORLD_SIZE > 1 or RANK alone is refused rather than trained
   as one process.

Nothing here imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

# Variables a reader names when it finds its launcher's environment incomplete.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def launcher_error(launcher: str, env: Mapping[str, str], names, problem: str) -> ValueError:
    """One clear error: the problem, the launcher assumed and the variables seen (of ``names``)."""
    seen = " ".join(f"{n}={env[n]}" for n in names if n in env) or "none of " + ", ".join(names)
    return ValueError(f"{problem} [launcher assumed: {launcher}; variables seen: {seen}]")


def launcher_variables(env: Mapping[str, str]) -> str:
    """``NAME=value`` of every launcher variable set in ``env`` (each reader's names), for errors that must show
    what the launcher set rather than what trainscale computed from it."""
    from trainscale.runtime import kubernetes, lsf, mpi, slurm

    names = dict.fromkeys((*TORCHRUN_VARS, *slurm.SLURM_VARS, *kubernetes.KUBE_VARS,
                           *(name for flavour in mpi.FLAVOURS for name in flavour[1:]), *lsf.LSF_VARS))
    return " ".join(f"{n}={env[n]}" for n in names if n in env) or "none"


def read_int(env: Mapping[str, str], name: str, launcher: str, names, default: int | None = None) -> int:
    """``env[name]`` as an int; ``default`` when it is unset or empty (None: required).

    Raises:
        ValueError: missing (without a default) or not an integer, naming the launcher and the variables.
    """
    raw = env.get(name)
    if raw in (None, ""):
        if default is None:
            raise launcher_error(launcher, env, names, f"{name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise launcher_error(launcher, env, names, f"{name}={raw!r} is not an integer") from None


def port_from_job_id(job_id: str | None) -> int:
    """A rendezvous port every process of a job computes alike from its id: ``15000 + id % 20000`` for a
    numeric id (two jobs on one node then rarely collide), else torch's default 29500."""
    return 15000 + int(job_id) % 20000 if job_id and job_id.isdigit() else 29500


def _job_id(env: Mapping[str, str]) -> str | None:
    """torchrun's run id. Its "none" (torchrun's default without ``--rdzv-id`` on several nodes) is shared
    by every such job, so SLURM's job id replaces it when there is one (``trainscale run`` always passes
    an id on several nodes: ``launch.torchrun_args``)."""
    run_id = env.get("TORCHELASTIC_RUN_ID") or None
    if run_id in (None, "none"):
        return env.get("SLURM_JOB_ID") or run_id
    return run_id


@dataclass(frozen=True)
class World:
    """A frozen value describing this process's place in the job.

    Attributes:
        world_size: number of processes in the job (all nodes).
        rank: global rank of this process, ``0 <= rank < world_size``.
        local_rank: rank among the processes of this node; indexes the device this rank owns.
        local_world_size: number of processes on this node.
        node_rank: index of this node (torchrun's GROUP_RANK).
        master_addr, master_port: rendezvous address of rank 0's store.
        restart_count: how many times the job was restarted (torchrun's TORCHELASTIC_RESTART_COUNT,
            SLURM's SLURM_RESTART_COUNT after a requeue).
        launcher: "torchrun", "slurm", "kubernetes", "mpi", "lsf", "ray", "env" (torchrun's variables set by
            another program) or "none".
        job_id: an id shared by every attempt of the job (TORCHELASTIC_RUN_ID, SLURM_JOB_ID, ...), or None.
        group_world_size: the launcher's count of nodes (torchrun's GROUP_WORLD_SIZE: agents; SLURM: the
            nodes of the step), or None: then ``num_nodes`` assumes every node runs ``local_world_size``.
        per_node: None when this process is a rank. Otherwise the launcher started one process per node
            (a Kubernetes pod run as ``python train.py``) and gave this as the processes of a node: a count
            ("2"), or "auto" (the job's ``devices`` decide). Such a process is the node's only rank when the
            node runs one (then ``rank == node_rank``), else it starts the node's ranks with torchrun
            (``launch.start_node_ranks``); ``rank`` and ``local_rank`` are then those of the node's first rank.
        per_node_may_be_cpus: ``per_node``'s count may be the pod's CPU count rather than a number of processes
            asked for (a Kubeflow TrainJob writes it there for numProcPerNode "auto" on a pod without GPUs): on
            CPU an explicit ``devices`` then wins over it.
        detected_from: which variables made the reader choose the launcher, for ``trainscale env`` and errors.
    """

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    restart_count: int = 0
    launcher: str = "none"
    job_id: str | None = None
    group_world_size: int | None = None
    per_node: str | None = None
    per_node_may_be_cpus: bool = field(default=False, compare=False)
    detected_from: str = field(default="no launcher variable is set", compare=False)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        """Nodes in the job: the launcher's count; without one, ``world_size // local_world_size``, which
        is wrong when nodes run different numbers of processes (8 GPUs on one node, 4 on another)."""
        if self.group_world_size is not None:
            return self.group_world_size
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def declared_per_node(self) -> int | None:
        """The processes per node a per-node launcher asked for (``per_node`` as a count), else None."""
        return int(self.per_node) if self.per_node is not None and self.per_node.isdigit() else None

    def node_ranks(self, nproc: int, cpu: bool = False) -> "World":
        """This node's first rank when each node of a per-node launch (``per_node``) runs ``nproc`` ranks:
        still ``per_node`` (this process starts them) when ``nproc > 1``, else this process is the rank.
        ``cpu``: the processes run on CPU (where a count that may be the pod's CPUs does not bind).

        Raises:
            ValueError: ``nproc`` differs from the count the launcher gave (``per_node``).
        """
        declared = self.declared_per_node
        if declared is not None and nproc != declared and not (cpu and self.per_node_may_be_cpus):
            raise ValueError(f"the launcher asked for {declared} process(es) per node ({self.detected_from}) but "
                             f"devices={nproc}; pass devices={declared} or devices='auto'")
        nodes = self.num_nodes
        return World(world_size=nodes * nproc, rank=self.node_rank * nproc, local_rank=0, local_world_size=nproc,
                     node_rank=self.node_rank, master_addr=self.master_addr, master_port=self.master_port,
                     restart_count=self.restart_count, launcher=self.launcher, job_id=self.job_id,
                     group_world_size=nodes, per_node=str(nproc) if nproc > 1 else None,
                     detected_from=self.detected_from)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "World":
        """Read the world from ``env`` (default ``os.environ``): the first launcher that recognises it, in
        the order of this module's docstring.

        Raises:
            ValueError: a launcher's variables incomplete or inconsistent (e.g. RANK >= WORLD_SIZE), or
                WORLD_SIZE > 1 / RANK set with no launcher that explains them; the message names the
                launcher assumed and the variables seen.
        """
        env = os.environ if env is None else env
        for read in _readers():
            fields = read(env)
            if fields is not None:
                world = cls(**fields)
                world._check(env)
                return world
        _refuse_stray_variables(env)
        return cls()

    def _check(self, env: Mapping[str, str]) -> None:
        names = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        if self.launcher == "slurm":
            names = ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "tasks on this node")
        problem = None
        if self.world_size < 1:
            problem = f"{names[0]}={self.world_size} must be >= 1"
        elif not 0 <= self.rank < self.world_size:
            problem = f"{names[1]}={self.rank} must lie in [0, {names[0]}={self.world_size})"
        elif not 0 <= self.local_rank < self.local_world_size:
            problem = f"{names[2]}={self.local_rank} must lie in [0, {names[3]}={self.local_world_size})"
        if problem:
            raise ValueError(f"{problem} [launcher assumed: {self.launcher} ({self.detected_from})]")


def _readers():
    """The readers in priority order (imported here: they import this module's helpers)."""
    from trainscale.runtime import kubernetes, lsf, mpi, slurm

    return (_read_torchrun, slurm.read, kubernetes.read, mpi.read, lsf.read, _read_ray, _read_torchrun_style)


def _torchrun_fields(env: Mapping[str, str], launcher: str, detected_from: str) -> dict:
    """World fields from torchrun's variables (torchrun's own workers, Ray Train's, another program's)."""
    names = TORCHRUN_VARS

    def geti(name: str, default: int | None = None) -> int:
        return read_int(env, name, launcher, names, default)

    world_size, rank = geti("WORLD_SIZE"), geti("RANK")
    if not 0 <= rank < world_size:  # before the LOCAL_RANK check: the first problem is the one to fix
        raise launcher_error(launcher, env, names, f"RANK={rank} must lie in [0, WORLD_SIZE={world_size})")
    if "LOCAL_RANK" not in env:
        raise launcher_error(launcher, env, names, "RANK and WORLD_SIZE are set but LOCAL_RANK is not: torchrun "
                             "sets all three for each process. Set LOCAL_RANK (this process's index on its "
                             "machine) and LOCAL_WORLD_SIZE, or start the script with torchrun or `trainscale run`")
    local_rank = geti("LOCAL_RANK")
    return dict(world_size=world_size, rank=rank, local_rank=local_rank,
                local_world_size=geti("LOCAL_WORLD_SIZE", world_size),
                node_rank=geti("GROUP_RANK", geti("NODE_RANK", 0)),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=geti("MASTER_PORT", 29500),
                restart_count=geti("TORCHELASTIC_RESTART_COUNT", 0), launcher=launcher, job_id=_job_id(env),
                group_world_size=geti("GROUP_WORLD_SIZE", 0) or None,  # torchrun's nodes (agents) in this round
                detected_from=detected_from)


def _read_torchrun(env: Mapping[str, str]) -> dict | None:
    """A worker of torchrun's agent (torch/distributed/elastic/agent/server/local_elastic_agent.py sets
    TORCHELASTIC_RUN_ID for every worker)."""
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    return _torchrun_fields(env, "torchrun", f"TORCHELASTIC_RUN_ID={env['TORCHELASTIC_RUN_ID']} (a torchrun worker)")


def _read_ray(env: Mapping[str, str]) -> dict | None:
    """A Ray Train worker: ray/train/torch/config.py sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and
    NODE_RANK, then creates the process group (env://) itself; every Ray worker process has RAY_RAYLET_PID."""
    if "RAY_RAYLET_PID" not in env or "RANK" not in env:
        return None
    return _torchrun_fields(env, "ray", "RANK and WORLD_SIZE in a Ray worker (RAY_RAYLET_PID): a Ray Train worker")


def _read_torchrun_style(env: Mapping[str, str]) -> dict | None:
    """torchrun's variables set by another program. MASTER_ADDR and MASTER_PORT are required on more than
    one process: without them rank 0's address is unknown, and env:// would fail late."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    fields = _torchrun_fields(env, "env", "RANK, WORLD_SIZE and LOCAL_RANK set without torchrun's "
                                          "TORCHELASTIC_RUN_ID (torchrun's variables from another program)")
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
    if fields["world_size"] > 1 and missing:
        raise launcher_error("env", env, TORCHRUN_VARS, f"{' and '.join(missing)} not set: a job of "
                             f"{fields['world_size']} processes needs rank 0's address (MASTER_ADDR=host "
                             "MASTER_PORT=port on every process), or start it with torchrun or `trainscale run`")
    return fields


def _refuse_stray_variables(env: Mapping[str, str]) -> None:
    """No launcher recognised: WORLD_SIZE > 1, or RANK / LOCAL_RANK alone, must not train as one process."""
    stray = [n for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if n in env]
    if not stray or (stray == ["WORLD_SIZE"] and env["WORLD_SIZE"] == "1"):
        return
    raise launcher_error("none", env, TORCHRUN_VARS, f"{' and '.join(stray)} set, but no launcher that sets them "
                         "was recognised, and RANK, WORLD_SIZE and LOCAL_RANK are needed together: start the script "
                         "with torchrun or `trainscale run`, or set all three (with MASTER_ADDR and MASTER_PORT), or "
                         "unset them to train as one process")
