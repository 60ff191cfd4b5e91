"""`trainscale run` as a user runs it, in a subprocess: flags, early errors, the failing rank's error
printed last, no restart of errors that recur, a held rendezvous port, workers that die with their agent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainscale.runtime import launch

ROOT = Path(__file__).resolve().parents[1]
TRAINSCALE = [sys.executable, "-m", "trainscale.cli"]


def _env() -> dict:  # the trainscale this test imports (PYTHONPATH as given), without a launcher's variables
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}


def _run(args, timeout=120, cwd=None):
    return subprocess.run([*TRAINSCALE, *args], capture_output=True, text=True, timeout=timeout, env=_env(), cwd=cwd)


def _script(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- flags and early errors (no process started) ------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--max-restarts", "-1"], "--max-restarts -1 must be >= 0"),
    (["--nnodes", "abc"], "--nnodes 'abc' must be a node count N or an elastic range MIN:MAX"),
    (["--nnodes", "4:2"], "--nnodes '4:2' must be a node count N or an elastic range MIN:MAX"),
])
def test_bad_run_flags_are_one_line_errors(tmp_path, flags, message):
    out = _run(["run", *flags, _script(tmp_path, "ok.py", "print('hi')\n")], timeout=60)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_missing_script_and_syntax_error_fail_before_any_launch(tmp_path):
    out = _run(["run", "-n", "2", "--max-restarts", "3", str(tmp_path / "nope.py")], timeout=60)
    assert out.returncode == 2 and "nope.py' not found" in out.stderr and "torch.distributed" not in out.stderr
    broken = _script(tmp_path, "broken.py", "x = 1\nprint(x +)\n")
    out = _run(["run", "-n", "2", "--max-restarts", "3", broken], timeout=60)
    assert out.returncode == 2 and "broken.py:2: SyntaxError" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# -- the script's own flags ----------------------------------------------------------------------
ECHO = "import sys\nprint('ARGV', sys.argv[1:], flush=True)\n"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_scripts_own_flags_are_never_parsed_by_torchrun(tmp_path):
    # "--d" was torchrun's "ambiguous option"; "--n"/"--max" prefixes of trainscale run's own flags
    out = _run(["run", "-n", "1", _script(tmp_path, "echo.py", ECHO), "--d", "192", "--n", "5", "--max", "3",
                "--nnodes", "7"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ARGV ['--d', '192', '--n', '5', '--max', '3', '--nnodes', '7']" in out.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_self_relaunching_script_keeps_its_own_flags_and_prints_the_failing_ranks_error_last(tmp_path):
    script = _script(tmp_path, "relaunch.py", (
        "import argparse, os, time\nfrom trainscale import Runtime\n"
        "p = argparse.ArgumentParser(); p.add_argument('--d', type=int); args = p.parse_args()\n"
        "rt = Runtime(accelerator='cpu', devices=2, timeout=60)\nrt.launch()\n"
        "rt.print('WORLD', rt.world_size, 'D', args.d)\n"
        "def load_shard(rank):\n"
        "    if rank == 1:\n"
        "        raise FileNotFoundError(f'checkpoint is missing its shard file __{rank}_0.distcp')\n"
        "    time.sleep(20)\n"
        "load_shard(int(os.environ['RANK']))\n"))
    out = subprocess.run([sys.executable, script, "--d", "192"], capture_output=True, text=True, timeout=150,
                         env=_env())
    assert "WORLD 2 D 192" in out.stdout, out.stderr[-3000:]  # the script's own flag reached the relaunched ranks
    assert out.returncode != 0
    tail = out.stderr.rstrip().splitlines()
    assert "ChildFailedError" in out.stderr  # torchrun's own summary comes first ...
    assert tail[-1] == "FileNotFoundError: checkpoint is missing its shard file __1_0.distcp", tail[-12:]  # ... then this
    assert "trainscale: rank 1 (node 0, local rank 1) failed first" in "\n".join(tail[-8:])


# -- failures: the rank's own error last, no restart of errors that recur ----------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_the_failing_ranks_own_error_is_printed_last(tmp_path):
    script = _script(tmp_path, "fail.py", (
        "import os, time\n"
        "def load_shard(rank):\n"
        "    if rank == 1:\n"
        "        raise KeyError(f'shard {rank} missing')\n"
        "    time.sleep(5)\n"
        "load_shard(int(os.environ['RANK']))\n"))
    out = _run(["run", "-n", "2", script])
    assert out.returncode != 0
    tail = out.stderr.rstrip().splitlines()
    assert "ChildFailedError" in out.stderr  # torchrun's own summary comes first ...
    assert tail[-1] == "KeyError: 'shard 1 missing'", tail[-12:]  # ... the rank's error last
    report = "\n".join(tail[-8:])
    assert "rank 1 (node 0, local rank 1) failed first" in report and 'fail.py", line 4, in load_shard' in report


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_rank_that_exits_before_the_first_collective_is_named_with_its_exit_code(tmp_path):
    script = _script(tmp_path, "exits.py", (
        "import os, torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "from trainscale import Trainer\nfrom trainscale.callbacks import Callback\n"
        "class Leave(Callback):\n"
        "    def on_fit_start(self, trainer, module):\n"
        "        if trainer.runtime.world.rank == 1:\n"
        "            os._exit(3)\n"
        "data = TensorDataset(torch.randn(32, 8), torch.randint(0, 4, (32,)))\n"
        "trainer = Trainer(accelerator='cpu', devices='auto', max_steps=2, callbacks=[Leave()], logger=False,\n"
        f"                  enable_progress_bar=False, timeout=30, default_root_dir={str(tmp_path / 'runs')!r})\n"
        "trainer.fit(torch.nn.Linear(8, 4), DataLoader(data, batch_size=8),\n"
        "            optimizer=lambda params: torch.optim.SGD(params, lr=0.1))\n"))
    out = _run(["run", "-n", "2", script])
    assert out.returncode != 0
    tail = out.stderr.rstrip().splitlines()
    assert tail[-1].startswith("trainscale run: rank 1 (local rank 1) exited with code 3 without a Python exception "
                               "(os._exit, a crash in C code, or a signal: see its output above)"), tail[-6:]
    # rank 0 either saw its peer leave and raised (its own error just before, and the last line says it follows),
    # or torchrun stopped it first (then rank 1's line is the whole report): which comes first is a race
    if "rank 0 (node 0, local rank 0) failed first" in out.stderr:
        assert tail[-1].endswith("; the error above follows from it (a peer that left)"), tail[-6:]
        assert "failed because a peer closed its connection" in "\n".join(tail[-4:])


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_an_error_that_recurs_is_not_restarted(tmp_path):
    script = _script(tmp_path, "flags.py", (
        "import argparse\np = argparse.ArgumentParser(); p.add_argument('--lr', type=float); p.parse_args()\n"))
    out = _run(["run", "-n", "1", "--max-restarts", "3", script, "--lr", "abc"])
    assert out.returncode != 0
    assert out.stderr.count("usage: flags.py") == 1, out.stderr  # one attempt, not 1 + 3 restarts
    assert "not restarted (--max-restarts 3)" in out.stderr
    assert out.stderr.rstrip().endswith("(exiting on argparse.ArgumentError: argument --lr: invalid float value: 'abc')")


# -- a held rendezvous port ----------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_rendezvous_port_held_by_another_program_fails_within_seconds(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(8)  # accepts connections (the kernel's backlog) and never answers, like a foreign server
    port = holder.getsockname()[1]
    try:
        start = time.monotonic()
        out = _run(["run", "-n", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job1",
                    _script(tmp_path, "ok.py", ECHO)], timeout=90)
        elapsed = time.monotonic() - start
    finally:
        holder.close()
    assert out.returncode == 2
    assert f"the rendezvous endpoint 127.0.0.1:{port} is held by another program" in out.stderr, out.stderr
    assert "--rdzv-endpoint 127.0.0.1:<a free port> on every node" in out.stderr
    print(f"time to fail with a held rendezvous port: {elapsed:.1f} s")
    assert elapsed < 60  # generous: ~5 s of probing plus Python and torch start-up


def test_a_free_or_real_rendezvous_endpoint_passes_the_check():
    from datetime import timedelta

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    launch.check_rendezvous(f"127.0.0.1:{free}")  # nobody listens: torchrun will host it
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    launch.check_rendezvous(f"127.0.0.1:{store.port}")  # another node's torchrun on this machine hosts it
    with pytest.raises(ValueError, match="must be HOST:PORT"):
        launch.check_rendezvous("localhost")


# -- workers die with their agent ------------------------------------------------------------------
SLEEPER = ("import os, sys, time\n"
           "open(os.path.join(sys.argv[1], f\"worker{os.environ['RANK']}\"), 'w').write(f'{os.getpid()} {os.getppid()}')\n"
           "time.sleep(600)\n")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("victim", ["trainscale", "agent"])
def test_workers_die_when_trainscale_run_or_its_agent_is_killed(tmp_path, victim):
    proc = subprocess.Popen([*TRAINSCALE, "run", "-n", "2", _script(tmp_path, "sleep.py", SLEEPER), str(tmp_path)],
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    try:
        deadline = time.monotonic() + 100
        while len(list(tmp_path.glob("worker*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = [tuple(map(int, p.read_text().split())) for p in sorted(tmp_path.glob("worker*"))]
        assert len(workers) == 2, "the workers did not start"
        agent = workers[0][1]
        os.kill(proc.pid if victim == "trainscale" else agent, signal.SIGKILL)
        killed = time.monotonic()
        while any(_alive(pid) for pid, _ in workers) and time.monotonic() < killed + 30:
            time.sleep(0.05)
        gone_after = time.monotonic() - killed
        assert not any(_alive(pid) for pid, _ in workers), "workers still running after their agent died"
        print(f"workers gone {gone_after:.2f} s after SIGKILL of {victim}")
    finally:
        proc.kill()
        proc.wait()
        for pid in [p for pair in workers for p in pair]:  # never leave a process behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
