import pytest

from trainscale.runtime.world import World


def test_defaults_without_launcher():
    w = World.from_env({})
    assert (w.world_size, w.rank, w.local_rank, w.node_rank, w.launcher) == (1, 0, 0, 0, "none")
    assert w.is_rank_zero and not w.is_distributed


def test_torchrun_environment():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": "2"}
    w = World.from_env(env)
    assert (w.world_size, w.rank, w.local_rank, w.local_world_size, w.node_rank) == (8, 5, 1, 4, 1)
    assert (w.master_addr, w.master_port, w.restart_count, w.num_nodes) == ("node0", 29400, 2, 2)
    assert w.launcher == "torchrun" and w.is_distributed and not w.is_rank_zero


def test_node_rank_fallback():
    assert World.from_env({"RANK": "0", "WORLD_SIZE": "2", "NODE_RANK": "3"}).node_rank == 3


@pytest.mark.parametrize("env, message", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=3"),
])
def test_inconsistent_environment(env, message):
    with pytest.raises(ValueError, match=message):
        World.from_env(env)


def test_world_is_frozen():
    with pytest.raises(Exception):
        World().rank = 3
