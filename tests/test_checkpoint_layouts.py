"""Checkpoints for every layout: background writes (``checkpoint_async=True``, torch's
``async_save``) that equal synchronous ones although training moved on during each write; a job killed
during a background write resumes from the previous complete checkpoint; a rank killed while it writes a
checkpoint file leaves "last" intact and no process; DCP checkpoints saved on one mesh resume on another
(model_parallel 2×2 → dp_shard 4 and one process; fsdp 2 → fsdp 4, ddp 2 and one process) with the saved weights
and optimizer state exactly and the uninterrupted run's losses; a ddp file resumed under fsdp is refused.

Real gloo processes; run them under the shared lock (``flock /tmp/trainscale-heavy.lock pytest ...``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests import ckpt_workers, fault_script, fault_workers as fw
from tests.helpers import run_distributed
from tests.test_fault_tolerance import ROOT, SCRIPT, TRAINSCALE, _env


def _dcp_contents(directory: Path, tmp: Path) -> dict:
    """Every tensor and value of a DCP checkpoint directory, read in this process (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{directory.parent.parent.parent.name}-{directory.name}.pt"
    dcp_to_torch_save(str(directory), str(out))
    return torch.load(out, weights_only=False)


def _assert_equal_nested(got, want, where: str = "") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_equal_nested(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_equal_nested(a, b, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where


# -- bad input --------------------------------------------------------------------------------------
def test_checkpoint_async_is_refused_where_a_checkpoint_is_one_file(tmp_path):
    from trainscale.runtime.runtime import Runtime
    from trainscale.loop.trainer import Trainer

    for strategy in ("auto", "single"):
        with pytest.raises(ValueError, match=r"checkpoint_async=True writes sharded \(DCP\) checkpoints in the "
                                             r"background, but strategy='single' writes one file.*'fsdp'"):
            Trainer(accelerator="cpu", devices=1, strategy=strategy, checkpoint_async=True)
    with pytest.raises(ValueError, match="checkpoint_async='yes' must be True or False"):
        Trainer(accelerator="cpu", devices=1, checkpoint_async="yes")
    with pytest.raises(ValueError, match="strategy='single' writes one file"):
        Runtime(accelerator="cpu", devices=1).save(tmp_path / "x.pt", {"model": torch.nn.Linear(2, 2)},
                asynchronous=True)
    assert not (tmp_path / "x.pt").exists()


# -- background writes through the Trainer -----------------------------------------------------------
@pytest.fixture(scope="module")
def async_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    return root, run_distributed(ckpt_workers.async_trainer_body, str(root), timeout=400)


@pytest.mark.multiprocess
@pytest.mark.timeout(450)
def test_background_checkpoints_equal_synchronous_ones_although_training_moved_on(async_runs, tmp_path):
    root, ranks = async_runs
    for rank in ranks:
        # each held write began only after the next optimizer step was trained (the last one, at the end of fit)
        assert sorted(rank["async"]["seen"]) == [4, 8, 12, 16, 20, 24]
        assert all(trained > step for step, trained in rank["async"]["seen"].items() if step < 24)
        for key, value in rank["sync"]["weights"].items():  # training itself is unchanged
            assert torch.equal(rank["async"]["weights"][key], value), key
    sync_dir, async_dir = (root / name / "version_0" / "checkpoints" for name in ("sync", "async"))
    names = sorted(p.name for p in sync_dir.iterdir())
    assert names == sorted(p.name for p in async_dir.iterdir())  # no temporary directory left behind
    assert len(names) == 7 and (async_dir / "last").read_text() == "epoch=1-step=24.ckpt\n"
    for name in names[:-1]:  # the staged copies hold the state at the save, not the later one
        _assert_equal_nested(_dcp_contents(async_dir / name, tmp_path), _dcp_contents(sync_dir / name, tmp_path), name)
        got, want = (torch.load(d / name / "trainscale_extra.pt", weights_only=False) for d in (async_dir, sync_dir))
        for key in ("global_step", "epoch", "batches"):  # (its history holds times, which differ)
            assert got["train_state"][key] == want["train_state"][key], (name, key)
        assert got["loop"]["consumed"] == want["loop"]["consumed"], name
        _assert_equal_nested(got["rng"], want["rng"], name)


@pytest.mark.multiprocess
@pytest.mark.timeout(450)
def test_stall_and_background_write_seconds_are_logged(async_runs):
    root, ranks = async_runs
    for rank in ranks:
        sync, background = rank["sync"]["summary"]["checkpoints"], rank["async"]["summary"]["checkpoints"]
        assert sync["async"] is False and sync["saves"] == 6 and sync["write_s"] is None and sync["stall_s"] > 0
        assert background["async"] is True and background["saves"] == 6
        assert background["write_s"] > 0 and background["stall_s"] > 0
    records = [json.loads(line) for line in (root / "async" / "version_0" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "step"]
    assert sum("checkpoint_stall_s" in r for r in steps) >= 5  # one per save (the last one's record follows fit)
    assert sum("checkpoint_write_s" in r for r in steps) >= 4
    summary = json.loads((root / "async" / "version_0" / "summary.json").read_text())
    assert summary["checkpoints"]["saves"] == 6


# -- a job killed while a background write is under way --------------------------------------------------
def _wait_for(paths: list[Path], ended, deadline_s: float) -> None:
    """Wait until every path exists; ``ended()`` is the job's output once it has ended, None while it runs."""
    deadline = time.monotonic() + deadline_s
    while not all(p.exists() for p in paths):
        output = ended()
        assert output is None, f"the job ended before its writes were held:\n{output[-4000:]}"
        assert time.monotonic() < deadline, "the background writes were never held"
        time.sleep(0.1)


def _gone(pids: list[int], deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    for pid in pids:
        while os.path.exists(f"/proc/{pid}") and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower():
            assert time.monotonic() < deadline, f"worker {pid} survived the kill of its job"
            time.sleep(0.05)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_job_killed_during_a_background_write_resumes_from_the_previous_complete_checkpoint(tmp_path):
    """fsdp on 2 ranks, one epoch with a checkpoint every 5 steps written in the background; each rank's writer of
    the step-10 checkpoint stops for good once its shards are on disk (a test hook), and the test then SIGKILLs both
    ranks. "last" still names step 5; the resumed run (``ckpt_path="last"``) loads it and ends with the weights of
    an uninterrupted run. The ranks are forked by ``run_distributed``'s server: real processes, killed for real
    (what torchrun does when a rank dies mid-write: the next test)."""
    common = ["--strategy", "fsdp", "--timeout", "120", "--epochs", "1"]
    killed_out = tmp_path / "killed"
    args = [*common, "--out", str(killed_out), "--checkpoint-async"]
    log = tmp_path / "killed.log"
    job = fw.start_ranks(fault_script.run_rank, ([*args, "--hold-async-save-at", "10"], str(log)), str(tmp_path))
    try:
        run_distributed(fault_script.run_rank, [*common, "--out", str(tmp_path / "full")], timeout=300)
        held = [killed_out / f"held-rank{r}" for r in (0, 1)]
        _wait_for(held, lambda: None if all(p.is_alive() for p in job.processes) else log.read_text(), 300)
        for p in job.processes:
            p.kill()
            p.join(timeout=60)
        assert [p.exitcode for p in job.processes] == [-signal.SIGKILL] * 2
    finally:
        for p in job.processes:
            if p.is_alive():
                p.kill()
                p.join()
    checkpoints = killed_out / "runs" / "version_0" / "checkpoints"
    assert (checkpoints / "last").read_text() == "epoch=0-step=5.ckpt\n"
    partial = checkpoints / ".epoch=0-step=10.ckpt.tmp"
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in partial.iterdir()}  # shards written ...
    assert not (partial / ".metadata").exists() and not (checkpoints / "epoch=0-step=10.ckpt").exists()

    log = tmp_path / "resumed.log"
    run_distributed(fault_script.run_rank, [*args, "--resume"], str(log), timeout=300)
    text = log.read_text()
    assert "resumed from" in text and "epoch=0-step=5.ckpt" in text, text[-4000:]
    assert not partial.exists() and (checkpoints / "last").read_text() == "epoch=0-step=12.ckpt\n"
    for rank in (0, 1):
        want, got = (torch.load(d / f"final-rank{rank}.pt") for d in (tmp_path / "full", killed_out))
        for key, value in want.items():
            assert torch.equal(got[key], value), f"rank {rank} {key} differs from the uninterrupted run"


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_rank_killed_while_it_writes_a_checkpoint_file_leaves_last_intact_and_no_process(tmp_path):
    """ddp on 2 ranks under torchrun, a checkpoint every 5 steps; rank 0's write of the step-10 file stops half
    written (a test hook) and the test SIGKILLs rank 0 alone. The job ends with no process left (rank 1, torchrun),
    "last" still names step 5, the half-written temporary is never taken for a checkpoint, and ``ckpt_path="last"``
    (on 2 ranks forked by ``run_distributed``) resumes from step 5 to the end (the temporary removed by the next
    good save)."""
    from trainscale.jobs.launcher import _descendants

    out = tmp_path / "killed"
    args = ["--strategy", "ddp", "--timeout", "20", "--epochs", "1", "--out", str(out)]
    job = subprocess.Popen([TRAINSCALE, "run", "-n", "2", SCRIPT, *args, "--hold-save-at", "10", "--hold-rank", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT,
                           start_new_session=True)
    try:
        held = out / "held-rank0"
        _wait_for([held], lambda: None if job.poll() is None else job.stdout.read(), 40)
        processes = _descendants(job.pid)  # torchrun's agent and both workers
        os.kill(int(held.read_text()), signal.SIGKILL)
        assert job.wait(timeout=30) != 0
        _gone(processes, 10)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    checkpoints = out / "runs" / "version_0" / "checkpoints"
    assert (checkpoints / "last").read_text() == "epoch=0-step=5.ckpt\n"
    partial = [p.name for p in checkpoints.iterdir() if p.name.startswith(".epoch=0-step=10.ckpt")]
    assert len(partial) == 1 and partial[0].endswith(".tmp")  # the half-written file, under a temporary name
    assert not (checkpoints / "epoch=0-step=10.ckpt").exists()

    log = tmp_path / "resumed.log"
    run_distributed(fault_script.run_rank, [*args, "--resume"], str(log), timeout=40)
    text = log.read_text()
    assert "resumed from" in text and "epoch=0-step=5.ckpt" in text, text[-4000:]
    assert (checkpoints / "last").read_text() == "epoch=0-step=12.ckpt\n"
    assert not [p for p in checkpoints.iterdir() if p.name.endswith(".tmp")]


# -- resuming on another mesh shape -------------------------------------------------------------------------
def _save_and_load_on_four(rank: int, mp_checkpoint: str, fsdp_checkpoint: str) -> dict:
    """In the same 4 processes: model_parallel 2×2 saves; dp_shard 4 (model_parallel) reads that checkpoint back
    into a fresh model and optimizer; fsdp 4 reads the fsdp-2 one. One start of 4 processes instead of two."""
    saved = ckpt_workers.mesh_checkpoint(rank, "model_parallel", {"dp_shard": 2, "tp": 2}, 2, mp_checkpoint,
                                         teardown=False)
    mesh = ckpt_workers.mesh_checkpoint(rank, "model_parallel", {"dp_shard": 4}, 4, load_from=(mp_checkpoint,),
                                        teardown=False)
    fsdp = ckpt_workers.mesh_checkpoint(rank, "fsdp", None, 4, load_from=(fsdp_checkpoint,))
    return {"saved": saved["saved"], "loaded": {**mesh, **fsdp}}


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh")
    mp, fsdp = str(root / "mp-2x2"), str(root / "fsdp-2")
    two = run_distributed(ckpt_workers.fsdp_and_ddp_resume_each_other, fsdp, str(root / "ddp.pt"), timeout=200)
    saved = {"fsdp": [rank["fsdp"] for rank in two]}
    four = run_distributed(_save_and_load_on_four, mp, fsdp, world_size=4, timeout=400)
    saved["mp"] = [{"saved": rank["saved"]} for rank in four]
    # one process needs no process group: it runs here, in the test's process
    loaded = {"four": [rank["loaded"] for rank in four], "ddp": [rank["ddp"] for rank in two],
              "refused under fsdp": [rank.get("refused") for rank in two],
              "one": [ckpt_workers.mesh_checkpoint(0, "single", None, 1, None, (mp, fsdp))]}
    return mp, fsdp, saved, loaded


def _assert_resumed(saved: dict, loaded: dict) -> None:
    """The weights and momentum right after the load equal those at the save, bit for bit; the next steps'
    losses (the same 16 samples each) equal the uninterrupted run's (rtol 1e-5: another reduction order)."""
    for name in ("weights", "momentum"):
        assert loaded[name].keys() == saved[name].keys()
        for key, value in saved[name].items():
            assert torch.equal(loaded[name][key], value), f"{name} {key}"
    assert loaded["losses"] == pytest.approx(saved["losses"], rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_model_parallel_2x2_checkpoint_resumes_on_dp_shard_4_and_in_one_process(mesh_runs):
    mp, _, saved, loaded = mesh_runs
    for rank in saved["mp"]:
        assert rank["saved"]["write_s"] > 0
    assert saved["mp"][0]["saved"]["published_before_wait"] is False  # rank zero renames in wait() only
    reference = saved["mp"][0]["saved"]
    for rank in loaded["four"]:
        _assert_resumed(reference, rank[mp])
    _assert_resumed(reference, loaded["one"][0][mp])


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_an_fsdp_checkpoint_resumes_under_ddp_and_a_ddp_one_under_fsdp_is_refused_naming_the_fix(mesh_runs):
    """In the same 2 processes as the fsdp save: ddp reads the DCP directory (each rank the whole tensors) with the
    saved weights and momentum and the uninterrupted run's losses; fsdp asked for ddp's file names the fix."""
    _, fsdp, saved, loaded = mesh_runs
    reference = saved["fsdp"][0]["saved"]
    for rank in loaded["ddp"]:
        _assert_resumed(reference, rank[fsdp])
    for refused in loaded["refused under fsdp"]:
        assert refused is not None and "ddp.pt' is not a sharded (DCP) checkpoint directory written by " \
            "strategy='fsdp'; resume a 'single'/'ddp' checkpoint file with that strategy" in refused, refused


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_an_fsdp_2_checkpoint_resumes_on_fsdp_4_and_in_one_process(mesh_runs):
    _, fsdp, saved, loaded = mesh_runs
    reference = saved["fsdp"][0]["saved"]
    assert saved["fsdp"][0]["saved"]["published_before_wait"] is False
    for rank in loaded["four"]:
        _assert_resumed(reference, rank[fsdp])
    _assert_resumed(reference, loaded["one"][0][fsdp])
