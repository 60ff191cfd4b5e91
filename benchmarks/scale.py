"""Set-up work per rank against the world size, simulated in one process with torch's fake process group.

    python benchmarks/scale.py                  # world sizes 8, 64, 256, 1024, 4096, 16384 (about 2 minutes here)
    python benchmarks/scale.py --quick          # smoke run: world sizes 8 and 64, few repeats

For each world size W, ranks 0, W/2 and W-1 are simulated one after another: torchrun's variables for that
rank (8 processes per node, W/8 nodes) and a process group of the ``"fake"`` backend
(``torch.testing._internal.distributed.fake_pg``: collectives return at once, carrying no data) over a store
that counts its operations (a ``dist.Store`` subclass in front of a ``HashStore``). What a rank does before its
first step is then timed part by part (median of ``--repeats`` runs, seconds):

- **world**: ``World.from_env`` from torchrun's variables, and from SLURM's (``srun``: a node list
  ``node[0001-NNNN]``, tasks per node ``8(xN)``), as every rank reads them.
- **mesh**: every device mesh trainscale builds on CPU, as its strategies build them: fsdp (1-D over all ranks),
  hsdp (``dp_replicate`` = nodes × ``dp_shard`` = 8, then the ``("dp_replicate", "dp_shard")`` slice), tp
  (``tp`` = 8 × ``dp_shard`` = nodes, the ``"tp"`` and ``"dp_shard"`` slices), pp (one stage per rank, the
  ``"pp"`` group) and pp × dp × tp (2 stages × W/16 × 8). ddp builds no mesh (it uses the default group).
  ``new_group`` calls = process groups created on this rank, its own or not (torch's ``_world.group_count``).
- **sampler**: ``distribute_dataloader`` of a 1,000,000-sample data set (the ``ResumableDistributedSampler``
  trainscale injects) and ``check_equal_lengths`` (one collective), as ``Runtime.setup_dataloader`` does;
  **epoch order**: the rank's first index, which builds the epoch's permutation (O(samples), not O(W)).
- **ckpt path**: the run directory (``choose_run_dir``: rank 0 claims ``version_N`` and broadcasts its name)
  and a checkpoint's name. The fake group cannot deliver rank 0's broadcast, so on other ranks only the name
  is timed; their share of ``choose_run_dir`` is receiving that one broadcast.

Store operations are counted over the whole simulated rank. The fake backend itself uses no store (a real
gloo or NCCL group exchanges its addresses through the store when it connects: O(own group size) per group).
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401 - registers the "fake" backend
from torch.utils.data import DataLoader, Dataset

from trainscale.checkpointing.run_dirs import checkpoint_name
from trainscale.checkpointing.runs import choose_run_dir
from trainscale.runtime.runtime import Runtime
from trainscale.runtime.sampling import check_equal_lengths, distribute_dataloader
from trainscale.runtime.strategies.parallel_dims import ParallelDims
from trainscale.runtime.world import World

PER_NODE = 8
SAMPLES = 1_000_000


class CountingStore(dist.Store):
    """A ``HashStore`` that counts the operations made on it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = dist.HashStore()
        self.ops: collections.Counter = collections.Counter()

    def set(self, key, value):
        self.ops["set"] += 1
        return self.inner.set(key, value)

    def get(self, key):
        self.ops["get"] += 1
        return self.inner.get(key)

    def add(self, key, amount):
        self.ops["add"] += 1
        return self.inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        self.ops["compare_set"] += 1
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        self.ops["wait"] += 1
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        self.ops["check"] += 1
        return self.inner.check(keys)

    def delete_key(self, key):
        self.ops["delete_key"] += 1
        return self.inner.delete_key(key)

    def num_keys(self):
        self.ops["num_keys"] += 1
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)

    def total(self) -> int:
        return sum(self.ops.values())


class Indices(Dataset):
    """A map-style data set of ``n`` samples; sample ``i`` is ``i`` (nothing is allocated per sample)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def torchrun_env(world_size: int, rank: int) -> dict[str, str]:
    """The variables torchrun's agent sets for worker ``rank`` (``PER_NODE`` workers per node)."""
    per_node = min(PER_NODE, world_size)
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node),
            "GROUP_WORLD_SIZE": str(world_size // per_node), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "node0001", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "scale",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


def slurm_env(world_size: int, rank: int) -> dict[str, str]:
    """The variables ``srun`` sets for task ``rank`` (``PER_NODE`` tasks per node)."""
    per_node = min(PER_NODE, world_size)
    nodes = world_size // per_node
    return {"SLURM_JOB_ID": "4242", "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world_size),
            "SLURM_STEP_NUM_TASKS": str(world_size), "SLURM_LOCALID": str(rank % per_node),
            "SLURM_NODEID": str(rank // per_node), "SLURM_STEP_ID": "0", "SLURM_NNODES": str(nodes),
            "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})", "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
            "SLURM_STEP_NODELIST": f"node[0001-{nodes:04d}]", "SLURM_JOB_NODELIST": f"node[0001-{nodes:04d}]"}


def layouts(world_size: int) -> dict[str, ParallelDims]:
    """Every layout trainscale builds a mesh for, at ``world_size`` (fsdp is the 1-D mesh)."""
    nodes = max(2, world_size // PER_NODE)  # hsdp replicates over 2 or more groups
    tp = min(PER_NODE, world_size // 4)
    return {"fsdp": ParallelDims(dp_shard=world_size),
            "hsdp": ParallelDims(dp_replicate=nodes, dp_shard=world_size // nodes),
            "tp": ParallelDims(dp_shard=world_size // PER_NODE, tp=PER_NODE),
            "pp": ParallelDims(pp=world_size),
            "pp·dp·tp": ParallelDims(pp=2, dp_shard=world_size // (2 * tp), tp=tp)}


def build_mesh(name: str, dims: ParallelDims):
    """The mesh and the groups the strategies take from it (``model_parallel.py``, ``pipeline.py``, ``fsdp.py``)."""
    if name == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", (dims.world_size,))  # FSDPStrategy.setup_module
    mesh = dims.build_mesh("cpu")
    if dims.tp > 1:
        mesh["tp"]
    if dims.dp_size > 1:
        mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    if dims.pp > 1:
        mesh.get_group("pp")
    return mesh


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def simulate_rank(world_size: int, rank: int, repeats: int, root: Path) -> dict:
    """Seconds per part and store operations of rank ``rank`` of ``world_size``, in this process."""
    row: dict = {"W": world_size, "rank": rank}
    tr_env, sl_env = torchrun_env(world_size, rank), slurm_env(world_size, rank)
    row["world torchrun"] = median_time(lambda: World.from_env(tr_env), repeats * 20)
    row["world slurm"] = median_time(lambda: World.from_env(sl_env), repeats * 20)

    store = CountingStore()
    dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
    try:
        groups_before = c10d._world.group_count
        for name, dims in layouts(world_size).items():
            row[f"mesh {name}"] = median_time(lambda: build_mesh(name, dims), repeats)
        row["new_group calls"] = (c10d._world.group_count - groups_before) // repeats

        world = World.from_env(tr_env)
        loader = DataLoader(Indices(SAMPLES), batch_size=32, shuffle=True)

        def sampler_setup():
            out = distribute_dataloader(loader, world, shuffle=True, seed=0)
            check_equal_lengths(out, world)
            return out

        row["sampler"] = median_time(sampler_setup, repeats)
        sampler = sampler_setup().sampler
        row["epoch order"] = median_time(lambda: next(iter(sampler)), max(1, repeats // 2))

        saved = dict(os.environ)
        os.environ.update(tr_env)
        try:
            runtime = Runtime(accelerator="cpu")
        finally:
            os.environ.clear()
            os.environ.update(saved)
        if rank == 0:
            row["ckpt path"] = median_time(lambda: (choose_run_dir(runtime, root, None, None)[1].release(),
                                                    checkpoint_name(3, 1234)), repeats)
        else:  # the fake group cannot deliver rank 0's broadcast of the directory's name
            row["ckpt path"] = median_time(lambda: checkpoint_name(3, 1234), repeats)
        row["store ops"] = store.total()
    finally:
        dist.destroy_process_group()
    return row


COLUMNS = ("world torchrun", "world slurm", "mesh fsdp", "mesh hsdp", "mesh tp", "mesh pp", "mesh pp·dp·tp",
           "sampler", "epoch order", "ckpt path")


def print_table(rows: list[dict]) -> None:
    head = f"| {'W':>5} | {'rank':>5} | " + " | ".join(f"{c:>14}" for c in COLUMNS) + \
           f" | {'new_group calls':>15} | {'store ops':>9} |"
    print(head)
    print("|" + "|".join("-" * (len(cell)) for cell in head.split("|")[1:-1]) + "|")
    for row in rows:
        cells = " | ".join(f"{row[c] * 1e3:>11.3f} ms" for c in COLUMNS)
        print(f"| {row['W']:>5} | {row['rank']:>5} | {cells} | {row['new_group calls']:>15} | {row['store ops']:>9} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: world sizes 8 and 64, 3 repeats")
    parser.add_argument("--sizes", default=None, help="comma-separated world sizes (default 8,64,256,1024,4096,16384)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per part (default 7, quick 3)")
    args = parser.parse_args()
    sizes = [int(s) for s in (args.sizes or ("8,64" if args.quick else "8,64,256,1024,4096,16384")).split(",")]
    for size in sizes:
        if size < PER_NODE or size % (2 * PER_NODE) and size != PER_NODE:
            sys.exit(f"--sizes: {size} must be 8 or a multiple of {2 * PER_NODE} ({PER_NODE} ranks per node)")
    repeats = args.repeats or (3 if args.quick else 7)
    torch.set_num_threads(1)
    print(f"# scale: torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()} "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; {repeats} repeats, median per part"
          f"{'; QUICK (smoke run)' if args.quick else ''}")
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for size in sizes:
            for rank in sorted({0, size // 2, size - 1}):
                rows.append(simulate_rank(size, rank, repeats, Path(root)))
    print_table(rows)
    print(f"# total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
