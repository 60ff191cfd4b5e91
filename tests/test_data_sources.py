"""Lightning's data hooks and hyperparameters, so a Lightning project ports by changing imports and base class:
``fit(model, datamodule=dm)``, ``test(model, datamodule=dm)``, a model's own ``train_dataloader()``,
``save_hyperparameters()``/``hparams``."""

import json

import pytest
import torch
from torch.utils.data import DataLoader

from tests import module_workers as mw
from tests import workers
from tests.helpers import run_distributed
from trainscale.lightning.data_sources import DataModule, resolve_loaders
from trainscale.lightning.module import TrainingModule
from trainscale.loop.trainer import Trainer


class Classifier(TrainingModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1, **extra):
        super().__init__()
        self.save_hyperparameters(ignore="hidden")
        self.lin = torch.nn.Linear(1, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.lin(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.lin(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("loss", torch.nn.functional.cross_entropy(self.lin(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Indexed(DataModule):
    """Counts its hooks; train 12 samples, val 6, test 5."""

    def __init__(self, batch_size: int = 4):
        self.save_hyperparameters()
        self.calls: list[str] = []

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")
        self.train, self.val, self.test = mw.indexed_dataset(12), mw.indexed_dataset(6), mw.indexed_dataset(5)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=self.hparams.batch_size)


def _trainer(tmp_path, **kw):
    return Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, **{"max_epochs": 2, **kw})


# -- hyperparameters ----------------------------------------------------------------------------------
def test_save_hyperparameters_keeps_the_init_arguments_by_name():
    model = Classifier(lr=0.5, extra_flag=True)
    assert model.hparams == {"lr": 0.5, "extra_flag": True}  # hidden ignored, **extra spread, self never kept
    assert model.hparams.lr == 0.5
    model.hparams.lr = 0.2
    assert model.hparams["lr"] == 0.2
    with pytest.raises(AttributeError, match="no hyperparameter 'momentum'; saved: lr, extra_flag"):
        model.hparams.momentum

    class Named(TrainingModule):
        def __init__(self, a=1, b=2):
            super().__init__()
            self.save_hyperparameters("b")

    assert Named().hparams == {"b": 2}

    class Wrong(TrainingModule):
        def __init__(self, a=1):
            super().__init__()
            self.save_hyperparameters("c")

    with pytest.raises(ValueError, match=r"save_hyperparameters\('c'\): c not among the arguments of the caller \(a\)"):
        Wrong()
    assert "hparams" not in dict(Classifier().named_modules())  # a plain attribute, never a submodule or state


def test_the_models_hyperparameters_reach_the_loggers(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(Classifier(lr=0.25), datamodule=Indexed())
    logged = json.loads((trainer.run_dir / "hparams.json").read_text())
    assert logged == {"lr": 0.25, "batch_size": 4}  # the model's and the data module's, as Lightning logs them
    summary = json.loads((trainer.run_dir / "summary.json").read_text())
    assert summary["flags"]["max_epochs"] == 1  # the Trainer's flags are in the run's summary


# -- data modules and the model's own loaders ------------------------------------------------------
def test_fit_and_test_with_a_datamodule_equal_fit_and_test_with_its_loaders(tmp_path):
    dm = Indexed()
    torch.manual_seed(0)
    by_module = Classifier()
    trainer = _trainer(tmp_path / "dm")
    trainer.fit(by_module, datamodule=dm)
    (tested,) = trainer.test(by_module, datamodule=dm)
    assert dm.calls == ["prepare_data", "setup:fit", "prepare_data", "setup:test"]

    reference = Indexed()
    reference.setup("fit")
    torch.manual_seed(0)
    by_loaders = Classifier()
    trainer = _trainer(tmp_path / "loaders")
    trainer.fit(by_loaders, reference.train_dataloader(), reference.val_dataloader())
    for name, value in by_loaders.state_dict().items():
        torch.testing.assert_close(by_module.state_dict()[name], value, rtol=0, atol=0)
    assert [tested] == trainer.test(by_loaders, reference.test_dataloader())
    assert trainer.test(by_loaders, dm)[0]["loss"] == tested["loss"]  # a data module where the loader goes


def test_a_model_with_its_own_train_dataloader_fits_without_loaders(tmp_path):
    class WithLoaders(Classifier):
        def train_dataloader(self):
            return DataLoader(mw.indexed_dataset(8), batch_size=4)

    trainer = _trainer(tmp_path)
    trainer.fit(WithLoaders())
    assert trainer.global_step == 4  # 2 epochs of 2 batches
    assert "val_loss" not in trainer.history[-1]  # no val_dataloader(): no validation


def test_missing_or_doubled_data_is_refused_naming_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"fit: no DataLoader was passed and Classifier defines no train_dataloader\(\)"):
        _trainer(tmp_path).fit(Classifier())
    with pytest.raises(ValueError, match="fit: pass DataLoaders or datamodule=, not both"):
        _trainer(tmp_path).fit(Classifier(), DataLoader(mw.indexed_dataset(4)), datamodule=Indexed())
    with pytest.raises(ValueError, match=r"predict: .*Indexed \(the datamodule\) defines no predict_dataloader\(\)"):
        _trainer(tmp_path).predict(Classifier(), datamodule=Indexed())
    with pytest.raises(ValueError, match="passed both as the loader and as datamodule="):
        _trainer(tmp_path).validate(Classifier(), Indexed(), datamodule=Indexed())

    class Runtime:  # the order of the hooks, without a process group
        world = type("World", (), {"local_rank": 1})()

        def barrier(self):
            calls.append("barrier")

    calls = []
    dm = Indexed()
    [main], val = resolve_loaders(Runtime(), "validate", Classifier(), None, dm)  # evaluation loaders: a list
    assert dm.calls == ["setup:validate"] and calls == ["barrier"] and val is None  # local rank 1: no prepare_data
    assert len(main.dataset) == 6


def test_several_evaluation_loaders_need_a_step_taking_dataloader_idx_and_a_list_of_one_is_used(tmp_path):
    class TwoValSets(Indexed):
        def val_dataloader(self):
            return [DataLoader(self.val, batch_size=4), DataLoader(self.test, batch_size=4)]

    # Lightning's check and message: the step is called with a third argument only with several loaders
    with pytest.raises(RuntimeError, match=r"multiple `val_dataloader`, but no `dataloader_idx` argument in "
                                           r"`Classifier.validation_step\(\)`. Try adding `dataloader_idx=0`"):
        _trainer(tmp_path).fit(Classifier(), datamodule=TwoValSets())
    loader = DataLoader(mw.indexed_dataset(6), batch_size=4)
    with pytest.raises(RuntimeError, match="multiple `test_dataloader`"):
        _trainer(tmp_path).test(Classifier(), [loader, loader])
    with pytest.raises(ValueError, match="test: an empty list of DataLoaders was given.*pass at least one DataLoader"):
        _trainer(tmp_path).test(Classifier(), [])
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(Classifier(), DataLoader(mw.indexed_dataset(8), batch_size=4), [loader])  # Lightning's list of one
    assert "val_loss" in trainer.history[-1]


def test_self_optimizers_under_automatic_optimization_is_the_optimizer_the_trainer_steps(tmp_path):
    seen = []

    class Looking(Classifier):
        def training_step(self, batch, batch_idx):
            seen.append(self.optimizers())
            return super().training_step(batch, batch_idx)

    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(Looking(), DataLoader(mw.indexed_dataset(8), batch_size=4))
    assert len(seen) == 2 and all(opt is trainer.optimizers[0] for opt in seen)
    assert isinstance(seen[0], torch.optim.SGD) and seen[0].param_groups[0]["lr"] == 0.1


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_lightning_mnist_shaped_module_and_datamodule_on_two_ranks_match_plain_pytorch(tmp_path):
    """The Lightning MNIST example's shape with its data in a data module, ported by base classes only, under ddp
    on 2 ranks: the weights of one plain-PyTorch process at the global batch; prepare_data once (local rank 0),
    setup on both ranks."""
    ranks = run_distributed(mw.datamodule_body, str(tmp_path), timeout=200)
    reference = workers.plain_pytorch_reference(16, 2)
    for key, value in reference.items():
        for r in ranks:
            torch.testing.assert_close(r["state"][key], value, rtol=1e-5, atol=1e-6)
    assert [r["calls"] for r in ranks] == [["prepare_data", "setup:fit"], ["setup:fit"]]
    assert ranks[0]["test"] == ranks[1]["test"] and "loss" in ranks[0]["test"]


# -- limit_train_batches ------------------------------------------------------------------------------
class Seen(Classifier):
    def __init__(self):
        super().__init__()
        self.seen: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].flatten().tolist())
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("limit", [3, 0.5])
def test_limit_train_batches_trains_the_first_batches_of_each_epochs_shuffle(tmp_path, limit):
    """Lightning's ``limit_train_batches`` (a count, or a fraction of the epoch's 6 batches): each epoch trains on
    the first 3 batches of the order the full run would see, and counts as complete."""
    full, limited = Seen(), Seen()
    _trainer(tmp_path / "full").fit(full, DataLoader(mw.indexed_dataset(12), batch_size=2, shuffle=True))
    trainer = _trainer(tmp_path / "limited", limit_train_batches=limit)
    trainer.fit(limited, DataLoader(mw.indexed_dataset(12), batch_size=2, shuffle=True))
    assert limited.seen == full.seen[:3] + full.seen[6:9]
    assert trainer.global_step == 6 and not any("partial" in r for r in trainer.history)  # complete epochs


def test_limit_train_batches_resumes_mid_epoch_within_the_limit(tmp_path):
    """A checkpoint after 2 of the epoch's 4 allowed batches: the resumed run trains the other 2, then the next
    epoch's first 4, as the uninterrupted run did."""
    loader = DataLoader(mw.indexed_dataset(16), batch_size=2, shuffle=True)  # 8 batches, 4 of them trained
    whole = Seen()
    _trainer(tmp_path / "whole", limit_train_batches=4).fit(whole, loader)
    first = Seen()
    trainer = _trainer(tmp_path / "cut", limit_train_batches=4, checkpoint_every_n_steps=2, max_steps=2)
    trainer.fit(first, loader)
    resumed = Seen()
    resumed.load_state_dict(first.state_dict())
    _trainer(tmp_path / "cut", limit_train_batches=4).fit(resumed, loader, ckpt_path="last")
    assert first.seen + resumed.seen == whole.seen and len(whole.seen) == 8


def test_limit_train_batches_is_checked_when_the_trainer_is_built(tmp_path):
    for bad in (-1, 1.5, -0.5, True, "3"):  # 0 and 0.0: no training (tests/test_lightning_compat.py)
        with pytest.raises(ValueError, match=r"limit_train_batches=.* must be an int >= 0 \(batches per epoch\), a "
                                             r"float in \[0, 1\]"):
            _trainer(tmp_path, limit_train_batches=bad)


def test_limit_val_batches_validates_each_ranks_first_batches_in_fit_and_validate(tmp_path):
    """10 validation samples in batches of 4 (3 batches): a limit of 1 batch (or a fraction 0.5 of 3: 1) counts
    the first 4 samples, 0..3, in the fit's validation and in ``validate``."""
    for limit in (1, 0.5):
        trainer = _trainer(tmp_path / str(limit), max_epochs=1, limit_val_batches=limit)
        val = DataLoader(mw.indexed_dataset(10), batch_size=4)
        trainer.fit(mw.Logger(), DataLoader(mw.indexed_dataset(4)), val)
        assert trainer.history[-1]["count"] == 4 and trainer.history[-1]["mean_x"] == pytest.approx(1.5)
        assert trainer.validate(mw.Logger(), val)[0]["count"] == 4
    assert _trainer(tmp_path / "all").validate(mw.Logger(), val)[0]["count"] == 10
    with pytest.raises(ValueError, match=r"limit_val_batches=-1 must be an int >= 0"):  # 0 turns validation off
        _trainer(tmp_path, limit_val_batches=-1)
