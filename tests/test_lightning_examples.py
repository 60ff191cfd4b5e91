"""Lightning's own examples, ported to trainscale by changing their imports (examples/lightning/, docs/lightning.md
"What to change"), run in one process on tiny data: bug_report_model.py, autoencoder.py (MNIST-5k) and the classes
of demos/boring_classes.py (automatic and manual optimization, a data module)."""

from __future__ import annotations

import pytest
import torch

from examples.lightning import autoencoder, boring_classes, bug_report_model
from trainscale import Trainer


def _flags(tmp_path) -> dict:
    return dict(default_root_dir=tmp_path, enable_progress_bar=False, logger=False, max_epochs=1)


def test_bug_report_model_runs_as_lightning_runs_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it writes under os.getcwd(), as in Lightning
    results = bug_report_model.run()
    assert set(results) == {"test_loss"} and torch.isfinite(torch.tensor(results["test_loss"]))


def test_autoencoder_fits_tests_and_predicts_from_its_best_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer, predictions = autoencoder.cli_main(max_epochs=2, limit_train_batches=2, limit_val_batches=1,
                                                limit_test_batches=1, limit_predict_batches=1,
                                                enable_progress_bar=False, logger=False)
    assert [r["train_loss"] < 2.0 for r in trainer.history] == [True, True] and "val_loss_epoch" in trainer.history[-1]
    assert predictions.shape == (32, 28 * 28)  # limit_predict_batches=1: one batch of 32, in one tensor
    best = trainer.checkpoint_callbacks[0].best_model_path
    loaded = autoencoder.LitAutoEncoder.load_from_checkpoint(best)
    assert loaded.hparams == {"hidden_dim": 64, "learning_rate": 10e-3}


@pytest.mark.parametrize("model", [boring_classes.BoringModel, boring_classes.ManualOptimBoringModel])
def test_boring_models_fit_validate_test_and_predict(tmp_path, model):
    trainer = Trainer(limit_train_batches=4, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2,
                      **_flags(tmp_path))
    module = model()
    before = module.layer.weight.detach().clone()
    trainer.fit(module)  # the model's own *_dataloader hooks
    assert not torch.equal(module.layer.weight, before) and trainer.global_step == 4
    # nothing logged: trainscale reports the returned dicts' values (Lightning returns {} here; docs/lightning.md)
    assert set(trainer.validate(module, verbose=False)) == {"val_x"}
    assert set(trainer.test(module, verbose=False)) == {"test_y"}
    assert trainer.predict(module).shape == (2, 2)
    assert set(trainer.test(module, datamodule=boring_classes.BoringDataModule(), verbose=False)) == {"test_y"}


def test_demo_model_trains(tmp_path):
    trainer = Trainer(limit_train_batches=2, **_flags(tmp_path))
    trainer.fit(boring_classes.DemoModel(), torch.utils.data.DataLoader(boring_classes.RandomDataset(32, 8)))
    assert trainer.global_step == 2
