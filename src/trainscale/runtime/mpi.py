"""MPI launchers: reading the world of a process started by ``mpirun`` / ``mpiexec``, without mpi4py.

Each MPI implementation's launcher gives every process its rank in the environment:

- Open MPI: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE;
- MPICH and Intel MPI (Hydra): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS;
- Cray MPICH under PALS (HPE Cray's ``mpiexec``): PMI_RANK, PMI_SIZE, PMI_LOCAL_RANK, PMI_LOCAL_SIZE, and PALS's
  own PALS_RANKID, PALS_LOCAL_RANKID, PALS_LOCAL_SIZE and PALS_NODEID (the node's index);
- MVAPICH: MV2_COMM_WORLD_RANK, MV2_COMM_WORLD_SIZE, MV2_COMM_WORLD_LOCAL_RANK, MV2_COMM_WORLD_LOCAL_SIZE
  (rank, world size, local rank, processes on this node); MVAPICH2's ``mpiexec`` sets PMI_RANK and PMI_SIZE
  beside them, its ``mpirun_rsh`` does not.

Several flavours share names (PMI_RANK and PMI_SIZE are MPICH's, Cray's and MVAPICH's), so the flavour read is
the first whose four variables are all set; only when none is complete is the first with a rank variable
assumed, and its missing variable named.

(Open MPI: docs/tuning-apps/environment-var.rst; its OMPI_COMM_WORLD_NODE_RANK is a rank within the node,
not the node's index; PALS_NODEID is one, and is read.) None of them says where rank 0 runs. On one node
(local size = world size) that is this machine; on several, MASTER_ADDR must name rank 0's host
(``mpirun -x MASTER_ADDR=$(hostname) ...``), else a clear error. The port is MASTER_PORT, else derived from
the job id (Open MPI's OMPI_MCA_ess_base_jobid or PMIX_NAMESPACE) so that every rank computes the same one,
else 29500 (MPICH, MVAPICH and PALS give no job id).
The node index (without PALS_NODEID) assumes ranks are placed node by node (``--map-by slot``, the default):
rank // local size. Under LSF's ``jsrun`` (JSM_NAMESPACE_RANK), whose Spectrum MPI also sets Open MPI's
variables, the LSF reader knows rank 0's host and reads the world instead. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Mapping

from trainscale.runtime.world import launcher_error, port_from_job_id, read_int

# (name, rank, size, local rank, local size)
FLAVOURS = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPICH / Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("Cray MPICH (PALS)", "PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"),
    ("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
)


def _flavour(env: Mapping[str, str]) -> tuple | None:
    """The first FLAVOURS entry whose four variables are all set, else the first whose rank variable is (its
    reader then names what is missing); None when there is none, and under jsrun (trainscale.runtime.lsf)."""
    if "JSM_NAMESPACE_RANK" in env:
        return None
    complete = (flavour for flavour in FLAVOURS if all(env.get(name) for name in flavour[1:]))
    return next(complete, None) or next((flavour for flavour in FLAVOURS if flavour[1] in env), None)


def read(env: Mapping[str, str]) -> dict | None:
    """The World fields of a process started by an MPI launcher, or None when this is not one.

    Raises:
        ValueError: a missing or non-integer variable, or several nodes without MASTER_ADDR.
    """
    flavour = _flavour(env)
    if flavour is None:
        return None
    name, rank_var, size_var, local_var, local_size_var = flavour
    names = (rank_var, size_var, local_var, local_size_var, "OMPI_MCA_orte_num_nodes", "PALS_NODEID", "MASTER_ADDR",
             "MASTER_PORT")
    launcher = f"mpi ({name})"

    def geti(var: str, default: int | None = None) -> int:
        return read_int(env, var, launcher, names, default)

    world_size, rank = geti(size_var), geti(rank_var)
    local_rank, local_size = geti(local_var), geti(local_size_var)
    if local_size < 1 or world_size % local_size:
        raise launcher_error(launcher, env, names, f"{local_size_var}={local_size} must divide {size_var}="
                                                   f"{world_size}: trainscale runs the same processes on each node")
    nodes = geti("OMPI_MCA_orte_num_nodes", world_size // local_size)
    addr = env.get("MASTER_ADDR")
    if not addr and nodes > 1:
        raise launcher_error(launcher, env, names, f"{name} started {world_size} processes on {nodes} nodes and "
                             "does not say where rank 0 runs: pass its host, e.g. `mpirun -x MASTER_ADDR=$(hostname) "
                             "-x MASTER_PORT=29500 ...` run from rank 0's node")
    job_id = _job_id(env)
    return dict(world_size=world_size, rank=rank, local_rank=local_rank, local_world_size=local_size,
                node_rank=geti("PALS_NODEID", rank // local_size), master_addr=addr or "127.0.0.1",
                master_port=geti("MASTER_PORT", port_from_job_id("".join(c for c in job_id or "" if c.isdigit())[-9:])),
                launcher="mpi", job_id=job_id, group_world_size=nodes,
                detected_from=f"{rank_var} and {size_var} (a process of {name}'s mpirun)")


def _job_id(env: Mapping[str, str]) -> str | None:
    """Open MPI's job id: OMPI_MCA_ess_base_jobid (4.x), PMIX_NAMESPACE (5.x: "prterun-host-123@1"); the
    port is derived from its last digits."""
    return env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or None
