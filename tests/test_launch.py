import sys

import pytest

from trainscale.runtime import launch, rendezvous


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
    """Several nodes need a job id: without --rdzv-id torchrun's run id is "none" for every job."""
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
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in launch.worker_env(2, {}, restarts=False)  # one round


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


# -- a per-node launch (a Kubernetes pod started as `python train.py`) -------------------------------
POD = {"PYTHONUNBUFFERED": "1", "MASTER_PORT": "23456", "PET_MASTER_PORT": "23456", "MASTER_ADDR": "t-master-0",
       "PET_MASTER_ADDR": "t-master-0", "WORLD_SIZE": "4", "RANK": "1", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "2",
       "PET_NNODES": "2"}  # the PyTorchJob operator's variables for worker pod 0 (node 1), nprocPerNode 2


class _Stop(Exception):
    pass


def test_a_pod_with_two_processes_becomes_torchrun_with_the_operators_rendezvous(monkeypatch):
    from trainscale.runtime.runtime import Runtime

    for key, value in POD.items():
        monkeypatch.setenv(key, value)
    started = {}

    def become_torchrun(torchrun, entry, nproc):
        started.update(torchrun=torchrun, entry=entry, nproc=nproc)
        raise _Stop

    monkeypatch.setattr(launch, "become_torchrun", become_torchrun)
    monkeypatch.setattr(launch, "current_entry_point", lambda: ["train.py", "--lr", "1"])
    rt = Runtime(accelerator="cpu")  # devices="auto": the operator's 2 per pod, its 2 pods
    assert (rt.config.devices, rt.config.num_nodes, rt.world.world_size, rt.world.per_node) == (2, 2, 4, "2")
    with pytest.raises(_Stop):
        rt.launch()
    assert started == {"torchrun": ["--nproc-per-node=2", "--nnodes=2", "--node-rank=1", "--rdzv-backend=static",
                                    "--master-addr=t-master-0", "--master-port=23456"],
                       "entry": ["train.py", "--lr", "1"], "nproc": 2}
    with pytest.raises(ValueError, match=r"asked for 2 process\(es\) per node.*devices=4"):
        Runtime(accelerator="cpu", devices=4, num_nodes=2)
    assert Runtime(accelerator="cpu", devices=2).config.num_nodes == 2  # num_nodes not given: the operator's pods
    with pytest.raises(ValueError, match=r"job is 2 node\(s\) × 2 process\(es\) = 4 but devices×num_nodes=2×1=2"
                                         r".*variables seen: .*WORLD_SIZE=4 .*PET_NNODES=2"):
        Runtime(accelerator="cpu", devices=2, num_nodes=1)  # given, num_nodes must match the pods


def test_a_volcano_pod_with_devices_takes_its_nodes_from_the_job(monkeypatch):
    """Volcano's pytorch plugin (MASTER_ADDR, MASTER_PORT, WORLD_SIZE = pods, RANK = pod index): Trainer(devices=2)
    runs 2 processes in each of the 3 pods without num_nodes, and an explicit num_nodes that disagrees is refused
    with the variables Volcano set (WORLD_SIZE=3), not the 6 processes trainscale computed."""
    from trainscale.runtime.runtime import Runtime

    volcano = {"MASTER_ADDR": "job-master-0.job", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "1",
               "VC_TASK_INDEX": "0", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    for key, value in volcano.items():
        monkeypatch.setenv(key, value)
    rt = Runtime(accelerator="cpu", devices=2)
    assert (rt.config.num_nodes, rt.world.world_size, rt.world.rank, rt.world.per_node) == (3, 6, 2, "2")
    with pytest.raises(ValueError) as err:
        Runtime(accelerator="cpu", devices=2, num_nodes=1)
    assert "variables seen: RANK=1 WORLD_SIZE=3 MASTER_ADDR=job-master-0.job" in str(err.value)
    assert "WORLD_SIZE=6" not in str(err.value)


def test_a_pod_with_one_process_is_the_rank_and_says_where_it_waits(monkeypatch, capsys):
    import torch.distributed as dist

    from trainscale.runtime.runtime import Runtime

    for key, value in {**POD, "WORLD_SIZE": "2", "PET_NPROC_PER_NODE": "auto"}.items():  # the operator's default
        monkeypatch.setenv(key, value)
    asked = {}

    def init_process_group(**kwargs):
        asked.update(kwargs)
        raise _Stop

    def join(world, timeout_s, report):  # the ranks meet on rank zero's store (runtime/rendezvous.py)
        asked["met"] = (world.master_addr, world.master_port, world.rank, timeout_s)
        return "the store"

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(rendezvous, "join", join)
    rt = Runtime(accelerator="cpu", timeout=30)  # devices="auto" on CPU: one process per pod
    assert (rt.world.rank, rt.world.local_rank, rt.world.world_size, rt.world.per_node) == (1, 0, 2, None)
    with pytest.raises(_Stop):
        rt.launch()
    assert asked["met"] == ("t-master-0", 23456, 1, 30)
    assert (asked["store"], asked["init_method"], asked["rank"], asked["world_size"]) == ("the store", None, 1, 2)
    err = capsys.readouterr().err
    assert "rank 1 of 2 (kubernetes: " in err and "waiting at the rendezvous t-master-0:23456" in err


# -- which process runs torchrun's agent -------------------------------------------------------------
class _Exit(Exception):
    pass


def test_agent_in_process_is_refused_with_a_cuda_context_or_much_memory(monkeypatch):
    import torch

    assert "GiB" in launch.agent_in_process_refusal(max_rss=1)  # any process holds more than a byte
    if not torch.cuda.is_initialized():
        assert launch.agent_in_process_refusal(max_rss=1 << 50) is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "CUDA context" in launch.agent_in_process_refusal(max_rss=1 << 50)


def test_a_light_process_runs_torchruns_main_and_exits_with_its_status(monkeypatch):
    from torch.distributed import run as torchrun_main

    ran, done = {}, {}
    monkeypatch.setattr(launch, "agent_in_process_refusal", lambda: None)
    monkeypatch.setattr(launch.os, "execve", lambda *a: pytest.fail("a light process must not exec"))

    def main(args):
        ran.update(args=args, omp=launch.os.environ.get("OMP_NUM_THREADS"))
        raise SystemExit(3)

    def exit_(status):
        done["status"] = status
        raise _Exit

    monkeypatch.setattr(torchrun_main, "main", main)
    monkeypatch.setattr(launch.os, "_exit", exit_)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with pytest.raises(_Exit):
        launch.become_torchrun(["--standalone", "--nproc-per-node=2"], ["train.py", "--lr", "1"], 2)
    assert ran["args"][0].startswith("--log-dir=")  # the failing rank's error file is read from there
    assert ran["args"][1:] == ["--standalone", "--nproc-per-node=2", "--module", "--", "trainscale.runtime.worker",
                               "train.py", "--lr", "1"]
    assert ran["omp"] is not None and done == {"status": 3}  # worker_env's defaults, torchrun's exit status


def test_a_heavy_process_is_replaced_by_torchrun(monkeypatch):
    execed = {}
    monkeypatch.setattr(launch, "agent_in_process_refusal", lambda: "a CUDA context is initialised in this process")

    def execve(path, argv, env):
        execed.update(path=path, argv=argv, env=env)
        raise _Exit

    monkeypatch.setattr(launch.os, "execve", execve)
    with pytest.raises(_Exit):
        launch.become_torchrun(["--standalone", "--nproc-per-node=2"], ["train.py"], 2)
    assert execed["path"] == sys.executable
    assert execed["argv"][1:5] == ["-m", "trainscale.runtime.agent", "--trainscale-report", "--standalone"]
    assert "OMP_NUM_THREADS" in execed["env"]  # worker_env's
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in execed["env"]  # one round: the workers use the agent's store
    with pytest.raises(_Exit):
        launch.become_torchrun(["--standalone", "--nproc-per-node=2", "--max-restarts=1"], ["train.py"], 2)
    assert execed["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


_FAILING_RANK = """
from trainscale import Runtime
rt = Runtime(accelerator="cpu", devices=2, timeout=30)
rt.launch()
if rt.rank == 1:
    raise RuntimeError("rank one fails on purpose")
rt.barrier()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_relaunch_whose_worker_fails_exits_1_with_the_error(tmp_path):
    from tests.helpers import run_python

    (tmp_path / "fails.py").write_text(_FAILING_RANK)
    out, _ = run_python(["fails.py"], tmp_path, timeout=80)  # devices=2: torchrun's agent in this light process
    assert out.returncode == 1, out.stderr[-3000:]
    assert "rank one fails on purpose" in out.stderr


@pytest.mark.parametrize("exit_code", [0, 3])
def test_run_torchrun_gives_every_signal_disposition_back(monkeypatch, exit_code):
    """Ctrl-C is ignored only while torchrun runs (the terminal sends it to torchrun's group too); afterwards the
    caller's own SIGINT handler and the forwarded signals' handlers are back, whether the job passed or failed."""
    import signal

    monkeypatch.setattr(launch, "torchrun_argv", lambda torchrun, entry: [sys.executable, "-c",
                                                                          f"raise SystemExit({exit_code})"])
    watched = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    before = {sig: signal.getsignal(sig) for sig in watched}
    mine = lambda signum, frame: None  # noqa: E731 - a handler only compared by identity
    previous_int = signal.signal(signal.SIGINT, mine)
    try:
        assert launch.run_torchrun(["--standalone"], ["x.py"], nproc_per_node=1) == exit_code
        assert signal.getsignal(signal.SIGINT) is mine
        assert {sig: signal.getsignal(sig) for sig in watched[1:]} == {sig: before[sig] for sig in watched[1:]}
    finally:
        signal.signal(signal.SIGINT, previous_int)
