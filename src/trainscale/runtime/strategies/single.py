"""One process, one device: no wrapper, no communication (the base's defaults)."""

from __future__ import annotations

from trainscale.runtime.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    name = "single"

    @classmethod
    def check_run(cls, *, accelerator: str, devices: int, num_nodes: int, cuda_count: int, compiled: bool) -> None:
        if devices * num_nodes > 1:
            raise ValueError(f"strategy='single' runs one process but devices×num_nodes={devices * num_nodes}; "
                             "pass strategy='ddp' (or devices=1)")
