"""World from the environment: one reader per launcher, each given the exact variables its launcher sets,
the priority between them, and one clear error (launcher assumed, variables seen) for what does not add up."""

import pytest

from trainscale.runtime import lsf
from trainscale.runtime.world import World

# torchrun's worker 5 of 8 (2 nodes × 4), as torch/distributed/elastic/agent/server/local_elastic_agent.py sets it
TORCHRUN = {"LOCAL_RANK": "1", "RANK": "5", "GROUP_RANK": "1", "ROLE_RANK": "5", "ROLE_NAME": "default",
            "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "8",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCHELASTIC_ERROR_FILE": "/tmp/x/error.json"}
# Pod "worker-0" (index 1) of a PyTorchJob with a master and one worker, nprocPerNode "2" (training-operator v1.9,
# pkg/controller.v1/pytorch/envvar.go and master.go)
PYTORCHJOB = {"PYTHONUNBUFFERED": "1", "MASTER_PORT": "23456", "PET_MASTER_PORT": "23456",
              "MASTER_ADDR": "train-master-0", "PET_MASTER_ADDR": "train-master-0", "WORLD_SIZE": "4", "RANK": "1", "PET_NODE_RANK": "1",
              "PET_NPROC_PER_NODE": "2", "PET_NNODES": "2", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
# Node 1 of a TrainJob "train" on 2 nodes (Trainer v2, pkg/runtime/framework/plugins/torch/torch.go: PET_MASTER_ADDR
# "<job>-node-0-0.<job>", PET_MASTER_PORT constants.ContainerTrainerPort = 29500)
TRAINJOB = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "1",
            "PET_MASTER_ADDR": "train-node-0-0.train", "PET_MASTER_PORT": "29500",
            "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
# Worker 0 of a Volcano job "job" with a master and 2 workers, 3 pods: the pytorch plugin's MASTER_ADDR, MASTER_PORT,
# WORLD_SIZE and RANK (distributed-framework/pytorch/pytorch.go), the svc plugin's VC_<TASK>_HOSTS and _NUM
# (plugins/svc/svc.go), and the env plugin's VC_TASK_INDEX and VK_TASK_INDEX (plugins/env)
VOLCANO_SVC = {"MASTER_ADDR": "job-master-0.job", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "1",
               "VC_MASTER_HOSTS": "job-master-0.job", "VC_MASTER_NUM": "1",
               "VC_WORKER_HOSTS": "job-worker-0.job,job-worker-1.job", "VC_WORKER_NUM": "2",
               "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
VOLCANO = {**VOLCANO_SVC, "VC_TASK_INDEX": "0", "VK_TASK_INDEX": "0"}
# mpirun -np 4 on two nodes, rank 3 (Open MPI 4.1, as printed by `mpirun env` here)
OPENMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_MCA_orte_num_nodes": "2",
           "OMPI_MCA_ess_base_jobid": "1318649857", "OMPI_UNIVERSE_SIZE": "4", "PMIX_RANK": "3",
           "PMIX_NAMESPACE": "1318649857"}
MPICH = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "5"}
# MVAPICH2's mpiexec (its Hydra): its MV2_COMM_WORLD_* set, and PMI_RANK / PMI_SIZE beside it (no MPI_LOCALRANKID)
MVAPICH = {"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "1",
           "MV2_COMM_WORLD_LOCAL_SIZE": "2", "PMI_RANK": "3", "PMI_SIZE": "4"}
# HPE Cray MPICH under PALS (`mpiexec -n 4 --ppn 2`): Cray PMI's PMI_* and PALS's own PALS_*
CRAY_PALS = {"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2", "PALS_RANKID": "3",
             "PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "2", "PALS_NODEID": "1", "PALS_APID": "8e4c"}
# Ray Train worker 1 of 2 on one node (ray/train/torch/config.py, and Ray's own variables)
RAY = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0",
       "MASTER_ADDR": "192.0.2.2", "MASTER_PORT": "44329", "ACCELERATE_TORCH_DEVICE": "cpu", "RAY_RAYLET_PID": "10432",
       "RAY_JOB_ID": "01000000"}
SLURM = {"SLURM_JOB_ID": "12345", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_ID": "0"}


def fields(w: World) -> tuple:
    return (w.launcher, w.world_size, w.rank, w.local_rank, w.local_world_size, w.node_rank, w.num_nodes,
            w.master_addr, w.master_port)


def test_defaults_without_launcher():
    w = World.from_env({})
    assert (w.world_size, w.rank, w.local_rank, w.node_rank, w.launcher, w.per_node) == (1, 0, 0, 0, "none", None)
    assert w.is_rank_zero and not w.is_distributed


def test_torchrun_worker():
    w = World.from_env(TORCHRUN)
    assert fields(w) == ("torchrun", 8, 5, 1, 4, 1, 2, "node0", 29400)
    assert (w.restart_count, w.job_id, w.per_node) == (2, "job7", None)
    assert w.is_distributed and not w.is_rank_zero and "TORCHELASTIC_RUN_ID" in w.detected_from


def test_torchruns_variables_from_another_program_need_the_address():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "NODE_RANK": "3", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    w = World.from_env(env)
    assert (w.launcher, w.node_rank, w.local_world_size) == ("env", 3, 2)
    with pytest.raises(ValueError, match=r"MASTER_ADDR and MASTER_PORT not set.*launcher assumed: env"):
        World.from_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert World.from_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}).launcher == "env"  # one process


def test_pytorchjob_pod_with_two_processes_per_pod():
    w = World.from_env(PYTORCHJOB)
    assert fields(w) == ("kubernetes", 4, 2, 0, 2, 1, 2, "train-master-0", 23456)
    assert w.per_node == "2" and w.declared_per_node == 2 and "PyTorchJob" in w.detected_from
    ranks = w.node_ranks(2)  # devices=2: this process starts the pod's 2 ranks
    assert (ranks.world_size, ranks.rank, ranks.per_node) == (4, 2, "2")
    with pytest.raises(ValueError, match=r"asked for 2 process\(es\) per node.*devices=4"):
        w.node_ranks(4)


def test_pytorchjob_pod_default_nproc_auto_is_one_process_per_pod_or_devices():
    """nprocPerNode defaults to "auto": WORLD_SIZE is the pods; one process per pod works as it is."""
    env = {**PYTORCHJOB, "WORLD_SIZE": "2", "PET_NPROC_PER_NODE": "auto"}
    w = World.from_env(env)
    assert (w.per_node, w.declared_per_node) == ("auto", None)
    one = w.node_ranks(1)  # devices=1 (a one-GPU pod): this process is rank 1, local rank 0 (cuda:0)
    assert fields(one) == ("kubernetes", 2, 1, 0, 1, 1, 2, "train-master-0", 23456) and one.per_node is None
    four = w.node_ranks(4)  # devices=4 (a 4-GPU pod): 4 ranks per pod through torchrun
    assert (four.world_size, four.rank, four.local_world_size, four.per_node) == (8, 4, 4, "4")


def test_trainjob_pod():
    w = World.from_env(TRAINJOB)
    assert fields(w) == ("kubernetes", 2, 1, 0, 1, 1, 2, "train-node-0-0.train", 29500)
    assert w.per_node == "auto" and "TrainJob" in w.detected_from
    assert World.from_env({**TRAINJOB, "PET_NPROC_PER_NODE": "4"}).node_ranks(4).rank == 4


@pytest.mark.parametrize("env", [VOLCANO, VOLCANO_SVC], ids=["env plugin", "svc plugin only"])
def test_volcano_pod(env):
    """With or without Volcano's env plugin (VC_TASK_INDEX): its svc plugin's VC_<TASK>_HOSTS name Volcano too."""
    w = World.from_env(env)
    assert fields(w) == ("kubernetes", 3, 1, 0, 1, 1, 3, "job-master-0.job", 23456)
    assert "(a Volcano pod" in w.detected_from and w.node_ranks(1).per_node is None
    assert "RANK=1, WORLD_SIZE=3" in w.detected_from  # the values Volcano set, for `trainscale env` and errors


def test_a_cpu_trainjob_pods_count_is_its_cpus_and_devices_win_on_cpu():
    """Trainer v2 turns numProcPerNode "auto" into the CPU count of a pod without GPUs (torch.go,
    calculateNumProcPerNode): on CPU an explicit devices wins; on GPUs a count still binds."""
    w = World.from_env({**TRAINJOB, "PET_NPROC_PER_NODE": "8"})
    assert w.per_node == "8" and w.per_node_may_be_cpus
    one = w.node_ranks(1, cpu=True)
    assert (one.world_size, one.rank, one.per_node) == (2, 1, None)
    with pytest.raises(ValueError, match=r"asked for 8 process\(es\)"):
        w.node_ranks(1)
    pytorchjob = World.from_env({**PYTORCHJOB, "WORLD_SIZE": "16", "PET_NPROC_PER_NODE": "8"})
    with pytest.raises(ValueError, match=r"asked for 8 process\(es\)"):  # a PyTorchJob's count is the user's
        pytorchjob.node_ranks(1, cpu=True)


def test_pods_with_pet_variables_are_labelled_by_what_set_them():
    elastic = {"PET_RDZV_ENDPOINT": "train-worker-0:23456", "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "1:3"}
    with pytest.raises(ValueError, match=r"launcher assumed: kubernetes \(Kubeflow PyTorchJob pod\)"):
        World.from_env(elastic)
    own = World.from_env({"PET_NNODES": "1", "PET_NODE_RANK": "0"})  # torchrun's PET_* set by hand, one node
    assert "pod with torchrun's PET_* variables" in own.detected_from and "TrainJob" not in own.detected_from
    assert "TrainJob" in World.from_env(TRAINJOB).detected_from


def test_a_torchrun_inside_a_pod_is_torchrun():
    assert World.from_env({**PYTORCHJOB, **TORCHRUN}).launcher == "torchrun"


@pytest.mark.parametrize("change, message", [
    ({"WORLD_SIZE": "6"}, r"WORLD_SIZE=6 but PET_NNODES × PET_NPROC_PER_NODE = 2 × 2"),
    ({"RANK": "0"}, r"RANK=0 and PET_NODE_RANK=1 disagree"),
    ({"PET_NPROC_PER_NODE": "many"}, r"PET_NPROC_PER_NODE='many' must be a count"),
    ({"PET_NNODES": "1:4"}, r"elastic range.*torchrun train.py"),
    ({"PET_NODE_RANK": "2", "RANK": "2"}, r"index 2 must lie in \[0, 2\)"),
])
def test_pytorchjob_conflicts_name_the_variables(change, message):
    with pytest.raises(ValueError, match=message) as err:
        World.from_env({**PYTORCHJOB, **change})
    assert "launcher assumed: kubernetes (Kubeflow PyTorchJob pod)" in str(err.value)
    assert "PET_NNODES=" in str(err.value) and "RANK=" in str(err.value)


def test_pods_without_an_address_and_elastic_jobs_are_refused():
    no_addr = {k: v for k, v in TRAINJOB.items() if k != "PET_MASTER_ADDR"}
    with pytest.raises(ValueError, match=r"2 pods but no rendezvous address.*PET_NNODES=2"):
        World.from_env(no_addr)
    assert World.from_env({**no_addr, "PET_NNODES": "1", "PET_NODE_RANK": "0"}).master_addr == "127.0.0.1"
    elastic = {"PET_RDZV_ENDPOINT": "train-worker-0:23456", "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "1:3"}
    with pytest.raises(ValueError, match="elastic PyTorchJob"):
        World.from_env(elastic)


@pytest.mark.parametrize("env, name", [(OPENMPI, "Open MPI"), (MPICH, "MPICH"), (MVAPICH, "MVAPICH"),
                                       (CRAY_PALS, "Cray MPICH")])
def test_mpi_launchers(env, name):
    with pytest.raises(ValueError, match=rf"{name}.*started 4 processes on 2 nodes.*MASTER_ADDR=\$\(hostname\)"):
        World.from_env(env)
    w = World.from_env({**env, "MASTER_ADDR": "n0", "MASTER_PORT": "29511"})
    assert fields(w) == ("mpi", 4, 3, 1, 2, 1, 2, "n0", 29511) and name in w.detected_from
    one_node = {**env, **{k: "4" for k in env if k.endswith(("LOCAL_SIZE", "LOCALNRANKS"))},
                "OMPI_MCA_orte_num_nodes": "1", "PALS_NODEID": "0"}
    assert World.from_env(one_node).master_addr == "127.0.0.1"  # one node: rank 0 is on this machine


def test_the_mpi_flavour_with_complete_variables_wins():
    """PMI_RANK and PMI_SIZE are MPICH's, Cray's and MVAPICH's: the flavour whose four variables are set is read;
    alone, they are MPICH's, and its missing local rank is named."""
    assert "MVAPICH" in World.from_env({**MVAPICH, "MASTER_ADDR": "n0"}).detected_from
    cray = World.from_env({**CRAY_PALS, "MASTER_ADDR": "n0", "PALS_NODEID": "0"})
    assert "Cray MPICH" in cray.detected_from and cray.node_rank == 0  # PALS_NODEID, not rank // local size
    with pytest.raises(ValueError, match=r"MPI_LOCALRANKID is not set.*launcher assumed: mpi \(MPICH"):
        World.from_env({"PMI_RANK": "3", "PMI_SIZE": "4"})


def test_mpi_port_follows_the_job_id():
    port = World.from_env({**OPENMPI, "MASTER_ADDR": "n0"}).master_port
    assert port == 15000 + 1318649857 % 20000


def test_mpirun_inside_a_slurm_allocation_is_mpi():
    """mpirun starts one daemon task per node with srun: SLURM_NTASKS counts the daemons, not the ranks."""
    daemons = {**SLURM, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_TASKS_PER_NODE": "1(x2)"}
    assert World.from_env({**daemons, **OPENMPI, "MASTER_ADDR": "n0"}).launcher == "mpi"
    assert World.from_env({**SLURM, "PMI_RANK": "5", "PMI_SIZE": "8"}).launcher == "slurm"  # srun --mpi=pmi2


def test_lsf_jsrun(tmp_path):
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("batch1\nh41n01\nh41n01\nh41n02\nh41n02\n")
    env = {"LSB_JOBID": "4242", "LSB_DJOB_RANKFILE": str(rankfile), "JSM_NAMESPACE_SIZE": "4",
           "JSM_NAMESPACE_RANK": "3", "JSM_NAMESPACE_LOCAL_RANK": "1", "JSM_NAMESPACE_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_RANK": "3"}
    w = World(**lsf.read(env, hostname="h41n02"))
    assert fields(w) == ("lsf", 4, 3, 1, 2, 1, 2, "h41n01", 15000 + 4242 % 20000)
    assert World.from_env(env).launcher == "lsf"  # jsrun's Spectrum MPI variables do not make it "mpi"
    rankfile.write_text("batch1\n")
    with pytest.raises(ValueError, match="names no compute host.*launcher assumed: lsf"):
        World.from_env(env)
    with pytest.raises(ValueError, match="LSB_DJOB_RANKFILE is not set"):
        World.from_env({k: v for k, v in env.items() if k != "LSB_DJOB_RANKFILE"})


def test_ray_train_worker():
    w = World.from_env(RAY)
    assert fields(w) == ("ray", 2, 1, 1, 2, 0, 1, "192.0.2.2", 44329) and "Ray" in w.detected_from
    assert World.from_env({**SLURM, **RAY}).launcher == "ray"  # Ray started inside a SLURM allocation


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "2"}, r"WORLD_SIZE set, but no launcher.*launcher assumed: none; variables seen: WORLD_SIZE=2"),
    ({"RANK": "1"}, r"RANK set, but no launcher"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, r"LOCAL_RANK is not.*launcher assumed: env"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK=2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "a",
      "MASTER_PORT": "1"}, "LOCAL_RANK=3"),
])
def test_incomplete_or_inconsistent_environment(env, message):
    with pytest.raises(ValueError, match=message):
        World.from_env(env)


def test_a_pods_rank_without_local_rank_is_one_process_per_pod():
    """An older PyTorchJob pod (RANK, WORLD_SIZE, MASTER_*, no PET_*): rank = pod index, local rank 0 (it
    raised in devices.cuda_index on one-GPU pods when local rank was taken to be RANK)."""
    env = {"MASTER_ADDR": "t-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1",
           "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    w = World.from_env(env).node_ranks(1)
    assert fields(w) == ("kubernetes", 2, 1, 0, 1, 1, 2, "t-master-0", 23456)


def test_world_without_group_world_size_assumes_equal_nodes():
    w = World.from_env({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4",
                        "MASTER_ADDR": "a", "MASTER_PORT": "1"})
    assert (w.group_world_size, w.num_nodes) == (None, 2)


def test_world_is_frozen():
    with pytest.raises(Exception):
        World().rank = 3
