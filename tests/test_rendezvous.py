"""The rendezvous of launchers that start every rank themselves (srun, mpirun, jsrun, pods): a world that cannot
form is named, with who joined and who is missing, instead of torch's "1/2 clients joined" after the timeout."""

from __future__ import annotations

import threading

import pytest

from tests.helpers import free_port
from trainscale.runtime import rendezvous
from trainscale.runtime.world import World


def _world(rank, world_size, port, launcher="slurm"):
    return World(world_size=world_size, rank=rank, local_rank=rank, local_world_size=world_size, master_port=port,
                 launcher=launcher, detected_from=f"SLURM_PROCID={rank} and SLURM_NTASKS={world_size}")


def _join_all(worlds, timeout_s=20.0):
    results = {}

    def run(world):
        try:
            results[world.rank] = rendezvous.join(world, timeout_s, report=lambda line: None)
        except RuntimeError as err:
            results[world.rank] = err

    threads = [threading.Thread(target=run, args=(w,)) for w in worlds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s + 10)
    return results


def test_every_rank_joins_and_gets_the_store_the_process_group_is_built_on():
    port = free_port()
    results = _join_all([_world(0, 2, port), _world(1, 2, port)])
    assert all(hasattr(store, "add") for store in results.values()) and sorted(results) == [0, 1]


def test_a_missing_rank_is_named_with_who_joined_and_the_launchers_variables():
    lines = []
    with pytest.raises(RuntimeError, match=r"1 of 3 ranks joined the rendezvous at 127.0.0.1:\d+ \(rank 0 on .*\); "
                                           r"missing: 1, 2, after 2 s\. A world that cannot form: check that the "
                                           r"launcher started 3 processes \(slurm variables \(SLURM_PROCID=0"):
        rendezvous.join(_world(0, 3, free_port()), 2.0, report=lines.append, report_every_s=0.5)
    assert lines and "1 of 3 ranks joined" in lines[0] and "missing: 1, 2" in lines[0]


def test_members_that_read_different_world_sizes_are_refused_at_once_naming_both():
    port = free_port()
    results = _join_all([_world(0, 2, port), _world(1, 3, port)], timeout_s=30.0)
    for err in results.values():  # both raise well before the 30 s timeout
        assert isinstance(err, RuntimeError) and "read different worlds" in str(err)
        assert "world size 2" in str(err) and "world size 3" in str(err)


def test_a_rank_whose_rank_zero_never_listens_names_the_address_and_the_cause():
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 could not reach the rendezvous at 127.0.0.1:\d+ within 2 s"):
        rendezvous.join(_world(1, 2, free_port()), 2.0, report=lambda line: None)


def test_a_malformed_slurm_node_list_names_the_launcher_and_the_variable():
    from trainscale.runtime.world import World

    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
           "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "node[01-02", "SLURM_JOB_ID": "7"}
    with pytest.raises(ValueError, match=r"SLURM_JOB_NODELIST='node\[01-02' is not a SLURM hostlist \(unbalanced "
                                         r"'\['.*set MASTER_ADDR.*\[launcher assumed: slurm; variables seen: "):
        World.from_env(env)


def test_rays_variables_without_rays_process_group_are_refused_at_once(monkeypatch):
    from trainscale.runtime.runtime import Runtime

    for key, value in {"RAY_RAYLET_PID": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    runtime = Runtime(accelerator="cpu", devices=2, timeout=60)
    with pytest.raises(RuntimeError, match="Ray's variables are set .* but no process group exists: .*TorchTrainer"):
        runtime.launch()
