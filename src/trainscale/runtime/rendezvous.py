"""The rendezvous of launchers that start every rank themselves (srun, mpirun, jsrun, a Kubernetes operator's pods).

torchrun's agent meets its workers before they start; these launchers do not, so each rank meets the others in
``init_process_group`` on rank zero's ``MASTER_ADDR:MASTER_PORT``. There a missing process (a world that can
never form: a task count that disagrees with the processes started, variables of a launcher that did not start
this job) leaves every rank silent until the timeout, then torch says "1/2 clients joined" and no more.

:func:`join` meets on the same TCP store (``torch.distributed.TCPStore``, the one ``tcp://`` init would make),
each rank recording who it is; the process group is then built on that store. While ranks are missing, rank zero
prints who joined and who is missing; members that read different worlds are refused at once, naming what each
read; at the timeout every rank that joined raises with the same account. (The store is PyTorch's; the
account is ours.)
"""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from trainscale.runtime.world import World

_JOINED = "trainscale/rendezvous/joined"
_MEMBER = "trainscale/rendezvous/member/"
_FIRST = "trainscale/rendezvous/first"
_REFUSED = "trainscale/rendezvous/refused"


def join(world: World, timeout_s: float, report: Callable[[str], None], report_every_s: float = 30.0):
    """Meet every rank of ``world`` on rank zero's TCP store and return the store (for ``init_process_group``).

    Args:
        world: this process's World (rank, world size, rendezvous address and port, launcher).
        timeout_s: seconds to wait for every rank (the Runtime's ``timeout``).
        report: where rank zero's progress lines go (stderr).
        report_every_s: seconds between those lines while ranks are missing.

    Raises:
        RuntimeError: every rank did not join within ``timeout_s`` (naming the ranks that joined, with their
            hosts, and those missing), or a member read another world size than the first to arrive (naming
            each one's launcher and variables) — raised at once on every rank that has joined or joins later.
    """
    import torch.distributed as dist

    where = f"{world.master_addr}:{world.master_port}"
    try:
        store = dist.TCPStore(world.master_addr, world.master_port, is_master=world.rank == 0,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as err:  # DistStoreError/DistNetworkError are RuntimeErrors
        raise RuntimeError(f"rank {world.rank} of {world.world_size} could not reach the rendezvous at {where} "
                           f"within {timeout_s:.0f} s ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
                           f"rank 0 (on {world.master_addr}) never started or listens elsewhere: check that its "
                           f"process runs and that every rank reads the same {_variables(world)}") from err
    me = {"rank": world.rank, "world_size": world.world_size, "host": socket.gethostname(),
          "launcher": world.launcher, "detected_from": world.detected_from}
    store.set(f"{_MEMBER}{world.rank}", json.dumps(me))
    first = json.loads(store.compare_set(_FIRST, "", json.dumps(me)))  # the first member to arrive, whoever it is
    if first["world_size"] != world.world_size:  # O(1) per rank: each compares itself with the first only
        store.set(_REFUSED, f"the ranks meeting at {where} read different worlds: {_describe(first)}; "
                            f"{_describe(me)}. Every process must read one launcher's variables")
    store.add(_JOINED, 1)
    started = last_report = time.monotonic()
    while True:
        joined = store.add(_JOINED, 0)  # read before the refusal: a member sets that before it adds itself
        if store.check([_REFUSED]):
            raise RuntimeError(store.get(_REFUSED).decode())
        if joined > world.world_size:
            raise RuntimeError(f"{joined} processes joined the rendezvous at {where} for a world of "
                               f"{world.world_size}: another job uses this address, or the launcher started more "
                               f"processes than {_variables(world)} say")
        if joined == world.world_size:
            return store
        now = time.monotonic()
        if now - started > timeout_s or (world.rank == 0 and now - last_report >= report_every_s):
            members = _members(store, world.world_size)
            missing = sorted(set(range(world.world_size)) - {m["rank"] for m in members})
            account = (f"{joined} of {world.world_size} ranks joined the rendezvous at {where} ("
                       + ", ".join(f"rank {m['rank']} on {m['host']}" for m in members[:8])
                       + f"); missing: {_ranks(missing)}")
            if now - started > timeout_s:
                raise RuntimeError(f"{account}, after {timeout_s:.0f} s. A world that cannot form: check that the "
                                   f"launcher started {world.world_size} processes ({_variables(world)}) and that "
                                   "each missing rank's process runs and can reach this address")
            report(f"trainscale: {account}; waiting (timeout {timeout_s:.0f} s)")
            last_report = now
        time.sleep(0.1)


def _members(store, world_size: int) -> list[dict]:
    keys = [f"{_MEMBER}{r}" for r in range(world_size)]
    present = [k for k in keys if store.check([k])]
    return [json.loads(store.get(k)) for k in present]


def _describe(member: dict) -> str:
    return (f"rank {member['rank']} on {member['host']} read world size {member['world_size']} from "
            f"{member['launcher']} ({member['detected_from']})")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return f"{shown}, ... ({len(ranks)} in all)" if len(ranks) > 16 else shown or "none"


def _variables(world: World) -> str:
    return f"{world.launcher} variables ({world.detected_from})"
