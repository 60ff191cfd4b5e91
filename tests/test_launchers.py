"""The tiny ddp job of tests/launcher_job.py (``Trainer(devices="auto")``, seed 0) under each launcher, ending with
the weights of the same job on ranks forked with torchrun's variables (``run_distributed``), bit for bit.

Where a launcher program runs here, it starts real processes on localhost: Kubeflow PyTorchJob pods that run
torchrun (2 × 2 processes), Debian's Open MPI ``mpirun -np 2`` and MPICH ``mpiexec -n 2``, and Ray Train's
TorchTrainer; every process group is killed at the end. Where the launcher is only the variables it sets (pods
started with ``python``: TrainJob and Volcano with and without its env plugin; LSF's jsrun with a generated rank
file; srun's tasks; MPICH's Hydra, MVAPICH2's two launchers and Cray PALS), two ranks are forked like the
reference's, each with exactly that launcher's variables: a fresh interpreter would only add its imports (7-8 s for
2 processes here, against under 1 s forked). Each test takes 0.5-55 s here (up to 6 processes importing torch,
on 2 cores shared with the other pytest worker); its limit is twice that, so load slows it but does not fail it."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import launcher_job
from tests.helpers import free_port, run_distributed

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "tests" / "launcher_job.py")
# Launchers' variables the test process may carry (pytest inside a job): none reaches the "pods".
_LAUNCHER_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "ROLE_", "NODE_RANK", "MASTER_", "TORCHELASTIC",
                      "SLURM_", "PET_", "OMPI_", "PMI", "MPI_", "MV2_", "PALS_", "JSM_", "LSB_", "RAY_", "VC_", "VK_",
                      "KUBERNETES_")


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run_all(commands: list[tuple[list[str], dict]], tmp_path: Path, timeout: float = 90) -> str:
    """Start every (argv, env) at once, each in its own process group; wait for all; kill every group at
    the end (a hang or a failure leaves nothing behind). Returns the joined logs; fails with them."""
    procs = []
    for i, (argv, env) in enumerate(commands):
        log = open(tmp_path / f"process{i}.log", "w+")
        procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                       start_new_session=True), log))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for p, _ in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    logs = []
    for p, log in procs:
        log.seek(0)
        logs.append(log.read())
        log.close()
    tails = "\n".join(f"--- process {i} (exit {p.returncode})\n{out[-3000:]}" for i, ((p, _), out) in
                      enumerate(zip(procs, logs)))
    assert all(p.returncode == 0 for p, _ in procs), tails
    # Whole logs: a non-master torchrun agent may end with a long traceback of the master's store closing
    # first (exit 0), which would push the launch lines out of a tail.
    return "\n".join(f"--- process {i} (exit {p.returncode})\n{out}" for i, ((p, _), out) in
                     enumerate(zip(procs, logs)))


@pytest.fixture(scope="module")
def reference_weights(tmp_path_factory):
    """The job's final weights on N ranks forked by ``run_distributed`` with torchrun's variables (each N run
    once): the same Trainer, DDP and gloo as under any launcher, without a launcher's processes to start."""
    done = {}

    def weights(world_size: int) -> dict:
        if world_size not in done:
            root = tmp_path_factory.mktemp(f"reference{world_size}")
            done[world_size] = run_distributed(launcher_job.forked_rank, str(root), world_size=world_size,
                                               timeout=90)[0][1]
        return done[world_size]

    return weights


def _same_weights(got: Path | dict, expected: dict) -> None:
    got = torch.load(got) if isinstance(got, Path) else got
    assert got.keys() == expected.keys()
    for name in expected:  # the same reductions in the same order: equal to the bit
        assert torch.equal(got[name], expected[name]), f"{name}: max difference " \
            f"{(got[name] - expected[name]).abs().max().item():.3g}"


def _pods(tmp_path: Path, per_pod: list[dict]) -> list[tuple[list[str], dict]]:
    """One ``python launcher_job.py`` per pod, each with its own environment and run directory."""
    return [([sys.executable, JOB, str(tmp_path / "weights.pt"), str(tmp_path / f"pod{i}")], {**_clean_env(), **env})
            for i, env in enumerate(per_pod)]


@pytest.mark.timeout(120)
def test_pytorchjob_pods_of_two_processes_each_start_them_with_torchrun(tmp_path, reference_weights):
    """A PyTorchJob with a master and one worker, nprocPerNode 2, each container `python train.py`: the
    operator's variables (training-operator v1.9; MASTER_ADDR is the master pod's service, here localhost)."""
    expected = reference_weights(4)
    port = str(free_port())

    def pod(index: int) -> dict:
        return {"PYTHONUNBUFFERED": "1", "MASTER_PORT": port, "PET_MASTER_PORT": port, "MASTER_ADDR": "localhost",
                "PET_MASTER_ADDR": "localhost", "WORLD_SIZE": "4", "RANK": str(index), "PET_NODE_RANK": str(index),
                "PET_NPROC_PER_NODE": "2", "PET_NNODES": "2"}

    logs = _run_all(_pods(tmp_path, [pod(0), pod(1)]), tmp_path)
    assert logs.count("starts 2 processes with torchrun") == 2 and logs.count("LAUNCHER torchrun") == 4
    _same_weights(tmp_path / "weights.pt", expected)


def _free_lsf_job_id() -> str:
    """An LSB_JOBID whose derived port (15000 + id % 20000, as the LSF reader computes it) is free here."""
    for _ in range(100):
        job_id = random.randrange(1, 10**6)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + job_id % 20000))
                return str(job_id)
            except OSError:
                continue
    raise RuntimeError("no free port in 15000-34999")


_MPICH = shutil.which("mpiexec.mpich") or shutil.which("mpiexec.hydra")


def _open_mpi() -> list[str]:
    """Open MPI's mpirun: its ranks derive the rendezvous port from the job id."""
    return ["mpirun", *(["--allow-run-as-root"] if os.geteuid() == 0 else []), "--oversubscribe", "-np", "2"]


def _mpich() -> list[str]:
    """MPICH's mpiexec (Hydra) gives no job id to derive a port from: MASTER_PORT, as a user passes it."""
    return [_MPICH, "-n", "2", "-genv", "MASTER_PORT", str(free_port())]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher, flavour", [
    pytest.param(_open_mpi, "Open MPI", id="open-mpi", marks=pytest.mark.skipif(
        shutil.which("mpirun") is None,
        reason="mpirun not found: `make test` installs Debian's openmpi-bin where apt-get runs as root")),
    pytest.param(_mpich, "MPICH / Intel MPI", id="mpich", marks=pytest.mark.skipif(
        _MPICH is None,
        reason="MPICH's mpiexec.mpich/mpiexec.hydra not found: `make test` installs Debian's mpich where apt-get "
               "runs as root")),
])
def test_mpirun_two_processes(launcher, flavour, tmp_path, reference_weights):
    expected = reference_weights(2)
    argv = [*launcher(), sys.executable, JOB, str(tmp_path / "weights.pt"), str(tmp_path)]
    logs = _run_all([(argv, _clean_env())], tmp_path)
    assert len(re.findall(rf"LAUNCHER mpi FROM [^()]*\(a process of {re.escape(flavour)}'s mpirun\)", logs)) == 2
    _same_weights(tmp_path / "weights.pt", expected)


# What each launcher sets for rank r of 2 processes on one node (``tmp`` holds a file a launcher points to). Under
# MPICH, MVAPICH2 and PALS, MASTER_PORT is the user's (`mpiexec -genv MASTER_PORT ...`): none of them gives a job id
# to derive a port from, and the worlds must not meet at 29500.
def _mpich_hydra(r: int, tmp: Path, port: str) -> dict:
    """MPICH's mpiexec (Hydra): `mpiexec.mpich -n 2 env` with Debian's mpich 4.0.2 prints these."""
    return {"PMI_RANK": str(r), "PMI_SIZE": "2", "MPI_LOCALRANKID": str(r), "MPI_LOCALNRANKS": "2",
            "PMI_FD": str(6 + 2 * r), "HYDI_CONTROL_FD": "7", "MPIR_CVAR_CH3_INTERFACE_HOSTNAME": socket.gethostname(), "MASTER_PORT": port}


def _mvapich2_hydra(r: int, tmp: Path, port: str) -> dict:
    """MVAPICH2 2.3.7's mpiexec (its Hydra, src/pm/hydra/pm/pmiserv/pmip_cb.c): MPICH's PMI_RANK and PMI_SIZE
    beside a complete MV2_COMM_WORLD_*, without MPICH's MPI_LOCALRANKID."""
    return {"PMI_RANK": str(r), "PMI_FD": str(6 + 2 * r), "PMI_SIZE": "2", "MV2_COMM_WORLD_SIZE": "2",
            "MV2_COMM_WORLD_LOCAL_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": str(r), "MV2_COMM_WORLD_RANK": str(r),
            "MASTER_PORT": port}


def _mvapich2_mpirun_rsh(r: int, tmp: Path, port: str) -> dict:
    """MVAPICH2 2.3.7's mpirun_rsh (its mpispawn, src/pm/mpirun/mpispawn.c): MV2_COMM_WORLD_* and PMI_ID, no
    PMI_RANK; MPIRUN_ID is mpirun_rsh's process id."""
    return {"MPIRUN_MPD": "0", "MPIRUN_NPROCS": "2", "MPIRUN_ID": "40123", "MV2_NUM_NODES_IN_JOB": "1",
            "MV2_NODE_ID": "0", "PMI_PORT": f"{socket.gethostname()}:41234", "USE_TOTALVIEW": "0", "PMI_ID": str(r),
            "MV2_COMM_WORLD_RANK": str(r), "MV2_COMM_WORLD_LOCAL_RANK": str(r), "MV2_COMM_WORLD_LOCAL_SIZE": "2",
            "MV2_COMM_WORLD_SIZE": "2", "MASTER_PORT": port}


def _cray_pals(r: int, tmp: Path, port: str) -> dict:
    """HPE Cray MPICH under PALS's `mpiexec -n 2 --ppn 2` (closed source: the names ALCF's Polaris and Aurora
    guides read, as in tests/test_world.py): Cray PMI's PMI_* and PALS's own PALS_*."""
    return {"PMI_RANK": str(r), "PMI_SIZE": "2", "PMI_LOCAL_RANK": str(r), "PMI_LOCAL_SIZE": "2",
            "PALS_RANKID": str(r), "PALS_LOCAL_RANKID": str(r), "PALS_LOCAL_SIZE": "2", "PALS_NODEID": "0",
            "PALS_APID": "8e4c3f2a-91d0-4b7e-a5c6-0d2f7b9e1a34", "MASTER_PORT": port}


def _trainjob(r: int, tmp: Path, port: str) -> dict:
    """A Kubeflow TrainJob pod started with ``python`` (Trainer v2's torch plugin; a CPU pod's
    PET_NPROC_PER_NODE is its CPU request, 1 here), one process per pod."""
    return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(r), "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": port}


def _volcano(r: int, tmp: Path, port: str) -> dict:
    """A Volcano job's pod under its default set-up (pytorch and svc plugins: master + 1 worker), one process per
    pod: the svc plugin's VC_<TASK>_HOSTS/_NUM, no VC_TASK_INDEX."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(r),
            "VC_MASTER_HOSTS": "job-master-0.job", "VC_MASTER_NUM": "1", "VC_WORKER_HOSTS": "job-worker-0.job",
            "VC_WORKER_NUM": "1"}


def _volcano_env_plugin(r: int, tmp: Path, port: str) -> dict:
    """The same pods with Volcano's env plugin too: VC_TASK_INDEX and VK_TASK_INDEX, the pod's index within its
    task (0 for master-0 and for worker-0)."""
    return {**_volcano(r, tmp, port), "VC_TASK_INDEX": "0", "VK_TASK_INDEX": "0"}


def _lsf_jsrun(r: int, tmp: Path, port: str) -> dict:
    """LSF's jsrun: JSM_NAMESPACE_* and the rank file whose first compute host (after the launch node) is the
    rendezvous; the port is derived from LSB_JOBID."""
    rankfile, job = tmp / "rankfile", tmp / "lsb_jobid"
    if not job.exists():  # the same job for both ranks
        rankfile.write_text(f"launch-node\n{socket.gethostname()}\n{socket.gethostname()}\n")
        job.write_text(_free_lsf_job_id())
    job_id = job.read_text()
    return {"LSB_JOBID": job_id, "LSB_DJOB_RANKFILE": str(rankfile), "JSM_NAMESPACE_SIZE": "2",
            "JSM_NAMESPACE_LOCAL_SIZE": "2", "JSM_NAMESPACE_RANK": str(r), "JSM_NAMESPACE_LOCAL_RANK": str(r)}


def _slurm_srun(r: int, tmp: Path, port: str) -> dict:
    """Two tasks of `srun --ntasks=2` on one node (a subset of what srun exports; MASTER_PORT as a user's sbatch
    script sets it)."""
    return {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "2",
            "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r),
            "MASTER_PORT": port}


# No launcher program runs in these: the ranks are forked like the reference's, each with only the launcher's
# variables (a fresh interpreter would add only its imports: 7-8 s for 2 processes here, under 1 s forked).
@pytest.mark.timeout(60)
@pytest.mark.parametrize("variables, detected", [
    pytest.param(_mpich_hydra, "(a process of MPICH / Intel MPI's mpirun)", id="mpich"),
    pytest.param(_mvapich2_hydra, "(a process of MVAPICH's mpirun)", id="mvapich2-mpiexec"),
    pytest.param(_mvapich2_mpirun_rsh, "(a process of MVAPICH's mpirun)", id="mvapich2-mpirun_rsh"),
    pytest.param(_cray_pals, "(a process of Cray MPICH (PALS)'s mpirun)", id="cray-pals"),
    pytest.param(_trainjob, "(a Kubeflow TrainJob pod: one process per pod)", id="trainjob"),
    pytest.param(_volcano, "(a Volcano pod: one process per pod)", id="volcano"),
    pytest.param(_volcano_env_plugin, "VC_TASK_INDEX=0", id="volcano-env-plugin"),
    pytest.param(_lsf_jsrun, "(a process started by jsrun)", id="lsf-jsrun"),
    pytest.param(_slurm_srun, "(a task started by srun)", id="slurm-srun"),
])
def test_launcher_variables_on_forked_ranks(variables, detected, tmp_path, reference_weights, monkeypatch):
    expected = reference_weights(2)
    for name in list(os.environ):  # pytest inside a job: only the launcher's variables reach the ranks
        if name.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    port = str(free_port())
    ranks = run_distributed(launcher_job.forked_rank, str(tmp_path), world_size=2, timeout=50,
                            launcher_env=[variables(r, tmp_path, port) for r in (0, 1)])
    assert all(detected in detected_from for detected_from, _ in ranks), [d for d, _ in ranks]
    _same_weights(ranks[0][1], expected)


# Ray starts a head node (GCS, raylet, its own workers) and Ray Train its controller's actors before the two
# training workers: 37 s and 51 s of CPU alone on the 2 cores here (42-46 s and 62-67 s with Ray's defaults), more
# while the other pytest worker runs, so this one test gets twice the usual limit rather than fail under load.
@pytest.mark.timeout(150)
def test_ray_train_torch_trainer_with_two_cpu_workers(tmp_path, reference_weights):
    pytest.importorskip("ray.train.torch", reason="Ray Train is the optional extra `ray` (pip install -e .[ray])")
    expected = reference_weights(2)
    # Without Ray Train's preemption watcher and metrics (optional services that touch neither the workers'
    # variables nor their process group): one Ray process fewer.
    env = {**_clean_env(), "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
           "RAY_TRAIN_METRICS_ENABLED": "0"}
    logs = _run_all([([sys.executable, JOB, "--ray", str(tmp_path / "weights.pt"), str(tmp_path)], env)], tmp_path,
                    timeout=120)
    assert "LAUNCHER ray" in logs
    _same_weights(tmp_path / "weights.pt", expected)
