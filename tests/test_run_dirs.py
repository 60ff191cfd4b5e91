"""Run directories and checkpoint names (checkpointing/run_dirs.py): atomic version_N claims, rotation order, old names."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import threading

import pytest

from trainscale.checkpointing import run_dirs as ckpt


def _save(ckpt_dir, name, keep_last):
    path = ckpt_dir / name
    path.write_bytes(b"x")
    (ckpt_dir / f"{name}.sha256").write_text("0" * 64)
    ckpt.mark_last(path, keep_last=keep_last)
    return path


def test_keep_last_keeps_the_newest_checkpoints_past_step_999999(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        _save(ckpt_dir, ckpt.checkpoint_name(3, step), keep_last=2)
    kept = sorted(p.name for p in ckpt_dir.glob("*.pt"))
    assert kept == [ckpt.checkpoint_name(3, 1_000_000), ckpt.checkpoint_name(3, 1_000_001)]
    assert (ckpt_dir / "last").read_text().strip() == ckpt.checkpoint_name(3, 1_000_001)


def test_keep_last_orders_old_six_digit_names_by_epoch_and_step(tmp_path):
    # names written before the wider padding, in one run with new ones (a resumed old run)
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    for name in ("epoch=0009-step=999999.pt", "epoch=0010-step=1000000.pt"):
        (ckpt_dir / name).write_bytes(b"x")
    _save(ckpt_dir, ckpt.checkpoint_name(10, 1_000_001), keep_last=2)
    assert sorted(p.name for p in ckpt_dir.glob("*.pt")) == ["epoch=000010-step=0001000001.pt",
                                                            "epoch=0010-step=1000000.pt"]


def test_checkpoint_names_sort_as_text_in_training_order():
    pairs = [(0, 5), (1, 999_999), (1, 1_000_000), (2, 10**9), (12_000, 10**9 + 1)]
    names = [ckpt.checkpoint_name(epoch, step) for epoch, step in pairs]
    assert sorted(names) == names
    assert [ckpt.checkpoint_order(name) for name in names] == pairs
    assert ckpt.checkpoint_order("notes.txt") is None and ckpt.checkpoint_order("last") is None


def _claim_many(root, count, barrier):
    barrier.wait()
    return [ckpt.claim_run_dir(root) for _ in range(count)]


def test_claim_run_dir_gives_racing_threads_distinct_versions(tmp_path):
    threads, count = 16, 20
    barrier = threading.Barrier(threads)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        claimed = [p for f in [pool.submit(_claim_many, tmp_path, count, barrier) for _ in range(threads)]
                   for p in f.result()]
    assert len(set(claimed)) == threads * count  # no two callers got the same version_N
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"version_{n}" for n in range(threads * count))


def _claim_in_process(root, count, barrier, queue):
    try:
        queue.put([str(p) for p in _claim_many(root, count, barrier)])
    except BaseException as err:  # reported to the test instead of leaving it waiting
        queue.put(repr(err))
        raise


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_claim_run_dir_gives_racing_processes_distinct_versions(tmp_path):
    ctx = multiprocessing.get_context("fork")  # the function is already imported: no re-import per process
    procs, count = 6, 25
    barrier, queue = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_claim_in_process, args=(tmp_path / "runs", count, barrier, queue))
               for _ in range(procs)]
    for w in workers:
        w.start()
    results = [queue.get(timeout=100) for _ in workers]
    for w in workers:
        w.join(timeout=30)
    assert all(isinstance(r, list) for r in results), results
    claimed = [p for r in results for p in r]
    assert len(set(claimed)) == procs * count == len(list((tmp_path / "runs").iterdir()))


def test_claim_run_dir_starts_at_version_0_and_skips_existing(tmp_path):
    assert ckpt.claim_run_dir(tmp_path / "new" / "runs") == tmp_path / "new" / "runs" / "version_0"
    (tmp_path / "version_7").mkdir()
    assert ckpt.claim_run_dir(tmp_path) == tmp_path / "version_8"
