"""The sizes of a model-parallel job's device mesh: torchtitan's ``ParallelDims`` idea, pure logic.

One named ``DeviceMesh`` of shape ``(pp, dp_replicate, dp_shard, tp)`` holds every rank
(torchtitan v0.1.0 ``distributed/parallel_dims.py``). Ranks are laid out row-major, as
``init_device_mesh`` does: rank = ((p·dp_replicate + r)·dp_shard + s)·tp + t, so the ``tp`` ranks of
one group are neighbours (on one node, where tensor parallelism's per-layer all-reduces want the
fastest links), and ``pp`` is the outermost dimension (pipeline stages exchange only activations and
their gradients, point to point: the traffic that tolerates the slowest links, across nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

from trainscale.runtime.flags import PipelineScheduleFlag

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
PP_SCHEDULES = get_args(PipelineScheduleFlag)  # "gpipe", "1f1b"
_NOT_YET = {"cp": "context parallelism (GPU only in torch 2.13)",
            "ep": "expert parallelism"}


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the four mesh dimensions; their product is the world size.

    Attributes:
        pp: pipeline stages the model's layers are split into (``apply_pp.py``).
        dp_replicate: replicas of the model (gradients all-reduced across them, as DDP).
        dp_shard: ranks each replica's parameters, gradients and optimizer states are sharded over (FSDP).
        tp: ranks each layer's matrices are split over (tensor parallelism, Megatron-style).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: ``dp_replicate · dp_shard`` (the ``tp`` ranks and the ``pp`` stages
        share a batch)."""
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(replicate, shard, tp)`` indices of global ``rank`` in the mesh (its pipeline stage: :meth:`pp_rank`)."""
        return (rank // (self.dp_shard * self.tp)) % self.dp_replicate, (rank // self.tp) % self.dp_shard, rank % self.tp

    def pp_rank(self, rank: int) -> int:
        """The pipeline stage global ``rank`` runs."""
        return rank // (self.dp_size * self.tp)

    def dp_rank(self, rank: int) -> int:
        """This rank's index among the ``dp_size`` data-parallel ranks (which share of the data it reads)."""
        return (rank // self.tp) % self.dp_size

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIMS}

    def build_mesh(self, device_type: str) -> Any:
        """The ``DeviceMesh`` of shape ``(pp, dp_replicate, dp_shard, tp)`` named by :data:`DIMS` (needs the
        process group)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(getattr(self, name) for name in DIMS), mesh_dim_names=DIMS)


def _shorthand(strategy: str, devices: int, num_nodes: int) -> dict[str, int]:
    """The layout a shorthand means when no ``parallel`` is given."""
    if strategy == "hsdp":  # replicate across nodes, shard within a node
        return {"dp_replicate": num_nodes, "dp_shard": devices}
    if strategy == "pp":  # every rank one stage
        return {"pp": devices * num_nodes}
    return {"tp": devices, "dp_shard": num_nodes}  # "tp": within a node; FSDP across nodes (torchtitan's 2-D)


def resolve_parallel(strategy: str, parallel: Any, devices: int, num_nodes: int) -> ParallelDims:
    """Check ``parallel`` against the strategy and world size; fill in a shorthand's default layout.

    Args:
        strategy: "model_parallel", "hsdp", "tp" or "pp".
        parallel: None (the shorthand's default; required for "model_parallel") or a dict with keys of
            :data:`DIMS` and positive int values, the missing ones 1.
        devices, num_nodes: the resolved flags (world size = devices · num_nodes).

    Raises:
        ValueError: an unknown or not yet supported key, a bad value, sizes whose product is not the
            world size, or a layout the shorthand does not describe (each message names the fix).
    """
    world = devices * num_nodes
    if parallel is None:
        if strategy == "model_parallel":
            raise ValueError("strategy='model_parallel' needs parallel={'dp_replicate': R, 'dp_shard': S, 'tp': T} "
                             f"(or {{'pp': P, 'dp_shard': S}}) whose product is the world size ({world}); or use "
                             "strategy='hsdp' / 'tp' / 'pp' / 'fsdp'")
        parallel = _shorthand(strategy, devices, num_nodes)
    _check_entries(parallel)
    dims = ParallelDims(**parallel)
    if dims.world_size != world:
        raise ValueError(f"parallel={dims.as_dict()} multiplies to {dims.world_size} ranks but the job has "
                         f"devices×num_nodes={devices}×{num_nodes}={world}; make the product equal the world size")
    _check_shorthand(strategy, dims)
    return dims


def _check_entries(parallel: Any) -> None:
    if not isinstance(parallel, dict):
        raise ValueError(f"parallel={parallel!r} must be a dict such as {{'dp_shard': 2, 'tp': 2}}")
    for key, value in parallel.items():
        if key in _NOT_YET:
            raise ValueError(f"parallel={{{key!r}: ...}}: {_NOT_YET[key]} is not supported by trainscale yet; "
                             f"use {', '.join(DIMS)}")
        if key not in DIMS:
            raise ValueError(f"unknown parallel dimension {key!r}; choose from {', '.join(DIMS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"parallel[{key!r}]={value!r} must be an int >= 1")


def _check_shorthand(strategy: str, dims: ParallelDims) -> None:
    """A shorthand's layout must be what its name says."""
    if strategy == "hsdp" and (dims.tp > 1 or dims.dp_replicate < 2 or dims.dp_shard < 2):
        raise ValueError(f"strategy='hsdp' shards within groups of dp_shard ranks and replicates across "
                         f"dp_replicate ≥ 2 of them, but parallel={dims.as_dict()}; with one node pass e.g. "
                         "parallel={'dp_replicate': 2, 'dp_shard': 2}, or use strategy='fsdp' (one group) or "
                         "strategy='model_parallel' (with tp)")
    if strategy == "tp" and dims.tp < 2:
        raise ValueError(f"strategy='tp' splits layers over tp ≥ 2 ranks, but parallel={dims.as_dict()}; "
                         "pass parallel={'tp': 2, ...} or another strategy")
    if strategy == "pp" and dims.pp < 2:
        raise ValueError(f"strategy='pp' splits the model into pp ≥ 2 pipeline stages, but parallel={dims.as_dict()}; "
                         "pass parallel={'pp': 2} with 2 or more processes (devices=2), or another strategy")
