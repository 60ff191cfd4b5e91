"""SLURM: the hostlist parser, World from fixed SLURM environments, the allocation check, a real
2-task SLURM-style launch, and the sbatch script of `trainscale slurm` checked with `bash -n`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainscale.runtime import slurm
from trainscale.runtime.world import World

ROOT = Path(__file__).resolve().parents[1]
TRAINSCALE = str(Path(sys.executable).parent / "trainscale")


@pytest.mark.parametrize("text, hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("gpu5", ["gpu5"]),
    ("a[1-2]-ib[8-9]", ["a1-ib8", "a1-ib9", "a2-ib8", "a2-ib9"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("x[3],y[1,2]", ["x3", "y1", "y2"]),
])
def test_expand_hostlist(text, hosts):
    assert slurm.expand_hostlist(text) == hosts
    assert slurm.first_host(text) == hosts[0]  # what the World reads, without expanding the rest


@pytest.mark.parametrize("text", ["node[01-03", "node01]", "node[a-b]", "node[5-3]"])
def test_bad_hostlist(text):
    with pytest.raises(ValueError, match="hostlist"):
        slurm.expand_hostlist(text)


def test_tasks_per_node():
    assert slurm.tasks_per_node("4(x2),3") == [4, 4, 3]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        slurm.tasks_per_node("4(2)")
    for spec in ("4(x2),3", "8", "2,8(x3),1(x2)"):
        per_node = slurm.tasks_per_node(spec)
        assert [slurm.tasks_on_node(spec, n) for n in range(len(per_node) + 1)] == \
            [(t, len(per_node)) for t in per_node] + [(None, len(per_node))]


SLURM_ENV = {"SLURM_JOB_ID": "12345", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
             "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]",
             "SLURM_RESTART_COUNT": "2", "SLURM_STEP_ID": "0"}


def test_world_from_slurm():
    w = World.from_env(SLURM_ENV)
    assert (w.launcher, w.world_size, w.rank, w.local_rank, w.local_world_size, w.node_rank) == \
        ("slurm", 8, 5, 1, 4, 1)
    assert (w.master_addr, w.master_port, w.restart_count, w.job_id, w.num_nodes) == \
        ("gpu07", 15000 + 12345 % 20000, 2, "12345", 2)


def test_master_address_and_port_from_the_environment_win():
    w = World.from_env({**SLURM_ENV, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"})
    assert (w.master_addr, w.master_port) == ("10.0.0.1", 29400)


def test_torchrun_inside_slurm_takes_precedence():
    env = {**SLURM_ENV, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "TORCHELASTIC_RUN_ID": "abc"}
    w = World.from_env(env)
    assert (w.launcher, w.world_size, w.rank, w.job_id) == ("torchrun", 2, 1, "abc")


@pytest.mark.parametrize("change, message", [
    ({"SLURM_PROCID": "8"}, "SLURM_PROCID=8"),
    ({"SLURM_NTASKS": "eight"}, "SLURM_NTASKS='eight'"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2"),
])
def test_inconsistent_slurm_environment(change, message):
    with pytest.raises(ValueError, match=message):
        World.from_env({**SLURM_ENV, **change})


def test_allocation_check_names_the_sbatch_lines():
    slurm.check_allocation(8, 4, 2, devices=4, requested_nodes=2)  # matches
    with pytest.raises(ValueError, match=r"--nodes=2.*--ntasks-per-node=8"):
        slurm.check_allocation(8, 4, 2, devices=8, requested_nodes=2)


def test_runtime_refuses_an_allocation_that_does_not_match(monkeypatch):
    from trainscale.runtime.runtime import Runtime

    for key, value in {**SLURM_ENV, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"SLURM started 8 tasks on 2 node\(s\).*devices×num_nodes=2×1"):
        Runtime(accelerator="cpu", devices=2, num_nodes=1)
    rt = Runtime(accelerator="cpu")  # devices="auto" follows the allocation
    assert (rt.config.devices, rt.config.num_nodes, rt.world.launcher) == (4, 2, "slurm")


def test_trainscale_slurm_writes_a_valid_sbatch_script(tmp_path):
    path = tmp_path / "job.sbatch"
    out = subprocess.run([TRAINSCALE, "slurm", "--nodes", "2", "--gpus-per-node", "4", "--time", "01:00:00",
                          "-o", str(path), "train.py", "--lr", "1e-3", "--name", "it's"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = path.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --signal=USR1@90", "#SBATCH --requeue", "#SBATCH --time=01:00:00"):
        assert line in text
    assert ("srun --kill-on-bad-exit=1 --cpus-per-task=\"$SLURM_CPUS_PER_TASK\" python train.py --lr 1e-3 "
            "--name 'it'\"'\"'s'") in text
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    bad = subprocess.run([TRAINSCALE, "slurm", "--nodes", "0", "--gpus-per-node", "4", "train.py"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nodes=0" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("flag, value", [
    ("--job-name", "x\necho INJECTED"), ("--job-name", "a b"), ("--job-name", "x;rm -rf ~"),
    ("--job-name", "$(id)"), ("--job-name", ""), ("--partition", "gpu\ntouch /tmp/pwned"),
    ("--partition", "gpu`id`"), ("--account", "lab'x"), ("--output", "log\nid"),
])
def test_unsafe_names_are_refused_naming_the_flag(flag, value):
    slurm.check_sbatch_value(flag, "gpu-a100_01.x,debug")  # a plain name passes
    with pytest.raises(ValueError, match=f"^{flag} .*no newline") as err:
        slurm.check_sbatch_value(flag, value)
    assert "\n" not in str(err.value)  # one line, the value shown escaped


@pytest.mark.parametrize("value", ["30", "30:00", "04:00:00", "1-12", "1-12:30", "2-00:00:00", "UNLIMITED"])
def test_slurm_time_formats_are_accepted(value):
    assert slurm.check_sbatch_value("--time", value, time=True) == value


@pytest.mark.parametrize("value", ["abc", "", "1:2:3:4", "1-", "-5", "4h", "04:00:00\nid", "1-2-3", "04:00:00 "])
def test_bad_times_are_refused(value):
    with pytest.raises(ValueError, match=r"^--time .*not a SLURM time"):
        slurm.check_sbatch_value("--time", value, time=True)


def test_an_injection_attempt_never_reaches_the_script(tmp_path):
    with pytest.raises(ValueError, match="--job-name"):
        slurm.sbatch_script(["python", "t.py"], nodes=1, gpus_per_node=1, job_name="x\necho INJECTED")
    with pytest.raises(ValueError, match="--partition"):
        slurm.sbatch_script(["python", "t.py"], nodes=1, gpus_per_node=1, partition="gpu\necho INJECTED")
    with pytest.raises(ValueError, match="--time"):
        slurm.sbatch_script(["python", "t.py"], nodes=1, gpus_per_node=1, time="abc")
    text = slurm.sbatch_script(["python", "t.py", "$(echo INJECTED)", "a\necho INJECTED"], nodes=2,
                               gpus_per_node=4, job_name="run-1", partition="gpu,debug", account="lab",
                               time="1-12:00")
    for line in ("#SBATCH --job-name=run-1", "#SBATCH --partition=gpu,debug", "#SBATCH --account=lab",
                 "#SBATCH --time=1-12:00"):
        assert line in text.splitlines()
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    # run the script's srun line with `srun` replaced by printing its arguments: nothing is executed
    srun_line = text[text.index("\nsrun ") + 1:]  # to the end: a quoted argument may hold a newline
    shown = subprocess.run(["bash", "-c", "srun() { printf '<%s>' \"$@\"; }; " + srun_line],
                           env={"SLURM_CPUS_PER_TASK": "6", "PATH": os.environ["PATH"]},
                           capture_output=True, text=True, timeout=30)
    assert shown.stdout == ("<--kill-on-bad-exit=1><--cpus-per-task=6><python><t.py><$(echo INJECTED)>"
                            "<a\necho INJECTED>"), shown


def test_trainscale_slurm_refuses_a_bad_value_in_one_line():
    for flags, name in ((["--job-name", "x\necho INJECTED"], "--job-name"), (["--time", "abc"], "--time"),
                        (["--python", ""], "--python ''"), (["--nodes", "0"], "nodes=0"),
                        (["--cpus-per-task", "-1"], "cpus_per_task=-1"), (["--signal-seconds", "nan"], "--signal-seconds"),
                        (["-o", "/no/such/dir/job.sbatch"], "the directory /no/such/dir does not exist")):
        bad = subprocess.run([TRAINSCALE, "slurm", "--nodes", "1", "--gpus-per-node", "1", *flags, "train.py"],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stdout == "", bad
        last = bad.stderr.strip().splitlines()[-1]  # argparse's own type errors print the usage first
        assert last.startswith("trainscale slurm: error: ") and name in last and "Traceback" not in bad.stderr


def test_trainscale_slurm_never_overwrites_the_script_or_a_file_it_did_not_write(tmp_path):
    script, notes, job = tmp_path / "train.py", tmp_path / "notes.txt", tmp_path / "job.sbatch"
    script.write_text("print('train')\n")
    notes.write_text("my notes\n")
    args = [TRAINSCALE, "slurm", "--nodes", "1", "--gpus-per-node", "1"]
    for output, name in ((script, "training script itself"), (notes, "was not written by `trainscale slurm`"),
                         (tmp_path, "is not a file")):
        bad = subprocess.run([*args, "-o", str(output), str(script)], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and name in bad.stderr and "Traceback" not in bad.stderr, bad
    assert script.read_text() == "print('train')\n" and notes.read_text() == "my notes\n"
    for _ in range(2):  # a new file, then a previous sbatch script of ours: both written
        ok = subprocess.run([*args, "-o", str(job), str(script)], capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and slurm.SBATCH_MARK in job.read_text(), ok


def test_slurm_variables_without_srun_warn_once_naming_srun(monkeypatch):
    monkeypatch.setattr(slurm, "_warned_not_srun", False)
    batch_env = {k: v for k, v in SLURM_ENV.items() if k != "SLURM_STEP_ID"}  # the batch script itself
    with pytest.warns(RuntimeWarning, match=r"SLURM_NTASKS=8 but this process was not started by srun.*`srun python"):
        World.from_env(batch_env)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        World.from_env(batch_env)  # once only
        monkeypatch.setattr(slurm, "_warned_not_srun", False)
        World.from_env(SLURM_ENV)  # started by srun: no warning
        World.from_env({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1"})  # one task: nothing to wait for
    monkeypatch.setattr(slurm, "_warned_not_srun", False)
    with pytest.warns(RuntimeWarning, match="not started by srun"):  # a salloc shell: no SLURM_PROCID either
        assert slurm.warn_if_not_srun({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4"})
