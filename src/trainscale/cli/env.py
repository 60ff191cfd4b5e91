"""``trainscale env``: versions, devices and backends of this machine, and the launcher this process would
be taken to run under (which reader of ``trainscale.runtime.world`` recognised it, and why), for bug reports."""

from __future__ import annotations

import os
import platform


def launcher_rows(env=None) -> dict:
    """What ``World.from_env`` makes of ``env`` (default ``os.environ``): the launcher, the variables that
    chose it and the world it gives, or the error it raises (then the job would not start)."""
    from trainscale.runtime.world import World

    try:
        w = World.from_env(env)
    except ValueError as err:
        return {"launcher": f"error: {err}"}
    rows = {"launcher": w.launcher, "detected from": w.detected_from}
    where = f"node {w.node_rank} of {w.num_nodes}, rendezvous {w.master_addr}:{w.master_port}"
    if w.per_node is not None:
        count = "devices decide how many" if w.per_node == "auto" else f"{w.per_node} processes"
        rows["world"] = f"{where}; this process runs the node's ranks ({count}: itself for one, else with torchrun)"
    elif w.launcher != "none":
        rows["world"] = f"rank {w.rank} of {w.world_size}, local rank {w.local_rank} of {w.local_world_size}, {where}"
    return rows


def print_env() -> None:
    import torch
    import torch.distributed as dist

    from trainscale import __version__
    from trainscale.runtime.devices import cuda_device_count, mps_available

    rows = {
        "trainscale": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu cores": os.cpu_count(),
        "cuda devices": cuda_device_count(),
        "mps": mps_available(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        **launcher_rows(),
    }
    width = max(map(len, rows))
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")
