"""bench end to end: real torchrun cells on a tiny user workload (an --entry in a temporary package)."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import run_distributed

BIN = Path(sys.executable).parent

WORKLOAD = textwrap.dedent('''
    import time

    import torch
    from torch import nn
    from torch.utils.data import TensorDataset


    class Tiny(nn.Module):
        def __init__(self, fail_above=None):
            super().__init__()
            self.fc = nn.Linear(8, 2)
            self.fail_above = fail_above

        def forward(self, x):
            if self.training and self.fail_above is not None and x.shape[0] > self.fail_above:
                raise torch.OutOfMemoryError(f"out of memory at batch {x.shape[0]} (simulated)")
            return self.fc(x)


    def _data():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(128, 8, generator=g)
        y = (x[:, 0] > 0).long()
        return TensorDataset(x, y), TensorDataset(x[:32], y[:32])


    def build():
        train, val = _data()
        return {"model": Tiny(), "train": train, "val": val, "optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}


    def build_failing():
        train, val = _data()
        return {"model": Tiny(fail_above=8), "train": train, "val": val}


    def build_slow():
        time.sleep(600)


    def build_lm():
        """The built-in lm workload (--workload lm) validated on its first 32 windows instead of 512: on a CPU the
        512 cost a cell several times its timed steps."""
        from trainscale.jobs.workload import WORKLOADS, resolve_entry

        work = resolve_entry(WORKLOADS["lm"])()
        work["val"] = torch.utils.data.Subset(work["val"], range(32))
        return work
''')


def write_workload(root: Path) -> Path:
    """The tiny workload as the package ``benchpkg`` under ``root``; returns ``root``."""
    pkg = root / "benchpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "workload.py").write_text(WORKLOAD)
    return root


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # cells import the entry from the current directory
    monkeypatch.syspath_prepend(str(tmp_path))
    return write_workload(tmp_path)


def bench_cmd(*args):
    return [str(BIN / "trainscale"), "bench", "--warmup-steps", "1", "--steps", "2", "--no-plots", *args]


def clean_env():
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def bench_cli_error(args: list[str], capsys) -> str:
    """``trainscale bench ARGS`` through the command's ``main`` in this process; asserts the bad-flag exit status 2
    and returns stderr. The process boundary adds nothing to a flag error: the one run through the installed
    command (``test_bad_flags_fail_before_any_cell_with_a_one_line_error``) shows it."""
    from trainscale.cli import main

    assert main(["bench", *args]) == 2
    return capsys.readouterr().err


def _cell_rank(rank: int, config: str, log: str) -> None:
    """One rank of a bench cell, as ``python -m trainscale.bench.cell --config CONFIG`` runs it, output to its log."""
    from trainscale.bench.cell import main

    with open(log, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    main(["--config", config])


def launch_forked(module: str, config: Path, devices: int, log_path: Path, timeout: float,
                  threads: int | None = None) -> tuple[int, bool, int]:
    """``launch_job`` for bench's cells with their ranks forked warm by ``run_distributed`` (one thread each, the
    launcher's environment) instead of started fresh under torchrun: for the tests whose subject is what a cell
    measures, not how it is launched (the sweeps above and the failing and timed-out cells launch theirs)."""
    assert module == "trainscale.bench.cell", module
    run_distributed(_cell_rank, str(config), str(log_path), world_size=devices, timeout=timeout)
    return 0, False, 1


@pytest.fixture(scope="module")
def resumed_sweep(tmp_path_factory) -> dict:
    """The user's entry swept from the command line with ``--plan`` over 1 and 2 devices, run from the directory
    that holds the entry's package (as a user runs it): interrupted (SIGINT, like Ctrl-C) once its first cell is
    recorded, then completed with ``--resume``. Three tests read it: one sweep instead of three."""
    root = write_workload(tmp_path_factory.mktemp("bench"))
    out = root / "sweep"
    args = bench_cmd("--entry", "benchpkg.workload:build", "--devices", "1,2", "--batch-sizes", "8", "--plan",
                     "--out", str(out))
    # SIGINT back to its default in the child: a shell that starts a job in the background (`cmd &`) makes it
    # ignore SIGINT, which its children inherit, and Python then installs no KeyboardInterrupt handler
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                             cwd=root, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 180
    while not ((out / "results.jsonl").is_file() and (out / "results.jsonl").read_text().count("\n") >= 1):
        assert first.poll() is None and time.monotonic() < deadline, "the first cell never finished"
        time.sleep(0.1)
    first.send_signal(signal.SIGINT)  # like Ctrl-C
    _, first_err = first.communicate(timeout=60)
    kept, left = rows_of(out), processes_mentioning(str(out))
    second = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=240, env=clean_env(),
                            cwd=root)
    return {"root": root, "out": out, "args": args, "first": first, "first_err": first_err, "kept": kept,
            "left": left, "second": second}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_user_entry_two_cell_sweep_from_the_command_line(resumed_sweep):
    out, proc = resumed_sweep["out"], resumed_sweep["second"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(out)
    assert [(r["devices"], r["run_strategy"], r["status"]) for r in rows] == [(1, "single", "ok"), (2, "ddp", "ok")]
    assert rows[0]["batches_per_epoch"] == 16 and rows[1]["batches_per_epoch"] == 8  # 128 samples, 8 per device
    assert all(r["steps"] == 2 and r["val_accuracy"] is not None for r in rows)
    assert rows[1]["probe_allreduce_s"] > 0 and rows[0]["probe_allreduce_s"] is None
    results = json.loads((out / "results.json").read_text())
    gain = results[0]["epoch_time_s"] / results[1]["epoch_time_s"]
    assert results[1]["gain"] == pytest.approx(gain) and results[1]["efficiency"] == pytest.approx(gain / 2)
    assert "bs/device" in proc.stdout and "eff 2d" in proc.stdout and f"{gain:.2f}×" in proc.stdout
    assert "Fastest for throughput" in proc.stdout and "Advice:" in proc.stdout
    assert "bench [2/2 done" in proc.stderr  # the progress display
    assert (out / "results.csv").read_text().count("\n") == 3 and (out / "report.md").is_file()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_an_interrupted_sweep_resumes_without_rerunning_finished_cells(resumed_sweep, monkeypatch, capsys):
    out, kept, second = resumed_sweep["out"], resumed_sweep["kept"], resumed_sweep["second"]
    assert resumed_sweep["first"].returncode == 130 and "--resume" in resumed_sweep["first_err"]
    assert len(kept) == 1 and resumed_sweep["left"] == []  # no torchrun or worker of the stopped cell is left

    assert second.returncode == 0, second.stderr[-3000:]
    assert "1 finished cell(s) kept" in second.stderr and f"running {kept[0]['key']}" not in second.stderr
    rows = rows_of(out)
    assert [r["devices"] for r in rows] == [1, 2] and all(r["status"] == "ok" for r in rows)
    assert rows[0] == kept[0]  # the finished row was not measured again

    # the same command again without --resume: a flag error, before any cell
    monkeypatch.chdir(resumed_sweep["root"])
    monkeypatch.syspath_prepend(str(resumed_sweep["root"]))
    err = bench_cli_error(resumed_sweep["args"][2:], capsys)
    assert "pass --resume" in err and "Traceback" not in err


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_plan_adds_predicted_columns_beside_the_measured_ones(resumed_sweep):
    import csv

    out, proc = resumed_sweep["out"], resumed_sweep["second"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["devices"], r["status"]) for r in rows] == [("1", "ok"), ("2", "ok")]
    for r in rows:
        predicted, measured = float(r["predicted_epoch_time_s"]), float(r["epoch_time_s"])
        assert predicted > 0 and measured > 0 and int(r["predicted_peak_bytes"]) > 0
        assert float(r["predicted_error"]) == pytest.approx(predicted / measured - 1)
    assert "plan 2d" in proc.stdout and "err 2d" in proc.stdout


@pytest.mark.multiprocess
def test_the_default_workload_is_the_convnet_on_mnist_5k(tmp_path, monkeypatch, capsys):
    """The CI version of the default sweep (no --entry, no --workload), one cell, through the command's main."""
    from trainscale.cli import main

    from trainscale.bench import runner

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the command puts the current directory first
    monkeypatch.setattr(runner, "launch_job", launch_forked)  # the subject is the workload: its cell forked warm
    out = tmp_path / "default"
    assert main(bench_cmd("--devices", "1", "--batch-sizes", "8", "--out", str(out))[1:]) == 0
    [row] = rows_of(out)
    assert row["status"] == "ok"
    assert json.loads((out / "sweep.json").read_text())["settings"]["entry"] == "trainscale.jobs.workload:mnist_convnet"
    assert row["n_train"] == 4000 and row["batches_per_epoch"] == 500  # MNIST-5k: 4,000 / 8
    stdout = capsys.readouterr().out
    assert "Advice:" in stdout and "Fastest for throughput" in stdout


@pytest.mark.multiprocess
def test_a_failing_cell_is_recorded_and_the_sweep_goes_on(workdir):
    from trainscale.bench import sweep

    # Strong scaling, global batch 16: one device trains on 16 per step and fails (the model raises above 8);
    # the sweep goes on to two devices with 8 each, which train.
    result = sweep("benchpkg.workload:build_failing", devices=[1, 2], batch_sizes=[16], scaling="strong", steps=2,
                   warmup_steps=1, out=workdir / "fail", progress=False, plots=False)
    assert [(r["devices"], r["per_device_batch"], r["status"]) for r in result.rows] == [(1, 16, "oom"), (2, 8, "ok")]
    bad = result.rows[0]
    assert "OutOfMemoryError" in bad["reason"] and "batch 16" in bad["reason"]
    assert any("global bs 16 (16/device) on 1 device (single, 32-true) is memory-bound" in a for a in result.advice)
    assert "OOM" in result.tables and result.rows[1]["gain"] is None  # no baseline to compare with


@pytest.mark.multiprocess
def test_a_cell_past_its_timeout_is_killed_and_recorded(workdir):
    from trainscale.bench import sweep

    t0 = time.monotonic()
    result = sweep("benchpkg.workload:build_slow", devices=[1], batch_sizes=[4], timeout=3, out=workdir / "slow",
                   progress=False, plots=False)
    assert result.rows[0]["status"] == "timeout" and "3 s per-cell timeout" in result.rows[0]["reason"]
    assert time.monotonic() - t0 < 60
    assert processes_mentioning(str(workdir / "slow")) == []  # torchrun and its worker are gone


BAD_FLAGS = ((["--entry", "no_such_pkg.mod:build"], "cannot import 'no_such_pkg.mod'"),
             (["--strategy", "ddp,nope"], "unknown strategy 'nope' for bench; choose from ddp"),
             (["--scaling", "strong", "--batch-sizes", "6"], "6 is not divisible by 4 devices"),
             (["--strategy", "ddp,hsdp", "--devices", "1,2"], "hsdp runs 2 replicas of devices/2 shards"),
             (["--strategy", "model_parallel"], "unknown strategy 'model_parallel'"),
             (["--workload", "lm", "--entry", "pkg.mod:build"], "give --workload (lm) or --entry"),
             (["--seed", "-1"], "seed=-1 must be an int >= 0"))  # was the same error in every cell


def test_bad_flags_fail_before_any_cell_with_a_one_line_error(tmp_path, monkeypatch, capsys):
    # the first as a user runs it (the installed command, its exit status and stderr; it fails before torch is
    # imported), the others through main
    flags, message = BAD_FLAGS[0]
    out = subprocess.run([str(BIN / "trainscale"), "bench", "--devices", "1,4", "--out", str(tmp_path / "x"),
                          *flags], capture_output=True, text=True, timeout=120, env=clean_env(), cwd=tmp_path)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the command puts the current directory first
    for flags, message in BAD_FLAGS[1:]:
        err = bench_cli_error(["--devices", "1,4", "--out", str(tmp_path / "x"), *flags], capsys)
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()  # nothing ran, nothing written


@pytest.fixture(scope="module")
def lm_sweep(tmp_path_factory) -> tuple[list[dict], str, float]:
    """One ``trainscale bench`` sweep of the lm workload (``build_lm``: ``--workload lm``'s, with fewer validation
    windows) under fsdp and tp on 1 and 2 devices: ``(rows, stdout, the model's FLOPs per token)``, each row checked
    for tokens/s and FLOPs/token. Both tests below read it. ddp cells are measured by the sweeps above; the LM's
    numbers depend on the strategy only through the ranks that read different data, which fsdp (each rank its own
    batches) and tp (the ranks share them) cover."""
    import contextlib
    import io

    from trainscale.bench import runner
    from trainscale.cli import main
    from trainscale.models import GPT

    root = write_workload(tmp_path_factory.mktemp("lm"))
    out = root / "lm"
    stdout = io.StringIO()
    # the command's main in this process (the subject is the cells' numbers, so their ranks are forked warm), from a
    # directory of its own; it puts that directory first on sys.path
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.chdir(root)
        mp.setattr(sys, "path", list(sys.path))
        mp.setattr(runner, "launch_job", launch_forked)
        code = main(bench_cmd("--entry", "benchpkg.workload:build_lm", "--strategy", "fsdp,tp", "--devices", "1,2",
                              "--batch-sizes", "4", "--out", str(out), "--quiet")[1:])
    rows = rows_of(out)
    assert code == 0, rows
    flops = GPT("mini").flops_per_token()  # PaLM's 6·N + 12·L·C·T at context 128
    for r in rows:
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["flops_per_token"] == pytest.approx(flops)
        assert r["achieved_flops_per_s"] == pytest.approx(flops * r["tokens_per_s"])
    assert f"FLOPs/token {flops:.3g}" in stdout.getvalue()
    return rows, stdout.getvalue(), flops


@pytest.mark.multiprocess
def test_lm_workload_under_fsdp_reports_tokens_per_s_and_flops_per_token(lm_sweep):
    rows, stdout, _ = lm_sweep
    assert sorted(r["run_strategy"] for r in rows) == ["fsdp", "single", "tp"]
    assert stdout.count("tok/s 2d") == 2  # one column in each strategy's table


@pytest.mark.multiprocess
def test_lm_workload_under_tp_shares_each_batch_between_the_tp_ranks(lm_sweep):
    rows, stdout, _ = lm_sweep
    [tp] = [r for r in rows if r["run_strategy"] == "tp"]
    assert tp["global_batch_size"] == 4
    assert tp["batches_per_epoch"] == math.ceil(tp["n_train"] / 4)  # as one device's: tp ranks read the same data
    tp_table = stdout[stdout.index("tp · 32-true"):].split("\n\n")[0]
    assert "tok/s 2d" in tp_table, stdout
