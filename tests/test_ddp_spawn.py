"""strategy="ddp_spawn": the ranks are started by torch.multiprocessing spawn from this (the parent)
process; rank 0's summary and trained weights come back. Parity with plain PyTorch, as for ddp."""

import functools

import pytest
import torch
from torch.utils.data import DataLoader

from tests import workers, workers_strategies
from trainscale.runtime.runtime import Runtime
from trainscale.train.trainer import Trainer

pytestmark = pytest.mark.multiprocess


def test_trainer_fit_in_spawned_ranks_equals_plain_pytorch_and_returns_weights(tmp_path):
    epochs, b = 2, 8
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=epochs, seed=0,
                      default_root_dir=tmp_path, enable_progress_bar=False, timeout=60,
                      strategy_options={"gradient_as_bucket_view": True, "bucket_cap_mb": 1})
    model = workers.make_model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    summary = trainer.fit(model, DataLoader(workers.tiny_dataset(96), batch_size=b, shuffle=True),
                          DataLoader(workers.tiny_dataset(50, seed=1), batch_size=8), optimizer=workers.sgd)
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp_spawn" and summary["global_batch_size"] == 2 * b
    assert summary["epochs"] == epochs and trainer.global_step == epochs * 96 // (2 * b)
    assert (tmp_path / "version_0" / "summary.json").is_file()
    reference = workers.plain_pytorch_reference(2 * b, epochs)
    for key, ref in reference.items():
        assert not torch.equal(before[key], ref)  # training moved the weights...
        torch.testing.assert_close(model.state_dict()[key], ref, rtol=1e-5, atol=1e-6)  # ...and they came back


def test_runtime_launch_function_runs_on_each_spawned_rank_with_ddp_options():
    rt = Runtime(accelerator="cpu", devices=2, strategy="ddp_spawn", timeout=60,
                 strategy_options={"static_graph": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 2})
    out = rt.launch(workers_strategies.spawn_options_body)
    assert out["rank"] == 0 and out["world_size"] == 2 and out["sum_of_ranks_plus_one"] == 3.0
    assert out["strategy"] == "ddp_spawn" and out["static_graph"] and out["gradient_as_bucket_view"]
    assert out["bucket_bytes_cap"] == 2 * 1024 * 1024


def test_unpicklable_optimizer_factory_names_the_fix(tmp_path):
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", default_root_dir=tmp_path,
                      enable_progress_bar=False)
    loader = DataLoader(workers.tiny_dataset(16), batch_size=4)
    with pytest.raises(ValueError, match=r"sends optimizer to new processes by pickling.*def, not lambda.*partial"):
        trainer.fit(workers.make_model(), loader, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    loss = lambda out, y: out.sum()  # noqa: E731 - the point of the test
    with pytest.raises(ValueError, match="sends loss_fn to new processes"):
        trainer.fit(workers.make_model(), loader, optimizer=functools.partial(torch.optim.SGD, lr=0.1), loss_fn=loss)


def test_bad_ddp_option_and_launch_without_function_fail_in_the_parent():
    with pytest.raises(ValueError, match=r"strategy='ddp_spawn' does not accept option\(s\) 'find_unused_params'; its options are: find_unused_parameters"):
        Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", strategy_options={"find_unused_params": True})
    rt = Runtime(accelerator="cpu", devices=2, strategy="ddp_spawn")
    with pytest.raises(RuntimeError, match=r"call runtime.launch\(fn, ...\), or use Trainer.fit"):
        rt.setup(torch.nn.Linear(2, 2))


def test_classes_from_an_interactive_session_are_refused_before_spawning(monkeypatch):
    """A notebook's classes live in a __main__ without a file: spawned interpreters cannot import them."""
    import sys
    import types

    from trainscale.runtime.spawn import dumps_checked

    notebook = types.ModuleType("__main__")  # like Jupyter's: no __file__
    Net = type("Net", (torch.nn.Linear,), {"__module__": "__main__"})
    notebook.Net = Net
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    with pytest.raises(ValueError, match=r"model uses a class or function defined in this interactive session.*"
                                         r"Move it into a .py module"):
        dumps_checked({"model": Net(2, 2)})
    assert dumps_checked({"model": torch.nn.Linear(2, 2)})  # library classes are fine
