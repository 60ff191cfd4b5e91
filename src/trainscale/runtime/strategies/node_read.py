"""A checkpoint file read once per node: local rank 0 of each node reads (and verifies) the bytes, the
node's other ranks receive them from it over a gloo group of the node's ranks.

Under ddp every rank needs the whole checkpoint; read by every rank, a job of 8 GPUs per node asks the
(often shared, network) file system for the same file 8 times per node. The node groups are built once,
on the first load, from every rank's node index (``World.node_rank``), so nodes may run different numbers
of ranks. A read that fails on local rank 0 (missing file, wrong checksum) fails on the node's other ranks
too, with its message, instead of leaving them waiting. All ranks must call :meth:`NodeReader.read`.
"""

from __future__ import annotations

from pathlib import Path

from trainscale.runtime.checkpoint_io import CheckpointError, check_is_file, read_checked


class NodeReader:
    """``read(path, verify) -> bytes`` for ``checkpoint_io.load_file``, one file read per node."""

    def __init__(self, world) -> None:
        self.world = world
        self._groups = None  # (this node's gloo group, its local rank 0's global rank), or () when not needed

    def read(self, path: Path, verify: bool = True) -> bytes:
        import torch.distributed as dist

        if self.world.world_size == 1 or not dist.is_initialized():
            return read_checked(path, verify)
        check_is_file(path)  # a missing file: FileNotFoundError on every rank, before any collective
        if self._groups is None:
            self._groups = _node_group(self.world)
        if not self._groups:  # one rank on every node: each reads its own
            return read_checked(path, verify)
        group, source = self._groups
        if self.world.rank == source:
            return _send(path, verify, group, source)
        return _receive(path, group, source)


def _node_group(world) -> tuple:
    """Every rank's node index, gathered; a gloo group per node (all ranks create all of them, as
    ``new_subgroups_by_enumeration`` requires), or () when every node runs one rank."""
    import torch.distributed as dist

    nodes: list = [None] * world.world_size
    dist.all_gather_object(nodes, world.node_rank)
    ranks_of = {}
    for rank, node in enumerate(nodes):
        ranks_of.setdefault(node, []).append(rank)
    if all(len(ranks) == 1 for ranks in ranks_of.values()):
        return ()
    group, _ = dist.new_subgroups_by_enumeration(list(ranks_of.values()), backend="gloo")
    return group, ranks_of[world.node_rank][0]


def _send(path: Path, verify: bool, group, source: int) -> bytes:
    """Read on this node's local rank 0 and broadcast a header (ok, length) and the bytes (or the error)."""
    import torch
    import torch.distributed as dist

    try:
        data, error = read_checked(path, verify), None
    except Exception as err:  # noqa: BLE001 - any failure (MemoryError too) is sent, or the node's ranks would wait
        data, error = f"{type(err).__name__}: {err}".encode(), err
    dist.broadcast(torch.tensor([error is None, len(data)], dtype=torch.int64), src=source, group=group)
    if data:
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=source, group=group)
    if error is not None:
        raise error
    return data


def _receive(path: Path, group, source: int) -> bytes:
    import torch
    import torch.distributed as dist

    header = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(header, src=source, group=group)
    ok, size = (int(v) for v in header)
    buffer = torch.empty(size, dtype=torch.uint8)
    if size:
        dist.broadcast(buffer, src=source, group=group)
    data = buffer.numpy().tobytes()
    if not ok:
        raise CheckpointError(f"checkpoint {str(path)!r}: local rank 0 of this node (rank {source}) could not read "
                              f"it: {data.decode(errors='replace')}")
    return data
