"""strategy="ddp_spawn": the ranks are started by torch.multiprocessing spawn from this (the parent)
process; rank 0's summary and trained weights come back. Parity with plain PyTorch, as for ddp."""

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests import workers, workers_strategies
from tests.helpers import run_python
from trainscale.callbacks import ModelCheckpoint
from trainscale.runtime.runtime import Runtime
from trainscale.loop.trainer import Trainer
from trainscale.trainer.states import TrainerFn, TrainerStatus

pytestmark = pytest.mark.multiprocess


EPOCHS, BATCH = 3, 8


@pytest.fixture(scope="module")
def spawned_fit(tmp_path_factory):
    """One fit in 2 spawned ranks, with ddp options and a ModelCheckpoint on val_loss: the trainer, the callback,
    the model, the weights before and right after the fit, the summary and the validation loader."""
    root = tmp_path_factory.mktemp("spawned_fit")
    callback = ModelCheckpoint(monitor="val_loss")
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=EPOCHS, seed=0, timeout=60,
                      default_root_dir=root, enable_progress_bar=False, callbacks=[callback],
                      strategy_options={"gradient_as_bucket_view": True, "bucket_cap_mb": 1})
    model, val = workers.make_model(0), DataLoader(workers.tiny_dataset(20, seed=3), batch_size=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    summary = trainer.fit(model, DataLoader(workers.tiny_dataset(96), batch_size=BATCH, shuffle=True), val,
                          optimizer=workers.sgd)
    fitted = {k: v.clone() for k, v in model.state_dict().items()}
    return {"trainer": trainer, "callback": callback, "model": model, "before": before, "fitted": fitted,
            "summary": summary, "root": root, "val": val}


def test_trainer_fit_in_spawned_ranks_equals_plain_pytorch_and_returns_weights(spawned_fit):
    trainer, summary, before = spawned_fit["trainer"], spawned_fit["summary"], spawned_fit["before"]
    assert trainer.runtime.config.strategy == "ddp" and trainer.runtime.config.start_method == "spawn"
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp" and summary["global_batch_size"] == 2 * BATCH
    assert summary["epochs"] == EPOCHS and trainer.global_step == EPOCHS * 96 // (2 * BATCH)
    assert (spawned_fit["root"] / "version_0" / "summary.json").is_file()
    state = trainer.state  # rank 0's, sent back: Lightning's enums
    assert (state.status, state.fn, state.stage) == (TrainerStatus.FINISHED, TrainerFn.FITTING, None)
    assert isinstance(state.status, TrainerStatus) and isinstance(state.fn, TrainerFn)
    reference = workers.plain_pytorch_reference(2 * BATCH, EPOCHS)
    for key, ref in reference.items():
        assert not torch.equal(before[key], ref)  # training moved the weights...
        torch.testing.assert_close(spawned_fit["fitted"][key], ref, rtol=1e-5, atol=1e-6)  # ...and they came back


def test_a_spawned_fit_returns_the_best_checkpoint_which_test_then_evaluates(spawned_fit):
    """The ModelCheckpoint's state and the metrics come back from the spawned ranks (the callback in this process
    never saw the fit), so ``trainer.test(model, loader, ckpt_path="best")`` finds the best checkpoint."""
    trainer, callback = spawned_fit["trainer"], spawned_fit["callback"]
    history = [r["val_loss"] for r in trainer.history]
    best = history.index(min(history))
    assert best < len(history) - 1  # the best checkpoint is not the fitted weights
    assert callback.best_model_path is not None and f"epoch={best}-step=" in callback.best_model_path
    assert trainer.callback_metrics["val_loss"] == pytest.approx(history[-1])
    test_loss = trainer.test(spawned_fit["model"], spawned_fit["val"], ckpt_path="best")[0]["test_loss"]
    assert test_loss == pytest.approx(history[best], rel=1e-6)
    # without a model, as Lightning's: the spawned fit's model, with its best checkpoint and Lightning's warning
    assert trainer.fitted_module is spawned_fit["model"]
    with pytest.warns(UserWarning, match=r"`.test\(ckpt_path=None\)` was called without a model"):
        assert trainer.test(dataloaders=spawned_fit["val"])[0]["test_loss"] == pytest.approx(test_loss, rel=1e-6)


def test_runtime_launch_function_runs_on_each_spawned_rank_with_ddp_options():
    rt = Runtime(accelerator="cpu", devices=2, strategy="ddp_spawn", timeout=60,
                 strategy_options={"static_graph": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 2})
    out = rt.launch(workers_strategies.spawn_options_body)
    assert out["rank"] == 0 and out["world_size"] == 2 and out["sum_of_ranks_plus_one"] == 3.0
    assert out["strategy"] == "ddp" and out["static_graph"] and out["gradient_as_bucket_view"]
    assert out["bucket_bytes_cap"] == 2 * 1024 * 1024


def test_unpicklable_argument_is_named_with_the_fix_before_any_process_starts(tmp_path):
    """cloudpickle sends lambdas by value (tests/test_ddp_notebook.py); a lock cannot be sent at all."""
    import threading

    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", default_root_dir=tmp_path,
                      enable_progress_bar=False)
    loader = DataLoader(workers.tiny_dataset(16), batch_size=4)
    lock = threading.Lock()

    def loss(out, y):  # holds a lock: nothing can pickle it
        with lock:
            return out.sum()

    with pytest.raises(ValueError, match=r"sends loss_fn to new processes by pickling \(cloudpickle\), but it cannot "
                                         r"be pickled \(TypeError: .*lock.*strategy='ddp_notebook'"):
        trainer.fit(workers.make_model(), loader, optimizer=workers.sgd, loss_fn=loss)


def test_missing_cloudpickle_names_what_to_install(monkeypatch):
    import io

    from trainscale.runtime import spawn

    monkeypatch.setitem(sys.modules, "cloudpickle", None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install cloudpickle \(or 'trainscale\[spawn\]'\)"):
        spawn.dump_checked(workers.sgd, {}, io.BytesIO())


def test_bad_ddp_option_and_launch_without_function_fail_in_the_parent():
    with pytest.raises(ValueError, match=r"strategy='ddp' does not accept option\(s\) 'find_unused_params'; its options are: find_unused_parameters"):
        Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", strategy_options={"find_unused_params": True})
    rt = Runtime(accelerator="cpu", devices=2, strategy="ddp_spawn")
    with pytest.raises(RuntimeError, match=r"strategy='ddp_spawn' runs the job in child processes.*"
                                           r"call runtime.launch\(fn, ...\), or use Trainer.fit"):
        rt.setup(torch.nn.Linear(2, 2))


# A user's script with no `if __name__ == "__main__":` guard. The data (512 KiB) is larger
# than a pipe's 64 KiB buffer: a parent writing it into a pipe would block forever on a child that has already
# died while importing the script again.
_UNGUARDED_SCRIPT = """
import functools
from pathlib import Path
import torch
from torch.utils.data import DataLoader, TensorDataset
from trainscale.loop.trainer import Trainer
from trainscale.trainer.states import TrainerFn, TrainerStatus

x, y = torch.randn(16384, 8), torch.randint(0, 2, (16384,))
trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, enable_progress_bar=False,
                  default_root_dir={root!r}, timeout=30)
trainer.fit(torch.nn.Linear(8, 2), DataLoader(TensorDataset(x, y), batch_size=64),
            optimizer=functools.partial(torch.optim.SGD, lr=0.1), loss_fn=torch.nn.functional.cross_entropy)
print("trained")
"""


@pytest.mark.timeout(180)
def test_script_without_main_guard_fails_fast_naming_the_guard(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_UNGUARDED_SCRIPT.format(root=str(tmp_path / "runs")))
    out, seconds = run_python([str(script)], tmp_path)  # a hang ends in subprocess.TimeoutExpired
    assert out.returncode != 0 and "trained" not in out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: strategy='ddp_spawn': the process of rank") and "died while starting" in last
    assert "add `if __name__ == '__main__':`" in last
    assert seconds < 100  # a generous bound: it takes a few seconds; the hang was forever
    assert not list((tmp_path / "tmp").glob("trainscale-spawn-*"))  # the job's payload file is removed


@pytest.mark.timeout(180)
def test_script_read_from_stdin_fails_fast_naming_the_fix(tmp_path):
    guarded = "def main():\n" + "".join(f"    {line}\n" for line in _UNGUARDED_SCRIPT.format(
        root=str(tmp_path / "runs")).splitlines()) + "\nif __name__ == '__main__':\n    main()\n"
    out, seconds = run_python(["-"], tmp_path, stdin=guarded)  # a hang ends in subprocess.TimeoutExpired
    assert out.returncode != 0 and "trained" not in out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert "died while starting" in last and "add `if __name__ == '__main__':`" in last
    assert "This program was read from <stdin>, which a new process cannot read again" in last
    assert seconds < 100


def test_payload_goes_through_a_file_that_is_removed_afterwards(tmp_path, monkeypatch):
    """The pipe of spawn's bootstrap carries a few hundred bytes whatever the size of the arguments, and the
    job's temporary directory (payload, result, markers) is gone after the run."""
    import tempfile

    import torch.multiprocessing as mp

    from trainscale.runtime import spawn

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = {}

    class Done(Exception):
        pass

    def fake_start_processes(fn, args, nprocs, join, start_method):
        import pickle

        seen["args_bytes"] = len(pickle.dumps(args))
        seen["payload_bytes"] = (Path(args[0]) / spawn._PAYLOAD).stat().st_size
        raise Done

    monkeypatch.setattr(mp, "start_processes", fake_start_processes)
    with pytest.raises(Done):
        spawn.run(workers_strategies.spawn_options_body, {"big": torch.zeros(1 << 16)}, 2)
    assert seen["payload_bytes"] > 256 * 1024 and seen["args_bytes"] < 1024
    assert list(tmp_path.iterdir()) == []
