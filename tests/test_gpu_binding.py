"""SLURM with one GPU per task, and nodes with different numbers of processes.
The machine's CUDA device count is faked; nothing here needs a GPU."""

import pytest
import torch

from trainscale.runtime import devices
from trainscale.runtime.runtime import Runtime
from trainscale.runtime.world import World

# SLURM task 7 of 8 on the second of two nodes, 4 tasks per node
TASK = {"SLURM_JOB_ID": "12345", "SLURM_PROCID": "7", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3",
        "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]"}


def _env(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def _fake_cuda(monkeypatch, count):
    """This process sees ``count`` CUDA devices (compute capability 7.0: no TF32 note)."""
    monkeypatch.setattr(devices, "cuda_device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))


def test_cuda_index_per_task_binding_and_shared_visibility():
    assert devices.cuda_index(3, 4, visible=4, launcher="slurm") == 3  # --gpus-per-node: every task sees all
    assert devices.cuda_index(3, 4, visible=1, launcher="slurm") == 0  # --gpus-per-task=1: its own GPU is cuda:0
    assert devices.cuda_index(0, 1, visible=1, launcher="none") == 0
    assert devices.node_cuda_count(1, 4, "slurm") == 4 and devices.node_cuda_count(8, 4, "slurm") == 8
    assert devices.node_cuda_count(1, 4, "torchrun") == 1  # torchrun's workers share the agent's visibility
    for launcher in ("lsf", "ray", "mpi"):  # jsrun -a 1 -g 1, a Ray worker's own GPU, an MPI wrapper's binding
        assert devices.cuda_index(3, 4, visible=1, launcher=launcher) == 0
    with pytest.raises(ValueError, match="--gpus-per-task=1"):
        devices.cuda_index(3, 4, visible=2, launcher="slurm")  # --gpus-per-task=2: one process per GPU
    with pytest.raises(ValueError, match="sees 1 CUDA device"):
        devices.cuda_index(3, 4, visible=1, launcher="torchrun")


def test_runtime_takes_cuda_0_when_slurm_binds_one_gpu_per_task(monkeypatch):
    _env(monkeypatch, TASK)
    _fake_cuda(monkeypatch, 1)  # CUDA_VISIBLE_DEVICES=<this task's GPU>
    rt = Runtime(accelerator="cuda")
    assert rt.device == torch.device("cuda", 0)
    assert (rt.config.devices, rt.config.num_nodes, rt.world.local_rank) == (4, 2, 3)
    rt = Runtime(accelerator="cuda", devices=4, num_nodes=2)  # explicit flags that match the allocation
    assert rt.device == torch.device("cuda", 0)


def test_runtime_takes_cuda_local_rank_when_every_task_sees_the_node(monkeypatch):
    _env(monkeypatch, TASK)
    _fake_cuda(monkeypatch, 4)
    assert Runtime(accelerator="cuda").device == torch.device("cuda", 3)


def test_nodes_with_different_numbers_of_processes_under_slurm(monkeypatch):
    _env(monkeypatch, {**TASK, "SLURM_NTASKS": "12", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                       "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "8,4"})
    rt = Runtime(accelerator="cpu")  # devices="auto" follows the allocation, node by node
    assert (rt.world.num_nodes, rt.world.local_world_size, rt.world.world_size, rt.config.devices) == (2, 8, 12, 8)
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_PROCID", "8")
    assert World.from_env().num_nodes == 2  # not 12 // 4 = 3


def test_nodes_with_different_numbers_of_processes_under_torchrun(monkeypatch):
    _env(monkeypatch, {"RANK": "0", "WORLD_SIZE": "12", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8",
                       "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"})
    rt = Runtime(accelerator="cpu")
    assert (rt.world.num_nodes, rt.config.devices, rt.config.num_nodes) == (2, 8, 2)
    with pytest.raises(ValueError, match="WORLD_SIZE=12"):
        Runtime(accelerator="cpu", devices=8, num_nodes=2)  # explicit flags must still match the job


def test_backend_string_adds_gloo_for_cpu_tensors_when_offloading():
    assert devices.backend_for("cuda") == "nccl"
    assert devices.backend_for("cuda", cpu_collectives=True) == "cuda:nccl,cpu:gloo"
    assert devices.backend_for("cpu", cpu_collectives=True) == "gloo"
    assert devices.backend_for("mps") == "gloo"


class _Stop(Exception):
    pass


@pytest.mark.parametrize("options, backend", [({"cpu_offload": True}, "cuda:nccl,cpu:gloo"),
                                              ({}, "nccl")])
def test_fsdp_cpu_offload_creates_the_group_with_a_cpu_backend(monkeypatch, options, backend):
    """Runtime.launch on a faked 2-GPU node under torchrun: the backend it passes to init_process_group."""
    import torch.distributed as dist

    _env(monkeypatch, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    _fake_cuda(monkeypatch, 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    asked = {}

    def init_process_group(**kwargs):
        asked.update(kwargs)
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    rt = Runtime(accelerator="cuda", strategy="fsdp", strategy_options=options)
    with pytest.raises(_Stop):
        rt.launch()
    assert asked["backend"] == backend and rt.device == torch.device("cuda", 1)
    assert asked["device_id"] == torch.device("cuda", 1)  # bound: device meshes split their groups from it


def test_a_one_gpu_pod_takes_cuda_0_whatever_its_rank(monkeypatch):
    """A PyTorchJob worker pod (RANK=1, no LOCAL_RANK) on a one-GPU node: local rank 0, cuda:0 (local rank was
    taken to be RANK, and devices.cuda_index raised)."""
    _env(monkeypatch, {"MASTER_ADDR": "t-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1",
                       "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "auto", "PET_NNODES": "2"})
    _fake_cuda(monkeypatch, 1)
    rt = Runtime(accelerator="cuda")
    assert rt.device == torch.device("cuda", 0)
    assert (rt.world.rank, rt.world.local_rank, rt.world.world_size, rt.world.per_node) == (1, 0, 2, None)
