"""The process world: who this process is in a distributed job, read once from the launcher.

torchrun (``torch.distributed.run``) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each worker
(https://pytorch.org/docs/stable/elastic/run.html#environment-variables). Tasks started by
SLURM's ``srun`` are read from SLURM_PROCID, SLURM_NTASKS, ... (``trainscale.runtime.slurm``);
torchrun's variables win when both are set (torchrun started inside a SLURM job).
Without a launcher the process is a world of one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


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
        launcher: "torchrun", "slurm" (tasks started by ``srun``), or "none".
        job_id: an id shared by every attempt of the job (TORCHELASTIC_RUN_ID, SLURM_JOB_ID), or None.
        group_world_size: the launcher's count of nodes (torchrun's GROUP_WORLD_SIZE: agents; SLURM: the
            nodes of the step), or None: then ``num_nodes`` assumes every node runs ``local_world_size``.
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

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "World":
        """Read the world from ``env`` (default ``os.environ``) as torchrun sets it.

        Raises:
            ValueError: when the variables are present but inconsistent (e.g. RANK >= WORLD_SIZE),
                naming the variable to fix.
        """
        env = os.environ if env is None else env
        if "WORLD_SIZE" not in env or "RANK" not in env:  # torchrun's variables take precedence over SLURM's
            from trainscale.runtime import slurm

            slurm.warn_if_not_srun(env)
            if slurm.is_slurm_task(env):
                fields = slurm.world_fields(env)
                cls._check(fields["world_size"], fields["rank"], fields["local_rank"], fields["local_world_size"],
                           prefix="SLURM_")
                return cls(**fields, launcher="slurm")
            return cls()

        def geti(name: str, default: int) -> int:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None

        world_size = geti("WORLD_SIZE", 1)
        rank = geti("RANK", 0)
        local_rank = geti("LOCAL_RANK", rank)
        local_world_size = geti("LOCAL_WORLD_SIZE", world_size)
        node_rank = geti("GROUP_RANK", geti("NODE_RANK", 0))
        group_world_size = geti("GROUP_WORLD_SIZE", 0) or None  # torchrun's nodes (agents) in this round
        cls._check(world_size, rank, local_rank, local_world_size)
        return cls(
            world_size=world_size,
            rank=rank,
            local_rank=local_rank,
            local_world_size=local_world_size,
            node_rank=node_rank,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=geti("MASTER_PORT", 29500),
            restart_count=geti("TORCHELASTIC_RESTART_COUNT", 0),
            launcher="torchrun",
            job_id=_job_id(env),
            group_world_size=group_world_size,
        )

    @staticmethod
    def _check(world_size: int, rank: int, local_rank: int, local_world_size: int, prefix: str = "") -> None:
        names = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE") if not prefix else \
            ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "tasks on this node")
        if world_size < 1:
            raise ValueError(f"{names[0]}={world_size} must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"{names[1]}={rank} must lie in [0, {names[0]}={world_size})")
        if not 0 <= local_rank < local_world_size:
            raise ValueError(f"{names[2]}={local_rank} must lie in [0, {names[3]}={local_world_size})")
