import sys

import pytest

from trainscale.runtime import launch


def test_single_node_is_standalone():
    assert launch.torchrun_args(2) == ["--nproc-per-node=2", "--standalone"]


def test_multi_node_needs_endpoint():
    with pytest.raises(ValueError, match="--rdzv-endpoint"):
        launch.torchrun_args(2, nnodes=2)
    args = launch.torchrun_args(4, nnodes="1:2", rdzv_endpoint="10.0.0.1:29400", node_rank=1, max_restarts=3,
                                run_id="job7")
    assert args == ["--nproc-per-node=4", "--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400",
                    "--node-rank=1", "--rdzv-id=job7", "--max-restarts=3"]


def test_multi_node_needs_a_job_id_and_takes_slurms():
    """Issue 18 item 7: without --rdzv-id torchrun's run id is "none" for every job."""
    endpoint = {"nnodes": 2, "rdzv_endpoint": "10.0.0.1:29400"}
    with pytest.raises(ValueError, match="--rdzv-id ID"):
        launch.torchrun_args(4, **endpoint, env={})
    assert "--rdzv-id=12345" in launch.torchrun_args(4, **endpoint, env={"SLURM_JOB_ID": "12345"})
    assert "--rdzv-id=mine" in launch.torchrun_args(4, **endpoint, run_id="mine", env={"SLURM_JOB_ID": "12345"})
    assert launch.torchrun_args(2, env={}) == ["--nproc-per-node=2", "--standalone"]  # torchrun picks a fresh id


def test_world_job_id_takes_slurms_over_torchruns_none():
    from trainscale.runtime.world import World

    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert World.from_env({**torchrun, "TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"}).job_id == "77"
    assert World.from_env({**torchrun, "TORCHELASTIC_RUN_ID": "none"}).job_id == "none"  # nothing better known
    assert World.from_env({**torchrun, "TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "77"}).job_id == "abc"


def test_nonpositive_processes():
    with pytest.raises(ValueError, match="nproc_per_node=0"):
        launch.torchrun_args(0)


def test_worker_env_defaults_do_not_override(monkeypatch):
    env = launch.worker_env(2, {"OMP_NUM_THREADS": "7"})
    assert env["OMP_NUM_THREADS"] == "7"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert int(launch.worker_env(2, {})["OMP_NUM_THREADS"]) >= 1


def test_entry_point_of_a_non_script(monkeypatch):
    main = type(sys)("__main__")
    main.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["-c"])
    with pytest.raises(RuntimeError, match=r"Pass strategy=.ddp_notebook. \(the processes are forked.*trainscale run -n N script.py"):
        launch.current_entry_point()


def test_entry_point_of_a_script(monkeypatch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    main = type(sys)("__main__")
    main.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [str(script), "--lr", "1"])
    assert launch.current_entry_point() == [str(script), "--lr", "1"]


def test_several_nodes_are_not_relaunched():
    with pytest.raises(RuntimeError, match="--nnodes N --node-rank R"):
        launch.relaunch_current_script(2, num_nodes=2)
