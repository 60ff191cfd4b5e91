"""Run directories, checkpoint names and the one pruning rule: atomic version_N claims, ModelCheckpoint's
top-k by number (not by text), non-finite scores, and only this run's files deleted."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import threading
import types

import pytest

from trainscale.callbacks import ModelCheckpoint
from trainscale.loop.config import TrainerConfig
from trainscale.checkpointing import run_dirs as ckpt


class _Trainer:
    """What ModelCheckpoint uses of a Trainer, writing checkpoint files that hold their step (one process)."""

    def __init__(self, run_dir):
        self.run_dir, self.global_step, self.current_epoch, self.callback_metrics = run_dir, 0, 0, {}
        self.runtime = types.SimpleNamespace(is_rank_zero=True, world_size=1, barrier=lambda: None,
                                             broadcast_object=lambda obj: obj)
        self.checkpoints = types.SimpleNamespace(discard=lambda paths: [ckpt.remove_checkpoint(p) for p in paths],
                                                 link=ckpt.link_last)
        self.runtime.strategy = types.SimpleNamespace(sharded_checkpoints=False)
        self.runtime.broadcast_object = lambda value: value
        self.config = TrainerConfig()
        self.ckpt_path = None
        self.num_val_batches = []  # no validation: epoch saves at epoch ends
        self.enable_validation = False  # and no step save waits for one
        self.validated_at = []  # the global steps at which the fit validated
        self.loggers = []  # told of each save (after_save_checkpoint)

    def reached_multiple(self, n):
        return self.global_step % n == 0

    def checkpoint_path(self, directory, name=None):
        name = ckpt.checkpoint_name(self.current_epoch, self.global_step) if name is None else name
        return directory / name

    def write_checkpoint(self, directory, background=False, name=None, weights_only=False):
        path = self.checkpoint_path(directory, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(self.global_step))
        ckpt.mark_last(path, self.run_dir / "checkpoints")
        return path


def _steps(callback, trainer, steps, scores=None):
    for i, step in enumerate(steps):
        trainer.global_step = step
        if scores is not None:
            trainer.callback_metrics["loss"] = scores[i]
        callback.save_if_due(trainer, epoch_end=True, ends_epoch=True)


def test_the_newest_checkpoints_are_kept_past_step_999999(tmp_path):
    trainer = _Trainer(tmp_path / "version_0")
    callback = ModelCheckpoint.trainer_default(1, None, keep_last=2)  # the newest 2: Trainer(keep_last=2)
    callback.setup_directory(trainer)
    _steps(callback, trainer, (999_998, 999_999, 1_000_000, 1_000_001))
    ckpt_dir = trainer.run_dir / "checkpoints"
    kept = sorted(p.name for p in ckpt_dir.glob("*.ckpt"))
    assert kept == [ckpt.checkpoint_name(0, 1_000_000), ckpt.checkpoint_name(0, 1_000_001)]
    assert (ckpt_dir / "last").read_text().strip() == ckpt.checkpoint_name(0, 1_000_001)


def test_a_non_finite_score_never_evicts_the_best_checkpoint(tmp_path):
    trainer = _Trainer(tmp_path / "version_0")
    callback = ModelCheckpoint(monitor="loss", save_top_k=1)
    callback.setup_directory(trainer)
    _steps(callback, trainer, (1, 2, 3), scores=[0.5, float("nan"), float("inf")])
    assert callback.best_model_path.endswith(ckpt.checkpoint_name(0, 1))
    kept = sorted(p.name for p in (trainer.run_dir / "checkpoints").glob("*.ckpt"))
    assert kept == [ckpt.checkpoint_name(0, 1)]  # neither later one enters the top 1: not written, "last" stays
    assert (trainer.run_dir / "checkpoints" / "last").read_text().strip() == ckpt.checkpoint_name(0, 1)


@pytest.mark.parametrize("mode, scores", [("min", [float("nan"), 8.0, 7.0, 5.0]),
                                          ("max", [float("nan"), 5.0, 7.0, 8.0])])
def test_a_nan_first_value_is_saved_and_the_first_finite_one_replaces_it(tmp_path, mode, scores):
    """As Lightning: a NaN fills an empty top k (ranked worst: inf for "min", -inf for "max"), so every save of
    this run is written, each better one replacing the one before."""
    trainer = _Trainer(tmp_path / "version_0")
    written, write = [], trainer.write_checkpoint

    def counted_write(*args, **kwargs):
        path = write(*args, **kwargs)
        written.append(path.name)
        return path

    trainer.write_checkpoint = counted_write
    callback = ModelCheckpoint(monitor="loss", mode=mode, save_top_k=1)
    callback.setup_directory(trainer)
    _steps(callback, trainer, (1, 2, 3, 4), scores=scores)
    assert written == [ckpt.checkpoint_name(0, step) for step in (1, 2, 3, 4)]
    assert sorted(p.name for p in (trainer.run_dir / "checkpoints").glob("*.ckpt")) == [ckpt.checkpoint_name(0, 4)]
    assert float(callback.best_model_score) == scores[-1] and float(callback.current_score) == scores[-1]


def test_pruning_deletes_only_this_runs_files_and_a_dirpath_in_use_is_refused(tmp_path):
    first = _Trainer(tmp_path / "version_0")
    callback = ModelCheckpoint(save_top_k=1)
    callback.setup_directory(first)
    _steps(callback, first, (1, 2))
    theirs = sorted((first.run_dir / "checkpoints").glob("*.ckpt"))
    # a second run resumes from the first one's callback state: it keeps its own top 1, deleting none of theirs
    second = _Trainer(tmp_path / "version_1")
    resumed = ModelCheckpoint(save_top_k=1)
    resumed.load_state_dict(callback.state_dict())
    resumed.setup_directory(second)
    _steps(resumed, second, (3, 4, 5))
    assert sorted((first.run_dir / "checkpoints").glob("*.ckpt")) == theirs
    assert [p.name for p in (second.run_dir / "checkpoints").glob("*.ckpt")] == [ckpt.checkpoint_name(0, 5)]
    shared = tmp_path / "shared"
    running = ModelCheckpoint(dirpath=shared)
    running.setup_directory(first)
    with pytest.raises(ValueError, match="is in use by another fit running now.*give this run its own dirpath"):
        ModelCheckpoint(dirpath=shared).setup_directory(second)
    running.release_directory()  # that fit ended: the next one may write there (its names versioned past these)
    after = ModelCheckpoint(dirpath=shared)
    after.setup_directory(second)
    after.release_directory()
    assert os.listdir(shared) == []  # the lock is on the directory itself: no file added


def test_checkpoint_names_are_lightnings_and_order_by_their_numbers_old_names_too():
    pairs = [(0, 5), (1, 999_999), (1, 1_000_000), (2, 10**9), (12_000, 10**9 + 1)]
    names = [ckpt.checkpoint_name(epoch, step) for epoch, step in pairs]
    assert names[0] == "epoch=0-step=5.ckpt" and sorted(names) != names  # not padded: text order is not training order
    assert [ckpt.checkpoint_order(name) for name in names] == pairs
    # the names written before: zero padded, ".pt" for a file, none for a sharded directory
    assert ckpt.checkpoint_order("epoch=000002-step=0000000126.pt") == (2, 126)
    assert ckpt.checkpoint_order("epoch=000002-step=0000000126") == (2, 126)
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


_HOLD_LOCK = ("import fcntl, os, sys, time\n"
              "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
              "fcntl.flock(fd, fcntl.LOCK_EX)\n"
              "print('held', flush=True)\n"
              "time.sleep(60)\n")


@pytest.mark.timeout(60)
def test_a_run_held_by_another_process_is_not_continued_in_place(tmp_path):
    """Two runs resuming ckpt_path="last" together: the first holds version_0's lock for its whole fit, so the
    second (here a process holding that lock, as the first fit does) continues in version_1 recording
    resumed_from; version_0 is untouched. The lock goes with the fit: the next "last" continues in place."""
    import subprocess
    import sys

    from torch.utils.data import DataLoader

    from tests import workers
    from trainscale.callbacks import Callback
    from trainscale.checkpointing.runs import RunLock
    from trainscale.loop.trainer import Trainer

    def fit(**kw):
        trainer = Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, max_epochs=kw.pop(
            "max_epochs"), callbacks=[HeldDuringFit()])
        trainer.fit(workers.make_model(0), DataLoader(workers.tiny_dataset(16), batch_size=8), optimizer=workers.sgd,
                    **kw)
        return trainer

    held = []

    class HeldDuringFit(Callback):
        def on_fit_start(self, trainer, module=None):
            lock = RunLock.acquire(trainer.run_dir)  # another process's view: a second open file description
            held.append(lock is None)

    fit(max_epochs=1)
    first = tmp_path / "version_0"
    before = {p.name: p.read_bytes() for p in sorted((first / "checkpoints").iterdir())}
    other = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(first / RunLock.FILE)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        second = fit(max_epochs=2, ckpt_path="last")
    finally:
        other.kill()
        other.wait()
    assert second.run_dir == tmp_path / "version_1"
    assert (second.run_dir / "resumed_from").read_text().strip() == str(first / "checkpoints" /
                                                                        ckpt.checkpoint_name(0, 2))
    assert {p.name: p.read_bytes() for p in sorted((first / "checkpoints").iterdir())} == before
    free = RunLock.acquire(second.run_dir)
    assert free is not None  # released when fit returned
    free.release()
    third = fit(max_epochs=3, ckpt_path="last")  # version_1 is free: continued in place
    assert third.run_dir == tmp_path / "version_1"
    assert held == [True, True, True]  # every fit held its run directory's lock


def test_a_step_save_is_folded_into_the_epoch_end_only_when_that_epoch_end_saves(tmp_path):
    trainer = _Trainer(tmp_path / "version_0")
    callback = ModelCheckpoint.trainer_default(2, 4, keep_last=None)  # both schedules: only the Trainer's own
    callback.setup_directory(trainer)
    trainer.global_step = 4  # the last step of epoch 0, whose end does not save (every 2nd epoch)
    callback.save_if_due(trainer, epoch_end=False, ends_epoch=True)
    callback.save_if_due(trainer, epoch_end=True, ends_epoch=True)
    assert [p.name for p in (trainer.run_dir / "checkpoints").glob("*.ckpt")] == [ckpt.checkpoint_name(0, 4)]
    trainer.current_epoch, trainer.global_step = 1, 8  # epoch 1 ends at step 8: its end saves, the step does not
    callback.save_if_due(trainer, epoch_end=False, ends_epoch=True)
    assert len(list((trainer.run_dir / "checkpoints").glob("*.ckpt"))) == 1
    callback.save_if_due(trainer, epoch_end=True, ends_epoch=True)
    assert len(list((trainer.run_dir / "checkpoints").glob("*.ckpt"))) == 2


def test_a_monitored_save_before_the_first_validation_warns_and_ranks_last(tmp_path):
    trainer = _Trainer(tmp_path / "version_0")
    callback = ModelCheckpoint(monitor="val_loss", every_n_train_steps=2, save_top_k=1)
    callback.setup_directory(trainer)
    trainer.global_step = 2
    with pytest.warns(RuntimeWarning, match="monitors 'val_loss', not among the metrics yet at step 2"):
        callback.save_if_due(trainer, epoch_end=False, ends_epoch=False)
    trainer.global_step, trainer.callback_metrics["val_loss"] = 4, 0.5
    callback.save_if_due(trainer, epoch_end=False, ends_epoch=False)
    assert callback.best_model_path.endswith(ckpt.checkpoint_name(0, 4))
    del trainer.callback_metrics["val_loss"]
    trainer.validated_at = [4]  # once the fit has validated, a monitor that is missing is an error, as Lightning's
    at_epoch_ends = ModelCheckpoint(monitor="val_loss", save_top_k=1)
    at_epoch_ends.setup_directory(trainer)
    with pytest.raises(ValueError, match="monitors 'val_loss', which is not among the metrics"):
        at_epoch_ends.save_if_due(trainer, epoch_end=True, ends_epoch=True)


def test_filename_templates_follow_lightnings_format_and_never_overwrite(tmp_path):
    callback = ModelCheckpoint(filename="{epoch}-{val_loss:.2f}")
    # Lightning's format_checkpoint_name doctests: the name + ".ckpt", under dirpath when one is given
    assert callback.format_checkpoint_name({"epoch": 2, "val_loss": 0.123456}) == "epoch=2-val_loss=0.12.ckpt"
    assert callback.format_checkpoint_name({"epoch": 5}, filename="{epoch:03d}") == "epoch=005.ckpt"
    assert callback.format_checkpoint_name({}, filename="{missing:d}") == "missing=0.ckpt"
    assert callback.format_checkpoint_name({"epoch": 1, "epoch_test": 7}, filename="{epoch}-{epoch_test}") == \
        "epoch=1-epoch_test=7.ckpt"
    plain = ModelCheckpoint(dirpath=tmp_path, filename="e{epoch}-vl={val_loss:.1f}", auto_insert_metric_name=False)
    assert plain.format_checkpoint_name({"epoch": 2, "val_loss": 0.26}, ver=1) == str(tmp_path / "e2-vl=0.3-v1.ckpt")
    assert ModelCheckpoint().format_checkpoint_name({"epoch": 0, "step": 4}, prefix="run") == "run-epoch=0-step=4.ckpt"
    with pytest.raises(ValueError, match="formats to 'val/loss=0.10', a path"):
        ModelCheckpoint(filename="{val/loss:.2f}").format_checkpoint_name({"val/loss": 0.1})
    with pytest.raises(ValueError, match="not 'last'"):
        ModelCheckpoint(filename="last")
    # in a run: the same name twice gets -v1 (a template without {step}); save_last links last.ckpt to the newest
    trainer = _Trainer(tmp_path / "version_0")
    callback = ModelCheckpoint(filename="{epoch}", save_top_k=-1, save_last=True)
    callback.setup_directory(trainer)
    _steps(callback, trainer, (1, 2))
    ckpt_dir = trainer.run_dir / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.glob("*.ckpt")) == ["epoch=0-v1.ckpt", "epoch=0.ckpt", "last.ckpt"]
    link = ckpt_dir / "last.ckpt"
    assert link.is_symlink() and link.resolve() == (ckpt_dir / "epoch=0-v1.ckpt").resolve()
    assert callback.last_model_path == str(link) and (ckpt_dir / "last").read_text().strip() == "epoch=0-v1.ckpt"


def test_save_top_k_0_saves_nothing_but_the_last_when_asked(tmp_path):
    trainer = _Trainer(tmp_path / "version_0")
    nothing = ModelCheckpoint(save_top_k=0)
    nothing.setup_directory(trainer)
    _steps(nothing, trainer, (1, 2))
    assert list((trainer.run_dir / "checkpoints").glob("*")) == [] and nothing.best_model_path == ""
    only_last = ModelCheckpoint(save_top_k=0, save_last="link")
    only_last.setup_directory(trainer)
    _steps(only_last, trainer, (3, 4))
    ckpt_dir = trainer.run_dir / "checkpoints"  # the checkpoint itself is last.ckpt: nothing else to link to
    assert sorted(p.name for p in ckpt_dir.glob("*.ckpt")) == ["last.ckpt"]
    assert not (ckpt_dir / "last.ckpt").is_symlink() and (ckpt_dir / "last").read_text().strip() == "last.ckpt"
    assert (ckpt_dir / "last.ckpt").read_text() == "4"  # replaced at step 4


@pytest.mark.timeout(60)
def test_a_run_resumed_in_place_keeps_the_checkpoint_it_resumed_from_and_prunes_its_other_files(tmp_path):
    """The checkpoint a run resumes from in place is one of its own (ranked by its score) but never deleted, as in
    Lightning; the run's other files are pruned by save_top_k. A new run resumed from another run's checkpoint
    deletes none of that run's files and ranks by its own scores."""
    from torch.utils.data import DataLoader

    from tests import workers
    from trainscale.callbacks import Callback
    from trainscale.loop.trainer import Trainer

    scores = [0.5, 0.4, 0.3, 0.2, 0.9, 0.8]  # by epoch: each better than the last, then two worse ones

    class Score(Callback):  # a metric the ModelCheckpoint ranks by, logged before it runs
        def on_train_epoch_end(self, trainer, module=None):
            trainer.callback_metrics["score"] = scores[trainer.current_epoch]

    def fit(epochs, ckpt_path=None):
        checkpoint = ModelCheckpoint(monitor="score", save_top_k=1)
        trainer = Trainer(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=tmp_path, max_epochs=epochs, callbacks=[Score(), checkpoint])
        trainer.fit(workers.make_model(0), DataLoader(workers.tiny_dataset(8), batch_size=8), optimizer=workers.sgd,
                    ckpt_path=ckpt_path)
        return trainer, checkpoint

    def kept(trainer):
        return sorted(p.name for p in (trainer.run_dir / "checkpoints").glob("*.ckpt"))

    first, _ = fit(2)  # names: the epoch trained (from 0) and the steps taken, one step an epoch
    assert kept(first) == [ckpt.checkpoint_name(1, 2)]
    resumed, checkpoint = fit(4, ckpt_path="last")  # continues version_0: its epoch-2 file pruned by epoch 3's
    assert resumed.run_dir == first.run_dir
    assert kept(resumed) == [ckpt.checkpoint_name(1, 2), ckpt.checkpoint_name(3, 4)]
    assert checkpoint.best_model_path == str(resumed.run_dir / "checkpoints" / ckpt.checkpoint_name(3, 4))
    copy = tmp_path / "elsewhere.ckpt"  # not version_0's newest: the next fit starts version_1
    resumed.save_checkpoint(copy)
    other, checkpoint = fit(6, ckpt_path=copy)
    assert other.run_dir == tmp_path / "version_1"
    assert kept(first) == [ckpt.checkpoint_name(1, 2), ckpt.checkpoint_name(3, 4)]
    assert kept(other) == [ckpt.checkpoint_name(5, 6)]  # 0.9 then 0.8: its own best, though worse than version_0's
    assert checkpoint.best_model_path == str(other.run_dir / "checkpoints" / ckpt.checkpoint_name(5, 6))


def test_a_checkpoint_saved_outside_the_callback_and_resumed_from_in_place_is_kept_the_rest_pruned(tmp_path):
    trainer = _Trainer(tmp_path / "version_0")
    callback = ModelCheckpoint(save_top_k=1)
    callback.setup_directory(trainer)
    _steps(callback, trainer, (1,))
    trainer.global_step = 2  # a save on a signal (Trainer.save_checkpoint), then the process exits
    on_signal = trainer.write_checkpoint(trainer.run_dir / "checkpoints")
    resumed = ModelCheckpoint(save_top_k=1)
    resumed.load_state_dict({"best_k": callback.state_dict()["best_k"]})  # as written before "newest" was kept
    trainer.ckpt_path = str(on_signal)  # fit(ckpt_path="last") continues version_0 from it
    resumed.setup_directory(trainer)
    _steps(resumed, trainer, (3,))
    kept = sorted(p.name for p in (trainer.run_dir / "checkpoints").glob("*.ckpt"))
    assert kept == [ckpt.checkpoint_name(0, 2), ckpt.checkpoint_name(0, 3)]  # step 1's pruned, not the resumed one


def test_save_checkpoint_never_replaces_another_runs_checkpoint_and_an_existing_file_only_when_asked(tmp_path):
    from torch.utils.data import DataLoader

    from tests import workers
    from trainscale.loop.trainer import Trainer

    def fit():
        trainer = Trainer(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=tmp_path, max_epochs=1)
        trainer.fit(workers.make_model(0), DataLoader(workers.tiny_dataset(8), batch_size=8), optimizer=workers.sgd)
        return trainer

    first, second = fit(), fit()
    theirs = first.run_dir / "checkpoints" / (first.run_dir / "checkpoints" / ckpt.LAST).read_text().strip()
    before = {theirs: theirs.read_bytes()}
    with pytest.raises(FileExistsError, match="belongs to another run"):
        second.save_checkpoint(theirs, overwrite=True)  # never, even when asked
    assert {p: p.read_bytes() for p in before} == before
    mine = second.save_checkpoint(tmp_path / "final.pt")  # the exact path given, whatever its extension
    assert mine == tmp_path / "final.pt" and mine.is_file()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        second.save_checkpoint(mine)
    assert second.save_checkpoint(mine, overwrite=True) == mine
    assert second.save_checkpoint(second.run_dir / "checkpoints" / "own.ckpt").is_file()


def _fitted_run(root, epochs=2):
    from torch.utils.data import DataLoader

    from tests import workers
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                      max_epochs=epochs, callbacks=[ModelCheckpoint(save_top_k=-1)])
    trainer.fit(workers.make_model(0), DataLoader(workers.tiny_dataset(8), batch_size=8), optimizer=workers.sgd)
    return trainer


def test_a_runs_last_file_given_as_a_path_loads_the_checkpoint_it_names(tmp_path):
    """`<run>/checkpoints/last` is a line naming a checkpoint: as a path it means that checkpoint, not a file to
    verify (it has no .sha256) or to unpickle."""
    from trainscale.checkpointing.checkpointer import read_module_checkpoint

    trainer = _fitted_run(tmp_path)
    entries, _ = read_module_checkpoint(trainer.run_dir / "checkpoints" / ckpt.LAST)
    assert entries["train_state"]["global_step"] == 2


def test_a_checksum_file_given_as_the_checkpoint_names_the_checkpoint(tmp_path):
    from trainscale.runtime.checkpoint_io import CheckpointError, load_file

    trainer = _fitted_run(tmp_path)
    newest = ckpt.find_last(tmp_path)
    with pytest.raises(CheckpointError, match=r"is the checksum file of checkpoint .*epoch=1-step=2.ckpt.*pass that path"):
        load_file(f"{newest}.sha256")
    assert trainer.global_step == 2


@pytest.mark.parametrize("content", ["", "epoch=9-step=99.ckpt"])
def test_a_last_file_empty_or_naming_a_deleted_checkpoint_names_the_intact_ones_beside_it(tmp_path, content):
    trainer = _fitted_run(tmp_path)
    (trainer.run_dir / "checkpoints" / ckpt.LAST).write_text(content + "\n")
    newest = trainer.run_dir / "checkpoints" / ckpt.checkpoint_name(1, 2)
    what = "is empty" if not content else r"names 'epoch=9-step=99.ckpt', which does not exist \(deleted or moved\)"
    with pytest.raises(FileNotFoundError, match=rf"{what}; the intact checkpoints beside it: "
                                                rf"epoch=0-step=1.ckpt, {newest.name}; resume from the "
                                                rf"newest with ckpt_path='{newest}'"):
        ckpt.find_last(tmp_path)
