"""The command line as a user runs it, in a subprocess; a bad flag and two more environments of `trainscale env` in
this process, through the command's ``main``."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainscale.cli import main

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(args, timeout=240, **kwargs):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=kwargs.get("cwd", ROOT), env=env)


def test_help_lists_commands_without_importing_torch():
    out = run([str(BIN / "trainscale"), "--help"])
    assert out.returncode == 0
    for command in ("run", "demo", "bench", "report", "slurm", "k8s", "env"):
        assert command in out.stdout
    probe = run([sys.executable, "-c", "import sys; from trainscale.cli import build_parser; build_parser(); "
                 "print('torch' in sys.modules)"])
    assert probe.stdout.strip() == "False"


def test_env(monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):  # as ``run`` leaves them
        monkeypatch.delenv(name, raising=False)
    assert main(["env"]) == 0  # in this process: the next test runs the command in a subprocess
    out = capsys.readouterr().out
    assert "torch" in out and "gloo" in out
    assert "launcher       none" in out


def test_env_names_the_launcher_detected_and_why(monkeypatch, capsys):
    pod = {"MASTER_ADDR": "t-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "4", "RANK": "1", "PET_NODE_RANK": "1",
           "PET_NPROC_PER_NODE": "2", "PET_NNODES": "2"}  # a PyTorchJob worker pod, 2 processes per pod
    out = subprocess.run([str(BIN / "trainscale"), "env"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **pod})
    assert out.returncode == 0, out.stderr
    assert re.search(r"^launcher +kubernetes$", out.stdout, re.M)
    assert re.search(r"^detected from +RANK=1, WORLD_SIZE=4, PET_NNODES=2.*Kubeflow PyTorchJob pod", out.stdout, re.M)
    assert re.search(r"^world +node 1 of 2, rendezvous t-master-0:23456; .*\(2 processes", out.stdout, re.M)
    volcano = {"MASTER_ADDR": "job-master-0.job", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1",
               "VC_MASTER_HOSTS": "job-master-0.job", "VC_MASTER_NUM": "1", "VC_WORKER_HOSTS": "job-worker-0.job",
               "VC_WORKER_NUM": "1", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}  # Volcano's pytorch + svc plugins
    for name, value in volcano.items():  # the same command in this process: the pod's run above was the subprocess
        monkeypatch.setenv(name, value)
    assert main(["env"]) == 0
    assert re.search(r"^detected from +RANK=1, WORLD_SIZE=2, VC_MASTER_HOSTS=.*\(a Volcano pod", capsys.readouterr().out,
                     re.M)


@pytest.fixture(scope="module")
def demo_one_epoch(tmp_path_factory):
    """``trainscale demo --devices 2 --epochs 1``, run once: the completed process and its root directory."""
    root = tmp_path_factory.mktemp("demo")
    return run([str(BIN / "trainscale"), "demo", "--devices", "2", "--epochs", "1", "--out", str(root),
                "--no-progress-bar"]), root


@pytest.mark.multiprocess
def test_demo_one_epoch_on_two_processes(demo_one_epoch):
    out, root = demo_one_epoch
    assert out.returncode == 0, out.stderr[-3000:]
    assert "epoch 1/1" in out.stdout and "final validation accuracy" in out.stdout
    summary = json.loads((root / "version_0" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp" and summary["global_batch_size"] == 128
    assert summary["val_accuracy"] > 0.8  # one epoch on real digits


@pytest.mark.multiprocess
def test_demo_lm_on_two_processes_reports_loss_perplexity_and_tokens_per_s(tmp_path):
    out = run([str(BIN / "trainscale"), "demo", "--workload", "lm", "--model", "tiny", "--context-length", "32",
               "--steps", "40", "--lr", "1e-2", "--out", str(tmp_path), "--no-progress-bar"])
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "version_0" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp" and summary["steps"] == 40
    assert summary["global_batch_size"] == 32  # 16 sequences per device by default
    line = next(l for l in out.stdout.splitlines() if l.startswith("final validation loss"))
    assert f"{summary['val_loss']:.4f} nats/byte" in line and "perplexity" in line and "tokens/s" in line
    assert summary["val_loss"] < 3.6  # from ln 256 = 5.55 at initialisation


@pytest.mark.multiprocess
def test_run_starts_a_script_under_torchrun(tmp_path):
    out = run([str(BIN / "trainscale"), "run", "-n", "2", str(ROOT / "examples" / "train_ddp.py"), "--epochs", "1",
               "--out", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world_size=2" in out.stdout
    assert json.loads((tmp_path / "version_0" / "summary.json").read_text())["world_size"] == 2


@pytest.mark.multiprocess
def test_script_with_devices_2_relaunches_itself(demo_one_epoch):
    """The ``trainscale`` command is a Python script: asked for ``--devices 2`` outside any launcher, it becomes
    torchrun's agent for 2 copies of itself (``launch.become_torchrun``), whose rank zero alone prints."""
    out, _ = demo_one_epoch
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("final validation accuracy: ") == 1 and "(world size 2, ddp)" in out.stdout


def test_bad_flag_is_a_one_line_error(tmp_path, capsys):
    assert main(["demo", "--devices", "0", "--out", str(tmp_path)]) == 2  # the command's main, in this process
    err = capsys.readouterr().err
    assert "devices=0 must be >= 1" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_report_without_matplotlib_writes_report_txt_and_says_how_to_get_plots(tmp_path, monkeypatch, capsys):
    """As after `make demo` (which does not install matplotlib), through the command's ``main`` in this process
    (tests/test_telemetry_distributed.py runs `trainscale report` in a subprocess)."""
    from torch.utils.data import DataLoader

    from tests import workers
    from trainscale import Trainer

    trainer = Trainer(max_epochs=1, log_every_n_steps=2, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(workers.make_model(), DataLoader(workers.tiny_dataset(32), batch_size=8), optimizer=workers.sgd)
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails, as when it is not installed
    assert main(["report", str(trainer.run_dir)]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "Traceback" not in out.out
    assert (trainer.run_dir / "report.txt").read_text() in out.out
    assert not list(trainer.run_dir.glob("*.png"))
    hints = [line for line in out.out.splitlines() if "trainscale[plot]" in line]
    assert hints == ["plots skipped: matplotlib is not installed (pip install 'trainscale[plot]' adds them)"]
