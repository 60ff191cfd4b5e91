"""IBM Spectrum LSF: reading the world of a process started by ``jsrun`` (the Job Step Manager).

``jsrun`` gives each process JSM_NAMESPACE_RANK, JSM_NAMESPACE_SIZE, JSM_NAMESPACE_LOCAL_RANK and
JSM_NAMESPACE_LOCAL_SIZE; LSF gives the job LSB_JOBID and LSB_DJOB_RANKFILE, a file with one host name
per line. Its first line is the job's launch node, which runs no rank; the other hosts, in order of first
appearance, are the compute nodes, the first of them rank 0's (as Lightning's LSFEnvironment reads it).
The node index is this machine's place among them. The port is MASTER_PORT, else
``15000 + LSB_JOBID % 20000``. Nothing here imports torch.
"""

from __future__ import annotations

import socket
from typing import Mapping

from trainscale.runtime.world import launcher_error, port_from_job_id, read_int

LSF_VARS = ("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK",
            "JSM_NAMESPACE_LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def compute_hosts(rankfile_text: str) -> list[str]:
    """The compute nodes of LSB_DJOB_RANKFILE's text, in order, each once (the first line, the launch
    node, left out)."""
    lines = [line.strip() for line in rankfile_text.splitlines() if line.strip()]
    return list(dict.fromkeys(lines[1:]))


def read(env: Mapping[str, str], hostname: str | None = None) -> dict | None:
    """The World fields of a process started by ``jsrun``, or None when this is not one. ``hostname``
    (default ``socket.gethostname()``) places this process among the rank file's hosts.

    Raises:
        ValueError: a missing or unreadable rank file, a rank file without compute hosts, or a missing
            or non-integer JSM variable.
    """
    if "JSM_NAMESPACE_RANK" not in env:
        return None

    def geti(name: str, default: int | None = None) -> int:
        return read_int(env, name, "lsf (jsrun)", LSF_VARS, default)

    world_size, rank = geti("JSM_NAMESPACE_SIZE"), geti("JSM_NAMESPACE_RANK")
    local_rank = geti("JSM_NAMESPACE_LOCAL_RANK")
    path = env.get("LSB_DJOB_RANKFILE")
    if not path:
        raise launcher_error("lsf (jsrun)", env, LSF_VARS, "LSB_DJOB_RANKFILE is not set: rank 0's host is unknown")
    try:
        with open(path, encoding="utf-8") as f:
            hosts = compute_hosts(f.read())
    except OSError as err:
        raise launcher_error("lsf (jsrun)", env, LSF_VARS, f"cannot read LSB_DJOB_RANKFILE: {err}") from None
    if not hosts:
        raise launcher_error("lsf (jsrun)", env, LSF_VARS, f"LSB_DJOB_RANKFILE {path} names no compute host "
                                                           "after its first line (the launch node)")
    hostname = hostname or socket.gethostname()
    local_size = geti("JSM_NAMESPACE_LOCAL_SIZE", max(1, world_size // len(hosts)))
    node_rank = hosts.index(hostname) if hostname in hosts else rank // max(1, local_size)
    job_id = env.get("LSB_JOBID") or None
    return dict(world_size=world_size, rank=rank, local_rank=local_rank, local_world_size=local_size,
                node_rank=node_rank, master_addr=env.get("MASTER_ADDR") or hosts[0],
                master_port=geti("MASTER_PORT", port_from_job_id(job_id)), launcher="lsf", job_id=job_id,
                group_world_size=len(hosts),
                detected_from="JSM_NAMESPACE_RANK and LSB_DJOB_RANKFILE (a process started by jsrun)")
