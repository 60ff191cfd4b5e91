"""The sweep's grid: cells from flags, validated early. Pure logic (no torch import).

A cell is one fresh job: ``devices`` processes/GPUs × one batch size × strategy × precision.
``scaling="weak"`` keeps the per-device batch (``batch_size`` is per device; more devices → fewer
batches per epoch); ``"strong"`` keeps the global batch (``batch_size`` is global; per-device =
global ÷ devices). The baseline cells (fewest devices, normally 1) run strategy "single" when they
hold one device — the plain run the extra devices are compared with — and are shared by every
strategy of the grid.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

DEFAULT_BATCH_SIZES = (4, 8, 16, 32, 64, 128, 256, 512)
SCALINGS = ("weak", "strong")


@dataclass(frozen=True)
class Cell:
    """One job of the sweep.

    Attributes:
        strategy: the strategy of the table the cell belongs to ("single" for one device).
        precision: Lightning's precision name.
        devices: processes (CPU) or GPUs.
        batch_size: the grid's batch size (per device under weak scaling, global under strong).
        per_device_batch: the DataLoader's ``batch_size`` in each process.
        scaling: "weak" or "strong".
    """

    strategy: str
    precision: str
    devices: int
    batch_size: int
    per_device_batch: int
    scaling: str

    @property
    def run_strategy(self) -> str:
        return "single" if self.devices == 1 else self.strategy

    @property
    def key(self) -> str:
        return f"{self.run_strategy}-{self.precision}-d{self.devices}-{self.scaling}-b{self.batch_size}"

    def as_dict(self) -> dict:
        return {**asdict(self), "run_strategy": self.run_strategy, "key": self.key}


def default_devices(accelerator: str = "auto") -> list[int]:
    """1 and every power of two up to the devices available: CUDA GPUs, else CPU cores (processes)."""
    from trainscale.runtime.devices import cuda_device_count

    n = cuda_device_count() if accelerator in ("auto", "cuda", "gpu") else 0
    if not n:
        n = os.cpu_count() or 1
    out, d = [], 1
    while d <= n:
        out.append(d)
        d *= 2
    return out


def _positive_ints(name: str, values) -> list[int]:
    values = list(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{name}={values!r} must be a non-empty list of positive ints, e.g. 1,2")
    if len(set(values)) != len(values):
        raise ValueError(f"{name}={values!r} repeats a value")
    return sorted(values)


def plan(devices, batch_sizes, strategies, precisions, scaling: str = "weak") -> list[Cell]:
    """The cells of the grid without duplicates, ordered by precision, batch size, devices, strategy.

    Raises:
        ValueError: an empty or non-positive list, an unknown strategy (those registered in
            ``trainscale.runtime.strategies.STRATEGIES`` but "model_parallel", whose layout bench cannot
            choose: its shorthands "hsdp" and "tp" are valid) or precision, an unknown scaling, hsdp with a
            device count other than 1 or an even number >= 4, or under strong scaling a global batch that the
            device count does not divide.
    """
    from trainscale.runtime.precision import PRECISIONS
    from trainscale.runtime.strategies import STRATEGIES

    devices = _positive_ints("devices", devices)
    batch_sizes = _positive_ints("batch_sizes", batch_sizes)
    if scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r}; choose 'weak' (fixed per-device batch) or 'strong' (fixed global batch)")
    valid = [s for s in STRATEGIES if s not in ("auto", "single", "model_parallel")]  # its shorthands hsdp, tp
    strategies, precisions = list(strategies), list(precisions)
    for s in strategies:
        if s not in valid:
            raise ValueError(f"unknown strategy {s!r} for bench; choose from {', '.join(valid)} "
                             "(the strategies registered in trainscale.runtime.strategies.STRATEGIES)")
    for p in precisions:
        if p not in PRECISIONS:
            raise ValueError(f"unknown precision {p!r}; choose from {', '.join(PRECISIONS)}")
    if not strategies or not precisions:
        raise ValueError("give at least one strategy and one precision")
    odd = [d for d in devices if d > 1 and (d < 4 or d % 2)]
    if "hsdp" in strategies and odd:
        raise ValueError(f"strategy hsdp runs 2 replicas of devices/2 shards on one node and needs an even device "
                         f"count >= 4, not {odd}; pass e.g. --devices 1,4 for hsdp, or leave it out of --strategy")
    cells: dict[str, Cell] = {}
    for p in precisions:
        for s in strategies:
            for d in devices:
                for b in batch_sizes:
                    if scaling == "strong" and b % d:
                        raise ValueError(f"strong scaling keeps the global batch: {b} is not divisible by {d} devices; "
                                         "pass batch sizes that every device count divides")
                    cell = Cell(s, p, d, b, b if scaling == "weak" else b // d, scaling)
                    if d == 1:
                        cell = Cell("single", p, d, b, b, scaling)
                    cells.setdefault(cell.key, cell)
    # Interleaved: each batch size's baseline runs right before the cells compared with it, so a change
    # in the machine's load during a long sweep does not bias every baseline one way.
    return sorted(cells.values(), key=lambda c: (c.precision, c.batch_size, c.devices, c.strategy))
