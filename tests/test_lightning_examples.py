"""Lightning's own examples, ported to trainscale by changing their imports (examples/lightning/, docs/lightning.md
"What to change"), run in one process on tiny data: bug_report_model.py, autoencoder.py (MNIST-5k), the classes
of demos/boring_classes.py (automatic and manual optimization, a data module), the GAN, the two reinforcement
learning templates (gymnasium's CartPole), the transformer demo, backbone_image_classifier.py and the "Lightning in
15 minutes" guide; the last two also on 2 ddp processes (tests/lightning_examples_runs.py), compared with one.
autoencoder.py and backbone_image_classifier.py are Lightning's LightningCLI scripts: they are given their
``--trainer.*`` arguments (tests/lightning_examples_runs.py ``cli_main``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from examples.lightning import autoencoder, boring_classes, bug_report_model
from tests import lightning_examples_runs as runs
from tests.helpers import run_distributed
from trainscale import Trainer


def _flags(tmp_path) -> dict:
    return dict(default_root_dir=tmp_path, enable_progress_bar=False, logger=False, max_epochs=1)


def test_bug_report_model_runs_as_lightning_runs_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it writes under os.getcwd(), as in Lightning
    (results,) = bug_report_model.run()  # Lightning's list of one dict per test loader
    assert set(results) == {"test_loss"} and torch.isfinite(torch.tensor(results["test_loss"]))


def test_a_module_outside_a_trainer_has_its_parameters_device_as_in_lightning():
    module = bug_report_model.BoringModel()  # the 15-minute guide reads autoencoder.device after loading
    assert module.device == torch.device("cpu") and module.on_gpu is False


def test_autoencoder_fits_tests_and_predicts_from_its_best_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ImageSampler, where torchvision is installed, writes its grids there
    cli = runs.cli_main(autoencoder, runs.trainer_flags(  # Lightning's cli_main: LightningCLI(..., run=False)
        tmp_path, max_epochs=2, limit_train_batches=2, limit_val_batches=1, limit_test_batches=1,
        limit_predict_batches=1))
    trainer = cli.trainer
    assert [r["train_loss"] < 2.0 for r in trainer.history] == [True, True] and "val_loss_epoch" in trainer.history[-1]
    assert [p.shape for p in trainer.predictions] == [(32, 28 * 28)]  # limit_predict_batches=1: one batch of 32
    best = trainer.checkpoint_callbacks[0].best_model_path
    loaded = autoencoder.LitAutoEncoder.load_from_checkpoint(best)
    assert loaded.hparams == {"hidden_dim": 64, "learning_rate": 10e-3}
    # save_config_kwargs={"overwrite": True}: the parsed configuration, the example's defaults under the arguments
    saved = yaml.safe_load((Path(trainer.run_dir) / "config.yaml").read_text())
    assert (saved["seed_everything"], saved["trainer"]["max_epochs"], saved["data"]) == (1234, 2, {"batch_size": 32})


@pytest.mark.parametrize("model", [boring_classes.BoringModel, boring_classes.ManualOptimBoringModel])
def test_boring_models_fit_validate_test_and_predict(tmp_path, model):
    trainer = Trainer(limit_train_batches=4, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2,
                      **_flags(tmp_path))
    module = model()
    before = module.layer.weight.detach().clone()
    trainer.fit(module)  # the model's own *_dataloader hooks
    assert not torch.equal(module.layer.weight, before) and trainer.global_step == 4
    # nothing logged: the returned dicts' values are in the records only, so both return [{}], as Lightning's
    assert trainer.validate(module, verbose=False) == [{}] and trainer.test(module, verbose=False) == [{}]
    assert torch.cat(trainer.predict(module)).shape == (2, 2)  # Lightning's list of per-batch outputs
    assert trainer.test(module, datamodule=boring_classes.BoringDataModule(), verbose=False) == [{}]


def test_demo_model_trains(tmp_path):
    trainer = Trainer(limit_train_batches=2, **_flags(tmp_path))
    trainer.fit(boring_classes.DemoModel(), torch.utils.data.DataLoader(boring_classes.RandomDataset(32, 8)))
    assert trainer.global_step == 2


def test_gan_trains_both_networks_and_logs_through_the_tensorboard_logger(tmp_path):
    result = runs.gan(tmp_path, devices=1)  # 2 batches, two optimizers each; log_every_n_steps=2
    assert result["step"] == 4 and math.isfinite(result["d_loss"]) and math.isfinite(result["g_loss"])
    assert list(tmp_path.glob("version_0/tensorboard/events.out.tfevents.*"))  # the image went to the writer


@pytest.mark.parametrize("name", ["qnet", "ppo"])
def test_reinforcement_learning_templates_train_on_cartpole(tmp_path, name):
    pytest.importorskip("gymnasium")
    result = runs.RUNS[name](tmp_path, devices=1)
    # qnet: an epoch is the 200 replayed samples the data set yields, 13 batches of 16; ppo: 128 steps of play in
    # batches of 64, two optimizers stepping on each
    assert result["step"] == {"qnet": 13, "ppo": 4}[name]
    assert all(math.isfinite(v) for v in result.values())


def test_transformer_demo_fits_validates_and_tests(tmp_path):
    result = runs.transformer(tmp_path, devices=1)  # 2 batches of 20 blocks of 35 words over a 50-word vocabulary
    assert all(0 < result[k] < 2 * math.log(50) for k in ("train_loss", "val_loss", "test_loss"))


@pytest.mark.multiprocess
def test_backbone_classifier_and_15_minute_guide_agree_on_one_and_two_processes(tmp_path):
    """The same global batch (per-device batch halved on 2 processes, samples split by rank in turn, so each
    step's global batch holds the same samples): the losses, the predictions and the trained encoder match a
    one-process run within float32 rounding of a differently ordered gradient sum (measured: 2.4e-7 on losses
    near 2, 1.2e-7 on predictions, 3.2e-6 on the encoder after 20 Adam steps)."""
    names = ["backbone", "intro"]
    on_two = run_distributed(runs.on_each_rank, str(tmp_path / "two"), names, timeout=120)[0]  # rank zero's
    for name in names:
        one, two = runs.RUNS[name](tmp_path / "one" / name, devices=1), on_two[name]
        assert one.keys() == two.keys()
        for key, value in one.items():
            if key == "checkpoint":  # Lightning's name: the epoch trained (from 0), the steps taken
                assert value == two[key] == "epoch=0-step=20.ckpt"
            else:
                tolerance = 1e-4 if key == "encoder" else 1e-5
                torch.testing.assert_close(torch.as_tensor(two[key]), torch.as_tensor(value), rtol=0, atol=tolerance)
