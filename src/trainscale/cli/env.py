"""``trainscale env``: versions, devices and backends of this machine, for bug reports."""

from __future__ import annotations

import os
import platform


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
    }
    width = max(map(len, rows))
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")
