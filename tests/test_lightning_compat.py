"""Lightning 2.6's documented behaviour where the same script would otherwise give other numbers: the epoch count
after ``fit``, step values in ``callback_metrics``, ``max_steps`` without ``max_epochs``, the order of a training
loader on several ranks, the sanity check of a resumed ``fit``; and Lightning's spellings that ports meet."""

import copy
import json
import math
import os
import pickle
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainscale
from trainscale.callbacks import Callback, EarlyStopping, ModelCheckpoint
from trainscale.lightning.module import TrainingModule
from trainscale.loop.config import resolve_trainer_config
from trainscale.loop.data_checks import warn_unshuffled
from trainscale.loop.trainer import Trainer
from trainscale.utilities.warnings import PossibleUserWarning


class Probe(TrainingModule):
    """A linear model that logs the batch index (on_step), a constant ``train_loss`` and ``both`` (on_step and
    on_epoch), and notes ``self.current_epoch`` at each epoch's start and end."""

    def __init__(self, train_loss: float | None = None):
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.train_loss = train_loss
        self.epochs_seen: list[tuple[str, int]] = []
        self.saved_epoch = None

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("idx", float(batch_idx))
        self.log("both", float(batch_idx), on_step=True, on_epoch=True, reduce_fx="max")
        if self.train_loss is not None:
            self.log("train_loss", self.train_loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.layer(batch[0]).pow(2).mean())

    def on_train_epoch_start(self):
        self.epochs_seen.append(("start", self.current_epoch))

    def on_train_epoch_end(self):
        self.epochs_seen.append(("end", self.current_epoch))

    def on_save_checkpoint(self, checkpoint):
        self.saved_epoch = checkpoint["epoch"]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class StepWatch(Callback):
    """Notes ``callback_metrics`` after every optimizer step, and counts the sanity checks."""

    def __init__(self):
        self.seen: list[dict] = []
        self.sanity_checks = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k in ("idx", "both", "both_step")})

    def on_sanity_check_start(self, trainer, module):
        self.sanity_checks += 1


def _loader(n=8, batch_size=2):
    x = torch.linspace(-1, 1, 2 * n).reshape(n, 2)
    return DataLoader(TensorDataset(x, torch.zeros(n)), batch_size=batch_size)


def _trainer(tmp_path, **kw):
    kw.setdefault("enable_model_summary", False)
    return Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, **kw)


# -- the epoch count ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_current_epoch_counts_completed_epochs_after_fit_and_in_a_checkpoint_saved_then(tmp_path):
    torch.manual_seed(0)
    model = Probe()
    trainer = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(model, _loader())
    assert model.epochs_seen == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]  # inside: the running epoch
    assert trainer.current_epoch == 2  # after fit: the epochs completed, as Lightning's
    path = trainer.save_checkpoint(tmp_path / "after.pt")
    assert model.saved_epoch == 2
    assert torch.load(path, weights_only=True)["epoch"] == 2 and torch.load(path, weights_only=True)["global_step"] == 8

    # resumed from it for a third epoch: the same weights as three epochs in one run, and the same count
    torch.manual_seed(0)
    resumed_model = Probe()
    resumed = _trainer(tmp_path / "r", max_epochs=3, num_sanity_val_steps=0)
    resumed.fit(resumed_model, _loader(), ckpt_path=path)
    assert resumed_model.epochs_seen == [("start", 2), ("end", 2)] and resumed.current_epoch == 3
    torch.manual_seed(0)
    full_model = Probe()
    _trainer(tmp_path / "f", max_epochs=3, num_sanity_val_steps=0).fit(full_model, _loader())
    for key, value in full_model.state_dict().items():
        torch.testing.assert_close(resumed_model.state_dict()[key], value, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_current_epoch_after_a_stop_by_max_steps_or_early_stopping(tmp_path):
    trainer = _trainer(tmp_path / "a", max_epochs=5, max_steps=6, num_sanity_val_steps=0)
    trainer.fit(Probe(), _loader())  # 4 steps an epoch: the second epoch stops after its second step
    assert (trainer.global_step, trainer.current_epoch) == (6, 2)

    stop = EarlyStopping("val_loss", patience=1, min_delta=1e9)  # never improves: stops after the second epoch
    trainer = _trainer(tmp_path / "b", max_epochs=5, num_sanity_val_steps=0, callbacks=[stop])
    trainer.fit(Probe(), _loader(), _loader(4))
    assert stop.stopped_epoch == 1 and trainer.current_epoch == 2  # Lightning: current_epoch - 1 == stopped epoch


# -- step values in callback_metrics -------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_step_values_reach_callback_metrics_after_every_step(tmp_path):
    watch = StepWatch()
    trainer = _trainer(tmp_path, max_steps=12, log_every_n_steps=5, num_sanity_val_steps=0, callbacks=[watch])
    trainer.fit(Probe(), _loader(24))
    assert [seen["idx"] for seen in watch.seen] == [float(i) for i in range(12)]  # not only at steps 5 and 10
    assert [seen["both_step"] for seen in watch.seen] == [float(i) for i in range(12)]
    assert [seen["both"] for seen in watch.seen] == [float(i) for i in range(12)]  # the bare name too, as Lightning
    assert float(trainer.callback_metrics["idx"]) == 11.0
    assert float(trainer.callback_metrics["both_epoch"]) == 11.0 == float(trainer.callback_metrics["both"])


class ValBoth(Probe):
    """Logs the validation batch index on_step and on_epoch (max): ``vb_epoch`` and the bare ``vb`` hold the max."""

    def validation_step(self, batch, batch_idx):
        self.log("vb", float(batch_idx), on_step=True, on_epoch=True, reduce_fx="max")


@pytest.mark.timeout(60)
def test_a_validation_value_logged_on_step_and_on_epoch_is_monitored_by_its_bare_name(tmp_path):
    stop = EarlyStopping(monitor="vb", mode="max", patience=5)
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=[stop])
    trainer.fit(ValBoth(), _loader(), _loader(6))  # 3 validation batches
    assert float(trainer.callback_metrics["vb_epoch"]) == 2.0 == float(trainer.callback_metrics["vb"])
    assert float(stop.best_score) == 2.0
    assert "vb" not in trainer.history[-1] and trainer.history[-1]["vb_epoch"] == 2.0  # the records keep one name


@pytest.mark.timeout(60)
def test_a_logged_train_loss_is_not_replaced_by_the_trainers_own(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=2, log_every_n_steps=1, num_sanity_val_steps=0)
    trainer.fit(Probe(train_loss=7.0), _loader())
    assert float(trainer.callback_metrics["train_loss"]) == 7.0  # the user's, as Lightning's
    assert trainer.history[-1]["train_loss"] != 7.0  # the records keep trainscale's epoch mean of the returned loss


@pytest.mark.timeout(60)
def test_a_value_logged_in_on_train_batch_end_is_in_callback_metrics_at_once(tmp_path):
    class LogsAtBatchEnd(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pl_module.log("steps_seen", float(trainer.global_step))

    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=[LogsAtBatchEnd()])
    trainer.fit(Probe(), _loader())  # 4 steps, no log step (log_every_n_steps=50)
    assert float(trainer.callback_metrics["steps_seen"]) == 4.0  # the last step's, as Lightning's


def test_a_training_step_run_by_hand_logs_into_callback_metrics_at_once(tmp_path):
    # Lightning's callback_metrics are read from what was logged, so a module attached with model.trainer = trainer
    # and its training_step called outside fit has its values there: one-element tensors as 0-d ones
    model, trainer = Probe(), _trainer(tmp_path)
    model.trainer = trainer
    model.log("one_element", torch.tensor([1.5]), on_epoch=True)
    model.training_step(next(iter(_loader())), 7)
    got = trainer.callback_metrics
    assert got["one_element"].ndim == 0 and float(got["one_element"]) == 1.5 and "one_element_step" in got
    assert float(got["idx"]) == 7.0 and float(got["both"]) == 7.0
    trainer.fit(Probe(), _loader())  # then a fit publishes its own steps' values (4 batches), as before
    assert float(trainer.callback_metrics["idx"]) == 3.0 and float(trainer.callback_metrics["both_epoch"]) == 3.0


@pytest.mark.timeout(60)
def test_callback_metrics_hold_what_the_module_logged_as_tensors_and_none_of_the_records_fields(tmp_path):
    class Returns(Probe):  # a validation step that returns a value it does not log
        def validation_step(self, batch, batch_idx):
            super().validation_step(batch, batch_idx)
            return {"unlogged": torch.tensor(1.0)}

    trainer = _trainer(tmp_path, max_epochs=1, log_every_n_steps=1, num_sanity_val_steps=0)
    trainer.fit(Returns(), _loader(), _loader(4))
    assert set(trainer.callback_metrics) == {"idx", "both", "both_step", "both_epoch", "val_loss"}
    assert all(isinstance(v, torch.Tensor) for v in trainer.callback_metrics.values())
    assert {"step", "epoch", "samples_per_s", "lr-SGD", "val_unlogged"} <= set(trainer.history[-1])  # the records
    # a plain model and loss logs nothing: trainscale's loss and validation results are its metrics to monitor
    plain = _trainer(tmp_path / "p", max_epochs=1, log_every_n_steps=1, num_sanity_val_steps=0)
    plain.fit(nn.Linear(2, 1), _loader(), _loader(4), loss_fn=lambda out, y: (out.squeeze(1) - y).pow(2).mean(),
              optimizer=lambda params: torch.optim.SGD(params, lr=0.05))
    assert set(plain.callback_metrics) == {"train_loss", "val_loss"}
    assert float(plain.callback_metrics["train_loss"]) == pytest.approx(plain.history[-1]["train_loss"])


# -- max_steps, max_epochs ------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_max_steps_without_max_epochs_trains_that_many_steps(tmp_path):
    trainer = _trainer(tmp_path, max_steps=10, num_sanity_val_steps=0)
    trainer.fit(Probe(), _loader())  # 4 steps an epoch
    assert trainer.global_step == 10 and len(trainer.history) == 3


@pytest.mark.parametrize(("flags", "epochs", "steps"), [
    ({}, 1, None),  # neither given: trainscale's 1 epoch (Lightning: 1000, with a warning)
    ({"max_steps": -1}, 1, None), ({"max_epochs": None}, 1, None), ({"max_epochs": -1}, -1, None),
    ({"max_steps": 12}, -1, 12), ({"max_steps": 12, "max_epochs": None}, -1, 12), ({"max_time": {"hours": 1}}, -1, None),
    ({"max_epochs": 3, "max_steps": -1}, 3, None), ({"max_epochs": 0}, 0, None),
])
def test_lightnings_spellings_of_no_limit(flags, epochs, steps):
    cfg = resolve_trainer_config(**flags)
    assert (cfg.max_epochs, cfg.max_steps) == (epochs, steps)


@pytest.mark.parametrize("flags", [{"max_epochs": -2}, {"max_steps": -2}, {"max_steps": -3}])
def test_other_limits_are_refused_naming_no_limit(flags):
    with pytest.raises(ValueError, match="-1 or None: no limit"):
        resolve_trainer_config(**flags)


# -- the training loader's order on several ranks -------------------------------------------------------------------
def test_an_unshuffled_training_loader_on_several_ranks_is_said():
    with pytest.warns(UserWarning, match="Lightning would shuffle it"):
        warn_unshuffled(_loader(), data_parallel_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_unshuffled(_loader(), data_parallel_size=1)
        warn_unshuffled(DataLoader(_loader().dataset, batch_size=2, shuffle=True), data_parallel_size=2)


@pytest.mark.timeout(60)
def test_use_distributed_sampler_false_trains_on_the_loader_as_given(tmp_path):
    loader = _loader()
    trainer = _trainer(tmp_path, use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(Probe(), loader)
    assert trainer._fit.train_loader is loader and trainer.global_step == 4


# -- training mode: the submodules' own modes are kept -----------------------------------------------------------
class FrozenNorm(Probe):
    """Probe with a BatchNorm the user froze (``eval()``): it must stay in eval mode, its statistics unchanged,
    through training, validation and test; ``modes`` notes (stage, layer.training, norm.training) per step."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(2).eval()
        self.modes: set[tuple] = set()

    def training_step(self, batch, batch_idx):
        self.modes.add(("train", self.layer.training, self.norm.training))
        return self.layer(self.norm(batch[0])).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.modes.add(("val", self.layer.training, self.norm.training))
        self.log("val_loss", self.layer(self.norm(batch[0])).pow(2).mean())

    def test_step(self, batch, batch_idx):
        self.modes.add(("test", self.layer.training, self.norm.training))


@pytest.mark.timeout(60)
def test_a_submodule_in_eval_mode_stays_so_through_fit_validation_and_test(tmp_path):
    model = FrozenNorm()
    trainer = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=1, log_every_n_steps=1)
    # Lightning's warning names the count; trainscale's the modules too
    with pytest.warns(PossibleUserWarning, match=r"Found 1 module\(s\) in eval mode at the start of training\. This "
                                                 r"may lead to unexpected behavior.*\(norm: they train so"):
        trainer.fit(model, _loader(), _loader(4))
    trainer.test(model, _loader(4), verbose=False)
    assert model.modes == {("train", True, False), ("val", False, False), ("test", False, False)}
    assert model.training and not model.norm.training  # as they came in
    assert torch.equal(model.norm.running_mean, torch.zeros(2)) and int(model.norm.num_batches_tracked) == 0
    whole = FrozenNorm().eval()
    with pytest.warns(PossibleUserWarning, match=r"Found 3 module\(s\) in eval mode.*\(FrozenNorm, layer, norm: call "
                                                 r"model.train\(\)"):
        _trainer(tmp_path / "e", max_epochs=1, num_sanity_val_steps=0).fit(whole, _loader())
    assert ("train", False, False) in whole.modes  # trained in the mode it came in, as Lightning


# -- setup and teardown ---------------------------------------------------------------------------------------------
class NotedData(trainscale.DataModule):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def setup(self, stage):
        self.calls.append(("data.setup", stage))

    def train_dataloader(self):
        return _loader()

    def test_dataloader(self):
        return _loader(4)

    def teardown(self, stage):
        self.calls.append(("data.teardown", stage))


class NotedModule(Probe):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def test_step(self, batch, batch_idx):
        self.log("t", 1.0)

    def setup(self, stage):
        self.calls.append(("module.setup", stage, self.trainer.max_epochs))  # self.trainer is there

    def teardown(self, stage):
        self.calls.append(("module.teardown", stage))


class NotedCallback(Callback):
    def __init__(self, calls):
        self.calls = calls

    def setup(self, trainer, pl_module, stage):
        self.calls.append(("callback.setup", stage))

    def on_fit_end(self, trainer, module):
        self.calls.append(("callback.on_fit_end", "fit"))

    def teardown(self, trainer, module, stage):
        self.calls.append(("callback.teardown", stage))


@pytest.mark.timeout(60)
def test_setup_and_teardown_are_called_by_keyword_in_lightnings_order(tmp_path):
    calls = []
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=[NotedCallback(calls)])
    model, data = NotedModule(calls), NotedData(calls)
    data.setup = lambda *args, **kwargs: calls.append(("data.setup", args, kwargs))  # how it is called
    trainer.fit(model, datamodule=data)
    trainer.test(model, datamodule=data, verbose=False)
    assert calls == [("data.setup", (), {"stage": "fit"}), ("callback.setup", "fit"), ("module.setup", "fit", 1),
                     ("callback.on_fit_end", "fit"),
                     ("data.teardown", "fit"), ("callback.teardown", "fit"), ("module.teardown", "fit"),
                     ("data.setup", (), {"stage": "test"}), ("callback.setup", "test"), ("module.setup", "test", 1),
                     ("data.teardown", "test"), ("callback.teardown", "test"), ("module.teardown", "test")]


@pytest.mark.timeout(60)
def test_the_modules_data_hooks_run_when_the_loaders_are_passed_too(tmp_path):
    """Lightning calls a module's prepare_data() and setup(stage) in every stage, wherever the loaders come from: a
    module that builds a layer in setup() trains with loaders passed to fit() and is evaluated with validate()."""

    class BuiltInSetup(trainscale.TrainingModule):
        def __init__(self):
            super().__init__()
            self.calls = []

        def prepare_data(self):
            self.calls.append("prepare_data")

        def setup(self, stage):
            self.calls.append(f"setup:{stage}")
            if not hasattr(self, "layer"):
                self.layer = nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("v", self.layer(batch[0]).pow(2).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model, calls = BuiltInSetup(), []
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=[NotedCallback(calls)])
    trainer.fit(model, _loader())
    assert trainer.global_step == 4 and model.calls == ["prepare_data", "setup:fit"]
    assert calls[0] == ("callback.setup", "fit")
    trainer.validate(model, _loader(4), verbose=False)
    assert model.calls == ["prepare_data", "setup:fit", "prepare_data", "setup:validate"]


# -- the sanity check of a resumed fit ------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_resumed_fit_runs_the_sanity_check_after_a_completed_epoch_only(tmp_path):
    first = _trainer(tmp_path / "a", max_epochs=1, checkpoint_every_n_steps=2)
    first.fit(Probe(), _loader(), _loader(4))
    ckpts = {p.name: p for p in (tmp_path / "a").rglob("epoch=*.ckpt")}
    epoch_end, mid_epoch = ckpts["epoch=0-step=4.ckpt"], ckpts["epoch=0-step=2.ckpt"]

    def sanity_checks(ckpt, **flags):
        watch = StepWatch()
        _trainer(tmp_path / "r", max_epochs=2, callbacks=[watch], **flags).fit(Probe(), _loader(), _loader(4),
                                                                               ckpt_path=ckpt)
        return watch.sanity_checks

    assert sanity_checks(epoch_end) == 1  # Lightning 2.6: its loops are not restarting after a finished epoch
    assert sanity_checks(mid_epoch) == 0  # restarting mid-epoch: no sanity check
    assert sanity_checks(epoch_end, max_steps=6) == 0  # iteration-based training always restarts


# -- Lightning's spellings --------------------------------------------------------------------------------------------
def test_callback_is_exported_at_the_top_level():
    assert trainscale.Callback is Callback


def test_a_module_is_attached_to_a_trainer_by_assignment_as_in_lightning(tmp_path):
    model, trainer = Probe(), _trainer(tmp_path)
    model.trainer = trainer
    assert model.trainer is trainer and model.current_epoch == 0 and model.global_rank == 0
    model.trainer = None
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        model.trainer


@pytest.mark.timeout(60)
def test_max_steps_0_trains_nothing_and_predict_can_return_nothing(tmp_path):
    class Model(Probe):
        def forward(self, x):
            return self.layer(x)

        def predict_step(self, batch, batch_idx):  # the default would call forward on the (x, y) pair
            return self(batch[0])

    model = Model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(tmp_path, max_steps=0, num_sanity_val_steps=0)
    trainer.fit(model, _loader())
    assert trainer.global_step == 0 and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert trainer.predict(model, _loader(4), return_predictions=False) is None
    predicted = trainer.predict(model, _loader(4))  # Lightning's list of per-batch outputs
    assert [p.shape for p in predicted] == [(2, 1), (2, 1)]


@pytest.mark.parametrize("name", ["limit_train_batches", "limit_val_batches", "limit_test_batches",
                                  "limit_predict_batches", "val_check_interval", "overfit_batches"])
def test_a_limit_of_exactly_1_or_1_0_is_said_as_lightning_says_it(tmp_path, caplog, capsys, name):
    import logging

    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, **{name: 1})
        _trainer(tmp_path, **{name: 1.0})
        _trainer(tmp_path)  # the defaults: nothing said
    said = [r.getMessage() for r in caplog.records if "was configured so" in r.getMessage()]
    assert len(said) == 2 and said[0].startswith(f"`Trainer({name}=1)` was configured so ")
    assert said[1].startswith(f"`Trainer({name}=1.0)` was configured so ")
    assert "100% of the batches" in said[1] or "at the end of the training epoch" in said[1]
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="trainscale.loop.config"):  # INFO not shown, whatever the root's
        _trainer(tmp_path, **{name: 1})  # level: printed
    assert f"`Trainer({name}=1)` was configured so " in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_trainer_flag_attributes_interrupted_freeze_and_the_callback_hooks_keywords(tmp_path):
    import inspect

    from trainscale.callbacks import ModelCheckpoint

    fast = _trainer(tmp_path, fast_dev_run=2)
    assert fast.fast_dev_run == 2 and fast.limit_val_batches == 2  # fast_dev_run sets the limits, as Lightning's
    trainer = _trainer(tmp_path, limit_val_batches=0.5, limit_test_batches=3)
    assert (trainer.fast_dev_run, trainer.limit_val_batches, trainer.limit_test_batches) == (False, 0.5, 3)
    assert trainer.limit_train_batches is None and trainer.limit_predict_batches is None and not trainer.interrupted

    class Raising(Probe):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Raising(), _loader())
    assert trainer.interrupted
    model = Probe().freeze()
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.unfreeze() is model and model.training and all(p.requires_grad for p in model.parameters())
    for hook in ("setup", "teardown", "on_fit_start", "on_train_batch_end", "on_exception"):  # called by keyword too
        assert list(inspect.signature(getattr(Callback, hook)).parameters)[1:3] == ["trainer", "pl_module"]
    two = _trainer(tmp_path / "two", max_epochs=1, num_sanity_val_steps=0,
                   callbacks=[ModelCheckpoint(dirpath=tmp_path / "a"), ModelCheckpoint(dirpath=tmp_path / "b",
                                                                                        monitor="val_loss")])
    two.fit(Probe(), _loader(), _loader(4))
    with pytest.warns(UserWarning, match="multiple `ModelCheckpoint` callbacks. It will use the best checkpoint path "
                                         "from first checkpoint callback"):
        two.validate(Probe(), _loader(4), ckpt_path="best", verbose=False)


def test_trainer_logger_is_the_first_logger_or_none(tmp_path):
    trainer = _trainer(tmp_path)
    assert trainer.logger is trainer.loggers[0] and type(trainer.logger).__name__ == "CSVLogger"
    assert _trainer(tmp_path, logger=False).logger is None


def test_lightnings_class_names_are_the_same_classes_so_import_lightning_as_l_ports_by_its_import():
    from trainscale import LightningDataModule, LightningModule
    from trainscale.lightning.data_sources import DataModule

    assert LightningModule is TrainingModule and trainscale.LightningModule is TrainingModule
    assert LightningDataModule is DataModule and trainscale.LightningDataModule is DataModule

    class Model(trainscale.LightningModule):  # `import lightning as L` ... `class Model(L.LightningModule)`
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 1)

    assert isinstance(Model(), TrainingModule)


@pytest.mark.timeout(60)
def test_one_callback_object_and_the_trainer_attributes_callbacks_read(tmp_path):
    watch = StepWatch()
    trainer = _trainer(tmp_path, callbacks=watch, max_steps=3, num_sanity_val_steps=1)
    assert watch in trainer.callbacks
    # max_epochs: None until the fit resolves it, as Lightning's
    assert (trainer.max_epochs, trainer.max_steps, trainer.num_sanity_val_steps) == (None, 3, 1)
    assert not trainer.state.finished and trainer.num_val_batches == []
    model = Probe()
    model.configure_optimizers = lambda: {"optimizer": (opt := torch.optim.SGD(model.parameters(), lr=0.1)),
                                          "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1),
                                                           "interval": "step"}}
    trainer.fit(model, _loader(), _loader(6))
    assert trainer.state.finished and trainer.num_val_batches == [3] and len(watch.seen) == 3
    (config,) = trainer.lr_scheduler_configs
    assert isinstance(config.scheduler, torch.optim.lr_scheduler.StepLR) and config.interval == "step"
    assert _trainer(tmp_path, max_epochs=None).max_steps == -1


class SetupReadsTrainer(Probe):
    def setup(self, stage):
        self.stage_seen = (stage, self.trainer.max_epochs)

    def train_dataloader(self):
        return _loader()


@pytest.mark.timeout(60)
def test_self_trainer_is_there_in_the_modules_setup_hook(tmp_path):
    model = SetupReadsTrainer()
    _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0).fit(model)
    assert model.stage_seen == ("fit", 1)


@pytest.mark.timeout(60)
def test_no_validation_by_limit_val_batches_0_or_a_hook_set_to_none(tmp_path):
    watch = StepWatch()
    trainer = _trainer(tmp_path / "a", max_epochs=1, limit_val_batches=0, callbacks=[watch])
    trainer.fit(Probe(), _loader(), _loader(4))
    assert "val_loss" not in trainer.callback_metrics and watch.sanity_checks == 0
    with pytest.raises(ValueError, match="0 turns validation off"):
        resolve_trainer_config(limit_val_batches=-1)

    model = Probe()
    model.validation_step = None  # Lightning's way to switch a step off
    with pytest.warns(UserWarning, match=r"You passed in a `val_dataloader` but have no `validation_step`\. Skipping "
                                         "val loop.*defines no validation_step"):  # Lightning's words first
        _trainer(tmp_path / "b", max_epochs=1).fit(model, _loader(), _loader(4))
    with_hook = SetupReadsTrainer()
    with_hook.val_dataloader = None
    trainer = _trainer(tmp_path / "c", max_epochs=1)
    trainer.fit(with_hook)
    assert "val_loss" not in trainer.callback_metrics


class Reduced(Probe):
    def training_step(self, batch, batch_idx):
        for name, fx in (("mx", torch.max), ("mn", min), ("avg", "avg"), ("sm", "SUM"), ("mean", torch.mean)):
            self.log(name, float(batch_idx), on_step=False, on_epoch=True, reduce_fx=fx)
        return self.layer(batch[0]).pow(2).mean()


@pytest.mark.timeout(60)
def test_reduce_fx_takes_lightnings_spellings(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(Reduced(), _loader())  # batch indices 0..3
    got = {k: trainer.callback_metrics[k] for k in ("mx", "mn", "avg", "sm", "mean")}
    assert got == {"mx": 3.0, "mn": 0.0, "avg": 1.5, "sm": 6.0, "mean": 1.5}
    from trainscale.lightning.metrics import reduction_name
    with pytest.raises(ValueError, match=r"^Only `self.log\(..., reduce_fx=\{min,max,mean,sum\}\)` are supported"):
        reduction_name(torch.median)  # Lightning's words first


@pytest.mark.parametrize("value, what", [(None, "`NoneType` values"), ("a", "`str` values"),
                                         ([1, 2, 3], "`list` values"), ((1, 2), "`tuple` values"),
                                         ({"a": 1}, "`dict` values"), ({"a": {"b": 1}}, "nested dictionaries")])
def test_a_value_log_cannot_record_is_refused_with_lightnings_message(value, what):
    from trainscale.lightning.metrics import MetricCollector
    from trainscale.runtime.runtime import Runtime

    collector = MetricCollector(Runtime(accelerator="cpu"), "train")
    with pytest.raises(ValueError, match=re.escape(f"`self.log(foo, {value})` was called, but {what} cannot be "
                                                   "logged") + ".*self.log_dict"):
        collector.log("foo", value)
    with pytest.raises(ValueError, match=r"`self.log\(foo, tensor\(\[1\., 2\.\]\)\)` was called, but the tensor "
                                         r"must have a single element .*shape \(2,\).*value.mean\(\)"):
        collector.log("foo", torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="`foo/dataloader_idx_0` but it should not contain.*log it as 'foo'"):
        collector.log("foo/dataloader_idx_0", 1.0)
    for fine in (1, 2.5, True, torch.tensor(3.0), torch.tensor([4.0]), np.float32(5.0), np.int64(6)):
        collector.log("ok", fine)
    assert float(collector.step_values["ok"][0]) == 6.0


def test_seed_everything_without_a_seed_seeds_0_with_a_warning():
    from trainscale.checkpointing.rng import rng_state, set_rng_state

    state = rng_state()  # Python's, numpy's and torch's, restored after
    try:
        with pytest.warns(UserWarning, match="seed set to 0"):
            assert trainscale.seed_everything() == 0
        first = torch.rand(3)
        assert trainscale.seed_everything(0) == 0 and torch.equal(torch.rand(3), first)
    finally:
        set_rng_state(state)


class Shuffled(Probe):
    """Records the first input of each training batch and a dropout mask drawn in each step."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append((float(batch[0][0, 0]), torch.rand(()).item()))
        return super().training_step(batch, batch_idx)


def _shuffled_fit(tmp_path, **flags):
    model = Shuffled()
    loader = DataLoader(TensorDataset(torch.arange(16.0).reshape(8, 2), torch.zeros(8)), batch_size=2, shuffle=True)
    _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, **flags).fit(model, loader)
    return model.seen


@pytest.mark.timeout(60)
def test_the_seed_of_seed_everything_is_the_seed_of_each_later_fit(tmp_path):
    """As Lightning's: seed_everything(n) in a script decides the fit's shuffle and random draws, so two scripts
    with different seeds train differently; a Trainer(seed=...) given explicitly wins; without either, seed 0."""
    from trainscale.checkpointing.rng import rng_state, set_rng_state

    state = rng_state()
    try:
        unseeded = _shuffled_fit(tmp_path / "none")
        trainscale.seed_everything(1)
        one = _shuffled_fit(tmp_path / "one")
        assert os.environ["PL_GLOBAL_SEED"] == "1" and os.environ["PL_SEED_WORKERS"] == "0"
        trainscale.seed_everything(2)
        two = _shuffled_fit(tmp_path / "two")
        assert one != two and one != unseeded
        assert _shuffled_fit(tmp_path / "explicit", seed=1) == one  # Trainer(seed=1) while seed_everything(2) holds
        trainscale.seed_everything(1)
        assert _shuffled_fit(tmp_path / "again") == one
        del os.environ["PL_GLOBAL_SEED"]
        assert _shuffled_fit(tmp_path / "default") == unseeded == _shuffled_fit(tmp_path / "zero", seed=0)
    finally:
        set_rng_state(state)


def _worker_draws(_):
    """A data set item drawn in a DataLoader worker from numpy's and Python's generators."""
    import random as python_random

    import numpy as np

    return torch.tensor([float(np.random.randint(1 << 30)), float(python_random.randrange(1 << 30))])


class _Draws(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return _worker_draws(i), torch.zeros(())


@pytest.mark.timeout(60)
def test_seed_everything_with_workers_seeds_numpy_and_python_in_each_worker(tmp_path):
    """PyTorch seeds only torch in a worker; numpy's and Python's streams repeat in every worker unless the workers are
    seeded (Lightning's seed_everything(workers=True)). Two workers, one batch each: their draws differ, and a second
    fit with the same seed repeats them."""
    from trainscale.checkpointing.rng import rng_state, set_rng_state

    class Recording(Probe):
        def __init__(self):
            super().__init__()
            self.draws = []

        def training_step(self, batch, batch_idx):
            self.draws.append(batch[0].tolist())
            return self.layer(batch[0] * 0).pow(2).mean()

    def fit():
        model = Recording()
        loader = DataLoader(_Draws(), batch_size=4, num_workers=2, multiprocessing_context="fork")
        _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0).fit(model, loader)
        return model.draws

    state = rng_state()
    try:
        trainscale.seed_everything(3, workers=True)
        first = fit()
        assert first[0] != first[1]  # worker 0's batch and worker 1's
        trainscale.seed_everything(3, workers=True)
        assert fit() == first
    finally:
        set_rng_state(state)


class Reloaded(Probe):
    """Its ``train_dataloader()`` gives a new loader on each call, whose inputs are all the call's number."""

    def __init__(self):
        super().__init__()
        self.calls = {"train": 0, "val": 0}
        self.first_inputs: list[float] = []

    def train_dataloader(self):
        self.calls["train"] += 1
        return DataLoader(TensorDataset(torch.full((4, 2), float(self.calls["train"])), torch.zeros(4)), batch_size=2)

    def val_dataloader(self):
        self.calls["val"] += 1
        return _loader(4)

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.first_inputs.append(float(batch[0][0, 0]))
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("every", "calls", "inputs"), [(0, 1, [1.0, 1.0, 1.0]), (1, 3, [1.0, 2.0, 3.0]),
                                                        (2, 2, [1.0, 1.0, 2.0])])
def test_reload_dataloaders_every_n_epochs_asks_the_hooks_again(tmp_path, every, calls, inputs):
    model = Reloaded()
    _trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0, reload_dataloaders_every_n_epochs=every).fit(model)
    assert model.calls == {"train": calls, "val": calls} and model.first_inputs == inputs


# -- what validate/test return ----------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_validate_and_test_return_one_dict_of_floats_per_loader(tmp_path):
    """Lightning: ``trainer.validate``/``test`` return a list with one dict per evaluation loader, its values
    Python floats (``res[0]["val_loss"]``)."""
    model = Probe()
    model.test_step = model.validation_step
    trainer = _trainer(tmp_path)
    validated = trainer.validate(model, _loader(4), verbose=False)
    tested = trainer.test(model, _loader(4), verbose=False)
    assert isinstance(validated, list) and len(validated) == 1 and isinstance(tested, list) and len(tested) == 1
    expected = float(model.layer(_loader(4).dataset.tensors[0]).pow(2).mean())
    assert validated[0]["val_loss"] == pytest.approx(expected) and isinstance(validated[0]["val_loss"], float)
    assert tested[0]["val_loss"] == validated[0]["val_loss"]  # the step logs "val_loss" by that name


# -- torchmetrics -----------------------------------------------------------------------------------------------------
class WithMetrics(Probe):
    """Logs a torchmetrics ``MeanMetric`` of the inputs' first column (plus the epoch, so each epoch's mean differs)
    on_step and on_epoch in training, and one in validation (Lightning's default there: on_epoch)."""

    def __init__(self):
        import torchmetrics

        super().__init__()
        self.train_mean = torchmetrics.MeanMetric()
        self.val_mean = torchmetrics.MeanMetric()
        self.computed_in_hook: list[float] = []

    def training_step(self, batch, batch_idx):
        self.train_mean(batch[0][:, 0] + self.current_epoch)  # forward: the batch's mean, and the epoch's update
        self.log("m", self.train_mean, on_step=True, on_epoch=True)
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.val_mean.update(batch[0][:, 0])
        self.log("vm", self.val_mean)

    def on_train_epoch_end(self):
        self.computed_in_hook.append(float(self.train_mean.compute()))  # not yet reset, as in Lightning


class MetricWatch(Callback):
    def __init__(self):
        self.steps: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.append(float(trainer.callback_metrics["m_step"]))


@pytest.mark.timeout(60)
def test_a_logged_torchmetrics_metric_is_its_batch_value_per_step_computed_per_epoch_and_reset(tmp_path):
    """Lightning's rules for ``self.log(name, metric)``: the step value is the last forward's batch value, the epoch
    value ``compute()`` over every sample of the epoch (10 samples in batches of 4, 4, 2: not the mean of the three
    batch means), then the metric is reset (epoch 1's value holds epoch 1's samples only)."""
    pytest.importorskip("torchmetrics")
    loader = _loader(n=10, batch_size=4)
    first = loader.dataset.tensors[0][:, 0]
    watch = MetricWatch()
    model = WithMetrics()
    trainer = _trainer(tmp_path, max_epochs=2, callbacks=[watch], num_sanity_val_steps=0)
    trainer.fit(model, loader, _loader(6, batch_size=4))
    batch_means = [float(first[i:i + 4].mean()) for i in (0, 4, 8)]
    assert watch.steps == pytest.approx(batch_means + [m + 1 for m in batch_means])
    epoch_means = [float(first.mean()) + e for e in (0, 1)]
    assert float(first.mean()) != pytest.approx(sum(batch_means) / 3)  # the test tells the two apart
    assert [r["m_epoch"] for r in trainer.history] == pytest.approx(epoch_means)
    assert model.computed_in_hook == pytest.approx(epoch_means)
    assert trainer.callback_metrics["m"] == pytest.approx(epoch_means[1])
    val_first = _loader(6).dataset.tensors[0][:, 0]
    assert trainer.callback_metrics["vm"] == pytest.approx(float(val_first.mean()))
    assert model.train_mean._update_count == 0 and model.val_mean._update_count == 0  # reset after each epoch
    (validated,) = trainer.validate(model, _loader(6, batch_size=4), verbose=False)
    assert validated["vm"] == pytest.approx(float(val_first.mean()))  # not doubled: reset after the fit's validation


class WithCollection(Probe):
    """Logs a torchmetrics ``MetricCollection`` of two metrics in one compute group (mean and sum share one state) with
    a prefix, noting after each ``log_dict`` whether the collection's metrics hold copies of the group's state."""

    def __init__(self):
        import torchmetrics

        super().__init__()
        self.collection = torchmetrics.MetricCollection(
            {"mean": torchmetrics.MeanMetric(), "also_mean": torchmetrics.MeanMetric()}, prefix="train_",
            compute_groups=[["mean", "also_mean"]])
        self.copied: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.collection.update(batch[0][:, 0])
        self.log_dict(self.collection, on_step=False, on_epoch=True)
        self.copied.append(self.collection._state_is_copy)
        return self.layer(batch[0]).pow(2).mean()


@pytest.mark.timeout(60)
def test_log_dict_of_a_metric_collection_logs_prefixed_names_and_keeps_one_shared_state(tmp_path):
    """Lightning's ``log_dict`` reads a ``MetricCollection`` with ``items(keep_base=False, copy_state=False)``: the
    prefixed names, and the metrics of a compute group keep referring to one state (a copy per metric would hold the
    group's memory once per member)."""
    pytest.importorskip("torchmetrics")
    loader = _loader(n=10, batch_size=4)
    model = WithCollection()
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, loader)
    assert model.copied == [False, False, False]
    expected = float(loader.dataset.tensors[0][:, 0].mean())
    assert trainer.callback_metrics["train_mean"] == pytest.approx(expected)
    assert trainer.callback_metrics["train_also_mean"] == pytest.approx(expected)


def test_two_metric_objects_under_one_name_are_refused():
    torchmetrics = pytest.importorskip("torchmetrics")
    from trainscale.lightning.metrics import MetricCollector
    from trainscale.runtime.runtime import Runtime

    collector = MetricCollector(Runtime(accelerator="cpu"), "validation")
    one, two = torchmetrics.MeanMetric(), torchmetrics.MeanMetric()
    one.update(1.0)
    collector.log("x", one)
    collector.log("x", one)  # the same object again: fine
    with pytest.raises(ValueError, match="two different Metric objects"):
        collector.log("x", two)
    assert collector.take_epoch_values() == {"x": 1.0}


def test_forwards_whose_results_are_discarded_leave_no_sample_in_a_metric():
    """fsdp's extra evaluation forwards on a rank with fewer batches (``evaluation.evaluate``) run inside
    ``metric_states_kept``: a Metric they update is as before them."""
    torchmetrics = pytest.importorskip("torchmetrics")
    from trainscale.lightning.metrics import metric_states_kept

    model = WithMetrics()
    model.val_mean.update(torch.tensor([1.0, 3.0]))
    with metric_states_kept(model):
        model.val_mean.update(torch.tensor([100.0]))
        assert float(model.val_mean.compute()) == pytest.approx(104 / 3)
    assert float(model.val_mean.compute()) == 2.0 and model.val_mean._update_count == 1
    assert isinstance(model.val_mean, torchmetrics.MeanMetric)


class Decaying(Probe):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]  # per epoch


@pytest.mark.timeout(60)
@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_learning_rate_monitor_lrs_holds_one_rate_per_logged_step_or_per_epoch(tmp_path, interval):
    """Lightning's ``LearningRateMonitor.lrs``: each name's learning rates, one per logged step ("step") or one at
    each epoch's start ("epoch"); 2 epochs of 4 steps, a rate halved after each epoch."""
    from trainscale.callbacks import LearningRateMonitor

    monitor = LearningRateMonitor(logging_interval=interval)
    trainer = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, log_every_n_steps=2, callbacks=[monitor])
    trainer.fit(Decaying(), _loader())
    expected = [0.1, 0.1, 0.05, 0.05] if interval == "step" else [0.1, 0.05]
    assert list(monitor.lrs) == ["lr-SGD"] and monitor.lrs["lr-SGD"] == pytest.approx(expected)


class TwoOptimizers(Probe):
    """Manual optimization with two optimizers, each stepping on every batch (a GAN's shape): 2 steps per batch."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.other = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        for opt, layer in zip(self.optimizers(), (self.layer, self.other)):
            opt.zero_grad()
            self.manual_backward(layer(batch[0]).pow(2).mean())
            opt.step()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)]


@pytest.mark.timeout(60)
def test_under_manual_optimization_records_are_written_every_n_batches_as_lightnings(tmp_path):
    from trainscale.callbacks import LearningRateMonitor

    monitor = LearningRateMonitor(logging_interval="step")
    trainer = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, log_every_n_steps=2, callbacks=[monitor])
    trainer.fit(TwoOptimizers(), _loader(14))  # 7 batches per epoch, 14 in all, 2 optimizer steps each
    assert trainer.global_step == 28
    assert [len(rates) for rates in monitor.lrs.values()] == [7, 7]  # batches 2, 4, ..., 14: every 2nd batch
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == [4, 8, 12, 16, 20, 24, 28]


@pytest.mark.timeout(60)
def test_a_manual_training_step_that_returns_nothing_records_no_training_loss(tmp_path):
    """Lightning records no loss for such a step; a zero in the records would read as a perfect fit."""
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, log_every_n_steps=2)
    trainer.fit(TwoOptimizers(), _loader(8))
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records].count("step") == 2 and records[-1]["kind"] == "epoch"
    assert not any("train_loss" in r for r in records), records
    assert "train_loss" not in trainer.callback_metrics
    summary = json.loads((trainer.run_dir / "summary.json").read_text())
    assert summary["train_loss"] is None


@pytest.mark.timeout(60)
def test_a_manual_training_step_that_returns_its_loss_records_the_epochs_mean(tmp_path):
    class Returning(TwoOptimizers):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)
            return torch.tensor(float(batch_idx + 1))  # 1, 2, 3, 4 over the 4 batches of equal size

    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, log_every_n_steps=2)
    trainer.fit(Returning(), _loader(8))
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "epoch" and records[-1]["train_loss"] == pytest.approx(2.5)


# -- loop limits: a minimum without a maximum, and zero ---------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "epochs"), [({"min_epochs": 3}, 3), ({"min_steps": 10}, 3)])
def test_a_minimum_without_max_epochs_is_trained_before_a_callback_may_stop(tmp_path, flags, epochs):
    """A metric that never improves makes EarlyStopping ask to stop after the first epoch; the fit goes on until the
    minimum is met (3 epochs of 4 steps, or the epoch that holds step 10), as Lightning's, rather than ending at
    trainscale's one-epoch default."""
    stop = EarlyStopping("val_loss", patience=0, min_delta=1e9)
    with pytest.warns(PossibleUserWarning, match=r"^`max_epochs` was not set. Setting it to 1000 epochs. To train "
                                                  r"without an epoch limit, set `max_epochs=-1`."):  # Lightning's words
        trainer = _trainer(tmp_path, num_sanity_val_steps=0, callbacks=[stop], **flags)
    trainer.fit(Probe(), _loader(), _loader(4))
    assert trainer.max_epochs == 1000 and trainer.current_epoch == epochs and trainer.should_stop


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "batches"), [({}, 4), ({"limit_train_batches": 3}, 3), ({"overfit_batches": 2}, 2),
                                                ({"limit_train_batches": 0.5}, 2)])
def test_num_training_batches_is_the_epochs_batches_after_the_limits(tmp_path, flags, batches):
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, **flags)
    assert trainer.num_training_batches == float("inf")  # before fit, as Lightning's
    trainer.fit(Probe(), _loader())  # 4 batches
    assert trainer.num_training_batches == batches and trainer.global_step == batches


@pytest.mark.timeout(60)
def test_max_epochs_0_trains_nothing_and_min_epochs_0_is_no_minimum(tmp_path):
    model = Probe()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(tmp_path / "zero", max_epochs=0, num_sanity_val_steps=0)
    trainer.fit(model, _loader())
    assert trainer.global_step == 0 and model.epochs_seen == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    trainer = _trainer(tmp_path / "min0", max_epochs=2, min_epochs=0, min_steps=0, num_sanity_val_steps=0)
    trainer.fit(Probe(), _loader())
    assert trainer.current_epoch == 2


# -- learning-rate names and LearningRateMonitor ----------------------------------------------------------------------
class TwoGroups(Probe):
    """SGD with two param groups (the weight, the bias), one of them maybe named; a per-epoch StepLR, maybe named."""

    def __init__(self, group_name=None, scheduler_name=None):
        super().__init__()
        self.group_name, self.scheduler_name = group_name, scheduler_name

    def configure_optimizers(self):
        bias = {"params": [self.layer.bias], "lr": 0.01, "weight_decay": 0.5}
        if self.group_name:
            bias["name"] = self.group_name
        opt = torch.optim.SGD([{"params": [self.layer.weight]}, bias], lr=0.1, momentum=0.9)
        sched = {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}
        if self.scheduler_name:
            sched["name"] = self.scheduler_name
        return [opt], [sched]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("group_name", "scheduler_name", "names"), [
    (None, None, ["lr-SGD/pg1", "lr-SGD/pg2"]),  # counted from 1 once there are several groups
    ("head", None, ["lr-SGD/pg1", "lr-SGD/head"]),  # a group's own name
    (None, "decay", ["decay/pg1", "decay/pg2"]),  # the scheduler's name replaces lr-<class>
])
def test_param_groups_have_lightnings_learning_rate_names_in_records_and_the_monitor(tmp_path, group_name,
                                                                                     scheduler_name, names):
    from trainscale.callbacks import LearningRateMonitor

    monitor = LearningRateMonitor()
    trainer = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, callbacks=[monitor])
    trainer.fit(TwoGroups(group_name, scheduler_name), _loader())
    assert list(monitor.lrs) == names
    # an epoch-interval scheduler with logging_interval=None: one rate at each epoch's start
    assert monitor.lrs[names[0]] == pytest.approx([0.1, 0.05]) and monitor.lrs[names[1]] == pytest.approx([0.01, 0.005])
    assert trainer.history[0][names[0]] == pytest.approx(0.1) and trainer.history[0][names[1]] == pytest.approx(0.01)


@pytest.mark.timeout(60)
def test_learning_rate_monitor_momentum_weight_decay_and_prefix(tmp_path):
    from trainscale.callbacks import LearningRateMonitor

    monitor = LearningRateMonitor(log_momentum=True, log_weight_decay=True, log_key_prefix="optim/")
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=[monitor])
    trainer.fit(TwoGroups(), _loader())
    assert list(monitor.lrs) == ["optim/lr-SGD/pg1", "optim/lr-SGD/pg2"]
    assert monitor.last_momentum_values == {"optim/lr-SGD/pg1-momentum": 0.9, "optim/lr-SGD/pg2-momentum": 0.9}
    assert monitor.last_weight_decay_values == {"optim/lr-SGD/pg1-weight_decay": 0,
                                                "optim/lr-SGD/pg2-weight_decay": 0.5}
    assert float(trainer.callback_metrics["optim/lr-SGD/pg2-weight_decay"]) == 0.5  # EarlyStopping can read them
    assert trainer.history[0]["optim/lr-SGD/pg1-momentum"] == 0.9  # and the epoch record holds them


def test_learning_rate_monitor_refuses_a_trainer_without_logger_and_warns_of_no_momentum(tmp_path):
    from trainscale.callbacks import LearningRateMonitor

    trainer = _trainer(tmp_path, max_epochs=1, logger=False, callbacks=[LearningRateMonitor()])
    with pytest.raises(ValueError, match="that has no logger"):
        trainer.fit(Probe(), _loader())

    class Plain(Probe):
        def configure_optimizers(self):
            return torch.optim.Adadelta(self.parameters())

    monitor = LearningRateMonitor(log_momentum=True)
    trainer = _trainer(tmp_path / "m", max_epochs=1, num_sanity_val_steps=0, callbacks=[monitor])
    with pytest.warns(RuntimeWarning, match="do not have momentum"):
        trainer.fit(Plain(), _loader())
    assert monitor.last_momentum_values == {"lr-Adadelta-momentum": 0}


def test_unsupported_keys_of_configure_optimizers_dicts_are_ignored_with_a_warning(tmp_path):
    class Extra(Probe):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "colour": "red"}, "size": 3}

    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    with pytest.warns(RuntimeWarning, match="unsupported keys") as seen:
        trainer.fit(Extra(), _loader())
    assert {"'colour'" in str(w.message) or "'size'" in str(w.message) for w in seen
            if w.category is RuntimeWarning} == {True}
    assert len(trainer.lr_scheduler_configs) == 1


@pytest.mark.timeout(60)
def test_a_plateau_scheduler_missing_its_metric_with_strict_false_warns_and_does_not_step(tmp_path):
    class Plateau(Probe):
        def __init__(self, strict):
            super().__init__()
            self.strict = strict

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "absent", "strict": self.strict}}

    trainer = _trainer(tmp_path / "lax", max_epochs=1, num_sanity_val_steps=0)
    with pytest.warns(RuntimeWarning, match="'absent' which is not available but strict is set to False"):
        trainer.fit(Plateau(strict=False), _loader())
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 0  # never stepped
    with pytest.raises(ValueError, match="'absent' which is not available. Available metrics are"):
        _trainer(tmp_path / "strict", max_epochs=1, num_sanity_val_steps=0).fit(Plateau(strict=True), _loader())


def test_a_scheduler_on_an_optimizer_not_returned_is_refused():
    from trainscale.lightning.optimizers import parse_optimization

    returned, other = (torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1) for _ in range(2))
    with pytest.raises(ValueError, match="attached with an optimizer that wasn't returned"):
        parse_optimization([[returned], [torch.optim.lr_scheduler.StepLR(other, step_size=1)]])

# -- save_hyperparameters of one container ----------------------------------------------------------------------------
class FromConfig(TrainingModule):
    def __init__(self, config):
        super().__init__()
        self.save_hyperparameters(config)
        self.layer = nn.Linear(2, 1)


@pytest.mark.parametrize("config", [{"width": 4, "lr": 0.1}, __import__("argparse").Namespace(width=4, lr=0.1)])
def test_save_hyperparameters_of_one_dict_or_namespace_keeps_its_keys(config):
    model = FromConfig(config)
    assert dict(model.hparams) == {"width": 4, "lr": 0.1} and model.hparams.lr == 0.1
    with pytest.raises(ValueError, match="one dict or one argparse.Namespace"):
        FromConfig(3)


def test_hparams_initial_is_a_copy_as_saved_and_the_checkpoint_key_is_lightnings():
    model = FromConfig({"width": 4, "nested": [1, 2]})
    model.hparams.width = 8
    model.hparams.nested.append(3)
    assert model.hparams_initial == {"width": 4, "nested": [1, 2]}  # as saved, not as changed since
    model.hparams_initial["width"] = 0
    assert model.hparams_initial.width == 4  # a copy each time: read-only in effect
    assert Probe().hparams_initial == {}
    assert TrainingModule.CHECKPOINT_HYPER_PARAMS_KEY == "hyper_parameters"
    assert trainscale.DataModule.CHECKPOINT_HYPER_PARAMS_KEY == "datamodule_hyper_parameters"  # Lightning's two keys
    from trainscale.checkpointing.checkpointer import hparams_entries

    assert hparams_entries(model)[TrainingModule.CHECKPOINT_HYPER_PARAMS_KEY]["width"] == 8


# -- Timer -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("duration", "seconds"), [
    (None, None), ("00:01:00:05", 3605.0), ({"minutes": 2}, 120.0), (__import__("datetime").timedelta(seconds=9), 9.0)])
def test_timer_reads_lightnings_duration_forms(duration, seconds):
    from trainscale.callbacks import Timer

    assert Timer(duration).time_remaining() == seconds  # nothing has run yet
    with pytest.raises(ValueError, match="DD:HH:MM:SS"):
        Timer("1:00:00")
    with pytest.raises(ValueError, match="possible values are"):
        Timer(duration, interval="batch")


@pytest.mark.timeout(60)
def test_timer_stops_a_fit_whose_duration_is_spent_and_measures_each_stage(tmp_path):
    from trainscale.callbacks import Timer

    spent = Timer({"seconds": 0})  # spent before the first step: nothing trains, as Lightning's
    trainer = _trainer(tmp_path / "a", max_epochs=3, num_sanity_val_steps=0, callbacks=[spent])
    trainer.fit(Probe(), _loader())
    assert trainer.global_step == 0 and trainer.should_stop

    timer = Timer()  # no duration: measures only
    trainer = _trainer(tmp_path / "b", max_epochs=2, num_sanity_val_steps=0, callbacks=[timer])
    trainer.fit(Probe(), _loader(), _loader(4))
    assert trainer.global_step == 8 and timer.time_remaining() is None
    assert timer.time_elapsed("train") > timer.time_elapsed("validate") > 0 and timer.time_elapsed("test") == 0
    assert timer.end_time("train") >= timer.start_time("train")

    class Tested(Probe):
        def test_step(self, batch, batch_idx):
            self.log("test_loss", self.layer(batch[0]).pow(2).mean())

    trainer.test(Tested(), _loader(4))
    assert timer.time_elapsed("test") > 0
    assert timer.state_dict()["time_elapsed"]["train"] == timer.time_elapsed("train")
    resumed = Timer("00:00:00:30")
    resumed.load_state_dict({"time_elapsed": {"train": 29.5}})  # a checkpoint's: that run's time counts
    assert 0 < resumed.time_remaining() <= 0.5


def test_two_param_groups_of_one_name_are_refused_by_the_monitor_and_numbered_in_the_records():
    from trainscale.scaling.lr_scaling import learning_rates, param_group_names

    layer = nn.Linear(2, 1)
    opt = torch.optim.SGD([{"params": [layer.weight], "name": "x"}, {"params": [layer.bias], "name": "x"}], lr=0.1)
    with pytest.raises(ValueError, match="multiple parameter groups with identical `name`"):
        param_group_names([opt], refuse_duplicates=True)  # LearningRateMonitor's, as Lightning's
    assert learning_rates([opt]) == {"lr-SGD/pg1": 0.1, "lr-SGD/pg2": 0.1}  # torch allows them: the records go on
    opt.param_groups[1]["name"] = "y"
    assert learning_rates([opt]) == {"lr-SGD/x": 0.1, "lr-SGD/y": 0.1}


# -- trainer.logged_metrics and progress_bar_metrics ----------------------------------------------------------------
class Routes(TrainingModule):
    """Logs one value per combination of on_step/on_epoch and logger/prog_bar (Lightning's logging tests' pattern)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("l_s", loss, on_step=True, on_epoch=False, logger=True)
        self.log("l_e", loss, on_step=False, on_epoch=True, logger=True)
        self.log("l_se", loss, on_step=True, on_epoch=True, logger=True)
        self.log("p_s", loss, on_step=True, on_epoch=False, prog_bar=True, logger=False)
        self.log("p_e", loss, on_step=False, on_epoch=True, prog_bar=True, logger=False)
        self.log("p_se", loss, on_step=True, on_epoch=True, prog_bar=True, logger=False)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("v", self.layer(batch[0]).pow(2).mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.timeout(60)
def test_logged_and_progress_bar_metrics_hold_lightnings_names_and_types(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=2, log_every_n_steps=1, num_sanity_val_steps=0)
    trainer.fit(Routes(), _loader(), _loader(4))
    assert set(trainer.logged_metrics) == {"l_s", "l_e", "l_se_step", "l_se_epoch", "v"}  # no bare "l_se"
    assert set(trainer.progress_bar_metrics) == {"p_s", "p_e", "p_se_step", "p_se_epoch", "v"}
    assert all(isinstance(v, torch.Tensor) for v in trainer.logged_metrics.values())
    assert all(isinstance(v, float) for v in trainer.progress_bar_metrics.values())
    assert float(trainer.logged_metrics["l_se_epoch"]) == pytest.approx(float(trainer.callback_metrics["l_se_epoch"]))
    assert "train_loss" not in trainer.logged_metrics  # trainscale's own numbers are not self.log values
    bar = trainscale.callbacks.TQDMProgressBar()
    assert bar.get_metrics(trainer, None) == {**trainer.progress_bar_metrics, "v_num": 0}
    seen = []

    class Bar(trainscale.callbacks.TQDMProgressBar):  # Lightning's pattern: get_metrics read in the bar's own hooks
        def on_train_end(self, trainer, module):
            seen.append(self.get_metrics(self.trainer, module))

    trainer = Trainer(accelerator="cpu", default_root_dir=tmp_path / "b", max_epochs=1, num_sanity_val_steps=0,
                      enable_model_summary=False, callbacks=[Bar(refresh_rate=0)])
    trainer.fit(Routes(), _loader(), _loader(4))
    assert set(seen[0]) == {"p_s", "p_e", "p_se_step", "p_se_epoch", "v", "v_num"}


class BarTotals(Probe):
    """Notes the default bar's ``total_train_batches`` and ``total_val_batches`` at each epoch's start, where a bar
    sets its total."""

    def __init__(self):
        super().__init__()
        self.totals: list[tuple] = []

    def on_train_epoch_start(self):
        bar = self.trainer.progress_bar_callback
        self.totals.append((bar.total_train_batches, bar.total_val_batches))


@pytest.mark.timeout(60)
def test_the_progress_bar_counts_the_batches_of_each_epoch_as_lightnings(tmp_path):
    trainer = Trainer(accelerator="cpu", default_root_dir=tmp_path, max_epochs=4, check_val_every_n_epoch=2,
                      num_sanity_val_steps=0, enable_model_summary=False)
    model = BarTotals()
    trainer.fit(model, _loader(8), _loader(6))  # 4 training and 3 validation batches, validation in epochs 2 and 4
    # the validation loaders are asked for at the first validation (epoch 2's end), so epoch 2 starts without them
    assert model.totals == [(4, 0), (4, 0), (4, 0), (4, 3)]
    steps = Trainer(accelerator="cpu", default_root_dir=tmp_path / "s", max_steps=6, num_sanity_val_steps=0,
                    enable_model_summary=False, enable_progress_bar=True)
    model = BarTotals()
    steps.fit(model, _loader(8))  # max_steps alone: the second epoch's bar counts the 2 steps left
    assert model.totals == [(4, 0), (2, 0)]


# -- ModelCheckpoint: Lightning's arguments, attributes and directory listings --------------------------------------
class Scored(Probe):
    """Probe with a ``score`` per epoch, logged at the epoch end (1.0, 0.5, 2.0, 0.25, ...)."""

    scores = (1.0, 0.5, 2.0, 0.25, 3.0)

    def on_train_epoch_end(self):
        self.log("score", self.scores[self.current_epoch])


@pytest.mark.timeout(60)
def test_model_checkpoint_lists_only_checkpoints_and_keeps_lightnings_records(tmp_path):
    import os

    from trainscale.callbacks import ModelCheckpoint

    ckpts = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=ckpts, filename="{epoch}", monitor="score", save_top_k=2, save_last=True)
    assert cb.best_model_path == "" and cb.last_model_path == "" and cb.best_model_score is None
    trainer = _trainer(tmp_path, max_epochs=4, num_sanity_val_steps=0, callbacks=[cb])
    trainer.fit(Scored(), _loader())
    # no checksum file and no marker file: the digest is inside each checkpoint
    assert sorted(os.listdir(ckpts)) == ["epoch=1.ckpt", "epoch=3.ckpt", "last.ckpt"]
    assert cb.best_model_path == str(ckpts / "epoch=3.ckpt") and float(cb.best_model_score) == 0.25
    assert {k: float(v) for k, v in cb.best_k_models.items()} == {str(ckpts / "epoch=3.ckpt"): 0.25,
                                                                  str(ckpts / "epoch=1.ckpt"): 0.5}
    assert cb.kth_best_model_path == str(ckpts / "epoch=1.ckpt") and float(cb.kth_value) == 0.5
    assert float(cb.current_score) == 0.25 and cb.last_model_path == str(ckpts / "last.ckpt")
    saved = torch.load(ckpts / "epoch=3.ckpt", weights_only=True)["callbacks"][cb.state_key]
    assert saved["best_model_path"] == cb.best_model_path and float(saved["current_score"]) == 0.25
    cb.to_yaml(tmp_path / "best.yaml")
    import yaml
    assert yaml.safe_load((tmp_path / "best.yaml").read_text()) == {str(ckpts / "epoch=3.ckpt"): 0.25,
                                                                     str(ckpts / "epoch=1.ckpt"): 0.5}

    # a second run into the same dirpath: Lightning's versions, none of the first run's files replaced
    before = {name: (ckpts / name).read_bytes() for name in ("epoch=1.ckpt", "epoch=3.ckpt")}
    again = ModelCheckpoint(dirpath=ckpts, filename="{epoch}", monitor="score", save_top_k=2, save_last=True)
    _trainer(tmp_path, max_epochs=4, num_sanity_val_steps=0, callbacks=[again]).fit(Scored(), _loader())
    assert sorted(os.listdir(ckpts)) == ["epoch=1-v1.ckpt", "epoch=1.ckpt", "epoch=3-v1.ckpt", "epoch=3.ckpt",
                                         "last-v1.ckpt", "last.ckpt"]
    assert {name: (ckpts / name).read_bytes() for name in before} == before
    assert os.readlink(ckpts / "last.ckpt") == "epoch=3.ckpt" and os.readlink(ckpts / "last-v1.ckpt") == "epoch=3-v1.ckpt"


@pytest.mark.timeout(60)
def test_a_name_without_a_field_is_replaced_in_place_not_alternated(tmp_path):
    """Lightning's rule: ``filename="model"`` with ``save_top_k=1`` keeps one ``model`` file (the save takes over the
    name of the file it prunes), not ``model`` and ``model-v1`` in turn."""
    import os

    from trainscale.callbacks import ModelCheckpoint

    listings = []

    class ListDir(Callback):
        def on_train_epoch_start(self, trainer, module):
            listings.append(sorted(os.listdir(tmp_path / "c")) if (tmp_path / "c").is_dir() else [])

    cb = ModelCheckpoint(dirpath=tmp_path / "c", filename="model", save_top_k=1)
    trainer = _trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0, callbacks=[ListDir(), cb])
    trainer.fit(Probe(), _loader())
    assert listings == [[], ["model.ckpt"], ["model.ckpt"]] and os.listdir(tmp_path / "c") == ["model.ckpt"]
    assert torch.load(tmp_path / "c" / "model.ckpt", weights_only=True)["global_step"] == 12  # the newest
    with pytest.raises(ValueError, match="enable_version_counter=False.*which this run did not write"):
        other = ModelCheckpoint(dirpath=tmp_path / "c", filename="model", enable_version_counter=False)
        _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=[other]).fit(Probe(), _loader())


def test_model_checkpoint_arguments_and_errors_as_lightning(tmp_path, monkeypatch):
    from datetime import timedelta
    from pathlib import Path

    from trainscale.callbacks import ModelCheckpoint

    monkeypatch.setenv("HOME", str(tmp_path))
    assert ModelCheckpoint(dirpath="~/ckpts").dirpath == str(tmp_path / "ckpts")
    assert ModelCheckpoint(dirpath=Path("~/ckpts")).dirpath == str(tmp_path / "ckpts")
    with pytest.raises(ValueError, match="save_top_k=-3. Must be >= -1"):
        ModelCheckpoint(save_top_k=-3)
    for name in ("every_n_epochs", "every_n_train_steps"):
        with pytest.raises(ValueError, match=rf"{name}=-3. Must be >= 0"):
            ModelCheckpoint(**{name: -3})
    with pytest.raises(ValueError, match="`mode` can be .* but got unknown_option"):
        ModelCheckpoint(mode="unknown_option")
    with pytest.raises(ValueError, match="train_time_interval=60; pass a datetime.timedelta"):
        ModelCheckpoint(train_time_interval=60)
    timed = ModelCheckpoint(train_time_interval=timedelta(minutes=1))
    assert timed.every_n_epochs == 0 and "'train_time_interval': datetime.timedelta(seconds=60)" in timed.state_key
    assert ModelCheckpoint.CHECKPOINT_NAME_LAST == "last" and ModelCheckpoint.FILE_EXTENSION == ".ckpt"
    # load_state_dict: Lightning's rule for another dirpath (only best_model_path), with its warning
    state = {"best_model_path": "a.pt", "best_model_score": torch.tensor(1.0), "best_k_models": {"a.pt": torch.tensor(1.0)},
             "kth_best_model_path": "a.pt", "kth_value": torch.tensor(1.0), "last_model_path": "last.ckpt",
             "dirpath": "/elsewhere", "current_score": None, "monitor": "x"}
    moved = ModelCheckpoint(dirpath=tmp_path / "new", monitor="x")
    with pytest.warns(UserWarning, match="The dirpath has changed from '/elsewhere'"):
        moved.load_state_dict(state)
    assert moved.best_model_path == "a.pt" and moved.best_k_models == {} and moved.last_model_path == ""
    same = ModelCheckpoint(monitor="x")
    same.load_state_dict({**state, "dirpath": None})
    assert same.best_k_models == state["best_k_models"] and same.last_model_path == "last.ckpt"


@pytest.mark.timeout(60)
def test_save_weights_only_save_on_validation_and_time_interval(tmp_path):
    from datetime import timedelta

    from trainscale.callbacks import ModelCheckpoint
    from trainscale.runtime.checkpoint_io import CheckpointError

    weights = ModelCheckpoint(dirpath=tmp_path / "w", save_weights_only=True)
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=[weights])
    trainer.fit(Probe(), _loader())
    saved = torch.load(weights.best_model_path, weights_only=True)
    assert "optimizer" not in saved and "state_dict" in saved and saved["global_step"] == 4
    with pytest.raises(CheckpointError, match="has no entry 'optimizer'"):  # as Lightning: no resume from weights
        _trainer(tmp_path, max_epochs=2, callbacks=[]).fit(Probe(), _loader(), ckpt_path=weights.best_model_path)
    path = trainer.save_checkpoint(tmp_path / "w.pt", weights_only=True)
    assert "optimizer" not in torch.load(path, weights_only=True)

    # save_on_train_epoch_end=False, and None (the default) with several validations an epoch: a save after each
    # validation, mid-epoch ones too (val_check_interval=0.5); True: at the epoch ends only
    for name, flag in (("v", False), ("d", None)):
        at_val = ModelCheckpoint(dirpath=tmp_path / name, filename="{step}", save_top_k=-1,
                                 save_on_train_epoch_end=flag)
        _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, val_check_interval=0.5,
                 callbacks=[at_val]).fit(Probe(), _loader(), _loader(4))
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == [f"step={s}.ckpt" for s in (2, 4, 6, 8)], flag
    at_end = ModelCheckpoint(dirpath=tmp_path / "e", filename="{step}", save_top_k=-1, save_on_train_epoch_end=True)
    _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, val_check_interval=0.5,
             callbacks=[at_end]).fit(Probe(), _loader(), _loader(4))
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == ["step=4.ckpt", "step=8.ckpt"]

    # train_time_interval of 0: every optimizer step has trained at least that long since the last save
    timed = ModelCheckpoint(dirpath=tmp_path / "t", filename="{step}", save_top_k=-1, train_time_interval=timedelta(0))
    _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=[timed]).fit(Probe(), _loader())
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == [f"step={s}.ckpt" for s in (1, 2, 3, 4)]


@pytest.mark.timeout(60)
def test_save_checkpoint_takes_lightnings_arguments_in_their_order(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(Probe(), _loader())
    # Lightning's signature, save_checkpoint(filepath, weights_only, storage_options), as its ModelCheckpoint calls it
    positional = trainer.save_checkpoint(tmp_path / "positional.ckpt", True)
    assert "optimizer" not in torch.load(positional, weights_only=True)
    named = trainer.save_checkpoint(filepath=tmp_path / "named.ckpt", weights_only=False, storage_options=None)
    assert "optimizer" in torch.load(named, weights_only=True)
    with pytest.raises(TypeError, match="storage_options.*not supported"):  # as Lightning's TorchCheckpointIO
        trainer.save_checkpoint(tmp_path / "remote.ckpt", False, {"anon": True})
    assert not (tmp_path / "remote.ckpt").exists()


# -- checkpoint names, ModelCheckpoint's argument errors, save_on_exception --------------------------------------------
@pytest.mark.timeout(60)
def test_checkpoints_take_lightnings_names_and_save_checkpoint_the_exact_path(tmp_path):
    """A Lightning port lists the checkpoint directory for ``.ckpt`` names: ``epoch=E-step=S.ckpt`` with E the epoch
    trained (from 0) and S the optimizer steps taken, from the Trainer's own callback and from a default
    ``ModelCheckpoint``; a template gets ".ckpt" too; ``save_checkpoint(path)`` writes that path, whatever it ends
    with."""
    import os

    from trainscale.callbacks import ModelCheckpoint

    own = _trainer(tmp_path / "own", max_epochs=2, num_sanity_val_steps=0)
    own.fit(Probe(), _loader())  # 4 steps an epoch
    assert sorted(os.listdir(own.run_dir / "checkpoints")) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last"]
    plain = ModelCheckpoint(dirpath=tmp_path / "a")
    templated = ModelCheckpoint(dirpath=tmp_path / "b", filename="{epoch}-{idx:.0f}", every_n_epochs=2)
    trainer = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, callbacks=[plain, templated])
    trainer.fit(Probe(), _loader())
    assert os.listdir(tmp_path / "a") == ["epoch=1-step=8.ckpt"]
    assert os.listdir(tmp_path / "b") == ["epoch=1-idx=3.ckpt"]
    assert plain.dirpath == str(tmp_path / "a") and plain.best_model_path == str(tmp_path / "a" / "epoch=1-step=8.ckpt")
    for name in ("model.ckpt", "weights.bin"):
        assert trainer.save_checkpoint(tmp_path / "c" / name) == tmp_path / "c" / name
    assert sorted(os.listdir(tmp_path / "c")) == ["model.ckpt", "weights.bin"]
    assert torch.load(tmp_path / "c" / "weights.bin", weights_only=True)["global_step"] == 8


def test_model_checkpoint_refuses_lightnings_invalid_arguments_naming_the_fix():
    from datetime import timedelta

    from trainscale.callbacks import ModelCheckpoint

    with pytest.raises(ValueError, match=r"save_top_k=3, monitor=None\) is not a valid configuration.*pass "
                                         r"monitor=.*or save_top_k=-1.*Trainer\(keep_last=3\)"):
        ModelCheckpoint(save_top_k=3)
    for given in ({"every_n_train_steps": 5, "every_n_epochs": 1},
                  {"train_time_interval": timedelta(minutes=5), "every_n_epochs": 2},
                  {"train_time_interval": timedelta(minutes=5), "every_n_train_steps": 10}):
        with pytest.raises(ValueError, match="should be mutually exclusive: give one of them.*second ModelCheckpoint"):
            ModelCheckpoint(**given)
    # what Lightning accepts: a top k by a metric, one schedule with the others off, -1/0/1 without a monitor
    assert ModelCheckpoint(monitor="val_loss", save_top_k=3).save_top_k == 3
    assert ModelCheckpoint(every_n_train_steps=4, every_n_epochs=0).every_n_train_steps == 4
    assert ModelCheckpoint(train_time_interval=timedelta(0), every_n_train_steps=0).every_n_epochs == 0
    assert [ModelCheckpoint(save_top_k=k).save_top_k for k in (-1, 0, 1)] == [-1, 0, 1]
    assert ModelCheckpoint().every_n_epochs == 1 and ModelCheckpoint(every_n_train_steps=0).every_n_epochs == 0


class FailsAtStep(Probe):
    """Raises in ``training_step`` once ``fail_at`` optimizer steps have been taken (None: never)."""

    fail_at: int | None = 3

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.fail_at:
            raise RuntimeError("the data went bad")
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(60)
def test_save_on_exception_checkpoints_the_failed_fit_which_then_resumes_and_never_overwrites(tmp_path):
    import os

    from trainscale.callbacks import ModelCheckpoint

    crashes = tmp_path / "crashes"
    crashes.mkdir()
    (crashes / "crash.ckpt").write_bytes(b"another run's")
    callback = ModelCheckpoint(dirpath=crashes, filename="crash", save_on_exception=True, save_last=True)
    with pytest.raises(RuntimeError, match="the data went bad"):
        _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, callbacks=[callback]).fit(FailsAtStep(), _loader())
    # Lightning would write crash.ckpt over the file there; the next version takes the state at the exception
    assert sorted(os.listdir(crashes)) == ["crash-v1.ckpt", "crash.ckpt", "last.ckpt"]
    assert (crashes / "crash.ckpt").read_bytes() == b"another run's"
    assert torch.load(crashes / "crash-v1.ckpt", weights_only=True)["global_step"] == 3
    assert os.readlink(crashes / "last.ckpt") == "crash-v1.ckpt"
    assert callback.last_model_path == str(crashes / "last.ckpt")
    model = FailsAtStep()
    model.fail_at = None
    resumed = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, callbacks=[ModelCheckpoint(dirpath=crashes)])
    resumed.fit(model, _loader(), ckpt_path="last")  # the run's "last" names the checkpoint of the exception
    assert resumed.ckpt_path == str(crashes / "crash-v1.ckpt") and resumed.global_step == 8
    assert model.epochs_seen == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]  # epoch 0 resumed mid-way

    # off by default; and no second checkpoint of a step this callback has just saved
    quiet = ModelCheckpoint(dirpath=tmp_path / "quiet", filename="{step}")
    every = ModelCheckpoint(dirpath=tmp_path / "every", filename="{step}", every_n_train_steps=1,
                            save_on_exception=True)
    with pytest.raises(RuntimeError, match="the data went bad"):
        _trainer(tmp_path, max_epochs=1, callbacks=[quiet, every]).fit(FailsAtStep(), _loader())
    assert not (tmp_path / "quiet").exists() or os.listdir(tmp_path / "quiet") == []
    assert os.listdir(tmp_path / "every") == ["step=3.ckpt"]  # the step save before the exception, not a copy


class FormerNames(ModelCheckpoint):
    """A ``ModelCheckpoint`` writing files as runs did before the names became Lightning's (``.pt``; with the
    template below, zero padded), its state under ``ModelCheckpoint``'s own key, as those runs saved it."""

    __qualname__ = "ModelCheckpoint"
    FILE_EXTENSION = ".pt"


class LaterWorse(Scored):
    scores = (1.0, 0.5, 2.0, 3.0)


@pytest.mark.timeout(60)
def test_a_run_directory_with_the_former_pt_names_still_resumes(tmp_path):
    """A run whose checkpoints are ``.pt`` files, which its ``last`` and its callback state name: ``ckpt_path="last"``
    continues it in place (the ``.pt`` file it resumed from ranked as its own by its score, found by "best"),
    and the path itself or a ``last.ckpt`` link to it resume too."""
    import os

    root = tmp_path / "runs"
    former = FormerNames(monitor="score", filename="epoch={epoch:06d}-step={step:010d}", auto_insert_metric_name=False)
    first = _trainer(root, max_epochs=3, num_sanity_val_steps=0, callbacks=[former])
    first.fit(LaterWorse(), _loader())  # 4 steps an epoch; scores 1.0, 0.5, 2.0: epoch 2's not in the top 1, unsaved
    ckpt_dir = first.run_dir / "checkpoints"
    best = ckpt_dir / "epoch=000001-step=0000000008.pt"
    assert sorted(os.listdir(ckpt_dir)) == [best.name, "last"]
    before = best.read_bytes()

    model, callback = LaterWorse(), ModelCheckpoint(monitor="score", save_top_k=2)
    resumed = _trainer(root, max_epochs=4, num_sanity_val_steps=0, callbacks=[callback])
    resumed.fit(model, _loader(), ckpt_path="last")  # epochs 2 and 3 score 2.0 and 3.0: only 2.0 enters the top 2
    assert resumed.run_dir == first.run_dir and resumed.ckpt_path == str(best) and resumed.global_step == 16
    assert model.epochs_seen == [("start", 2), ("start", 3)]  # the epochs before came from the .pt file
    assert sorted(os.listdir(ckpt_dir)) == [best.name, "epoch=2-step=12.ckpt", "last"]
    assert callback.best_model_path == str(best) and best.read_bytes() == before
    on_best = resumed.validate(model, _loader(4), ckpt_path="best", verbose=False)[0]["val_loss"]
    reference = Probe()
    reference.load_state_dict(torch.load(best, weights_only=True)["state_dict"])
    assert on_best == resumed.validate(reference, _loader(4), verbose=False)[0]["val_loss"]

    link = tmp_path / "elsewhere" / "last.ckpt"  # a save_last link of such a run
    link.parent.mkdir()
    link.symlink_to(best)
    for path in (best, link):
        model = LaterWorse()
        _trainer(tmp_path / "other", max_epochs=3, num_sanity_val_steps=0).fit(model, _loader(), ckpt_path=path)
        assert model.epochs_seen == [("start", 2)], path
    assert best.read_bytes() == before



@pytest.mark.timeout(60)
def test_model_checkpoint_monitors_the_epoch_and_the_step(tmp_path):
    """``monitor="epoch"``/``"step"`` rank by the loop's position (Lightning's ``_monitor_candidates``)."""
    by_epoch = ModelCheckpoint(dirpath=tmp_path / "epoch", monitor="epoch", mode="max", save_top_k=2,
                               filename="{epoch}")
    by_step = ModelCheckpoint(dirpath=tmp_path / "step", monitor="step", mode="min", save_top_k=1,
                              filename="{step}", every_n_train_steps=2)
    _trainer(tmp_path / "runs", max_epochs=3, num_sanity_val_steps=0, callbacks=[by_epoch, by_step]).fit(
        Probe(), _loader())  # 4 steps an epoch
    assert sorted(os.listdir(tmp_path / "epoch")) == ["epoch=1.ckpt", "epoch=2.ckpt"]  # the 2 latest epochs
    assert by_epoch.best_model_path == str(tmp_path / "epoch" / "epoch=2.ckpt") and by_epoch.best_model_score == 2
    assert os.listdir(tmp_path / "step") == ["step=2.ckpt"]  # the lowest step: no later one enters the top 1
    assert by_step.best_model_score == 2


@pytest.mark.timeout(60)
def test_a_monitored_save_missing_the_top_k_writes_nothing_and_last_stays_on_the_newest(tmp_path, capsys):
    """As Lightning's ``check_monitor_top_k``: a checkpoint whose score does not enter the top k is not written, so
    ``last.ckpt`` and "last" (``ckpt_path="last"``) name the newest that did; ``verbose`` says so."""
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="score", save_top_k=1, save_last=True,
                               filename="{epoch}", verbose=True)
    trainer = _trainer(tmp_path / "runs", max_epochs=4, num_sanity_val_steps=0, callbacks=[callback])
    trainer.fit(Scored(), _loader())  # scores 1.0, 0.5, 2.0, 0.25: epoch 2 misses the top 1
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["epoch=3.ckpt", "last.ckpt"]
    assert callback.current_score == 0.25 and callback.best_model_score == 0.25
    assert "Epoch 2, global step 12: 'score' was not in top 1" in capsys.readouterr().out

    shorter = ModelCheckpoint(dirpath=tmp_path / "three", monitor="score", save_top_k=1, save_last=True,
                              filename="{epoch}")
    trainer = _trainer(tmp_path / "runs", max_epochs=3, num_sanity_val_steps=0, callbacks=[shorter])
    trainer.fit(Scored(), _loader())
    assert sorted(os.listdir(tmp_path / "three")) == ["epoch=1.ckpt", "last.ckpt"]
    assert os.readlink(tmp_path / "three" / "last.ckpt") == "epoch=1.ckpt"  # not moved by epoch 2, unsaved
    assert (trainer.run_dir / "checkpoints" / "last").read_text().strip() == str(tmp_path / "three" / "epoch=1.ckpt")
    assert shorter.current_score == 0.5  # the score of the latest save


@pytest.mark.timeout(60)
def test_save_last_writes_last_ckpt_at_the_end_of_a_fit_that_saved_nothing(tmp_path):
    """``save_last`` with no save due in the whole fit (``every_n_epochs`` above the epochs trained) or with
    ``save_top_k=0``: ``last.ckpt`` is the checkpoint itself, a file, which ``fit(ckpt_path=...)`` resumes."""
    for name, kwargs in (("late", {"every_n_epochs": 5}), ("zero", {"save_top_k": 0})):
        callback = ModelCheckpoint(dirpath=tmp_path / name, save_last=True, **kwargs)
        trainer = _trainer(tmp_path / "runs", max_epochs=2, num_sanity_val_steps=0, callbacks=[callback])
        trainer.fit(Probe(), _loader())
        last = tmp_path / name / "last.ckpt"
        assert os.listdir(tmp_path / name) == ["last.ckpt"] and not last.is_symlink(), name
        assert callback.last_model_path == str(last) and callback.best_model_path == ""
        assert torch.load(last, weights_only=True)["global_step"] == 8
        model = Probe()
        _trainer(tmp_path / "runs", max_epochs=3, num_sanity_val_steps=0).fit(model, _loader(), ckpt_path=last)
        assert model.epochs_seen == [("start", 2), ("end", 2)], name


def test_a_url_dirpath_and_a_model_checkpoint_with_checkpointing_off_are_refused(tmp_path):
    """A ``dirpath`` URL is refused at setup, not made a local directory named ``memory:`` (Lightning's words with
    ``save_last='link'``); ``enable_checkpointing=False`` with a ``ModelCheckpoint`` is Lightning's error."""
    for save_last, words in (("link", "save_last='link'.* is only supported for local file paths"),
                             (None, "'s3://bucket/ckpts'\\) is a URL: trainscale writes checkpoints to local")):
        dirpath = "memory://ckpts" if save_last else "s3://bucket/ckpts"
        callback = ModelCheckpoint(dirpath=dirpath, save_last=save_last)
        with pytest.raises(ValueError, match=words):
            callback.setup(_trainer(tmp_path), Probe(), "fit")
        with pytest.raises(ValueError, match=words):
            _trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(Probe(), _loader())
    assert not any(p.name.startswith(("memory", "s3")) for p in tmp_path.rglob("*"))
    assert not os.path.exists("memory:") and not os.path.exists("s3:")  # no local directory of those names
    with pytest.raises(ValueError, match="`enable_checkpointing=False` but found `ModelCheckpoint`"):
        _trainer(tmp_path, enable_checkpointing=False, callbacks=[ModelCheckpoint()])
    assert _trainer(tmp_path, enable_checkpointing=False).checkpoint_callback is None


# -- Lightning's warnings and errors that a port keeps ------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])  # "16-mixed": a GradScaler with nothing to scale
def test_configure_optimizers_returning_none_trains_without_an_optimizer_with_a_warning(tmp_path, precision):
    class NoOptimizer(Probe):
        def configure_optimizers(self):
            return None

    model = NoOptimizer()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, precision=precision)
    with pytest.warns(UserWarning, match="returned `None`, this fit will run with no optimizer"):
        trainer.fit(model, _loader())
    assert trainer.global_step == 4  # the loop ran its 4 batches; nothing moved the weights
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class _Stateless:
    """A scheduler that is not torch's: its own step rule."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        pass


class _OwnScheduler(_Stateless):
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_scheduler_configurations_lightning_warns_about_or_refuses():
    from trainscale.lightning.optimizers import parse_optimization

    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    with pytest.warns(RuntimeWarning, match="Are you sure you didn't mean 'interval': 'step'"):
        parse_optimization({"optimizer": opt, "lr_scheduler": cycle})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_optimization({"optimizer": opt, "lr_scheduler": {"scheduler": cycle, "interval": "step"}})
        parse_optimization(([opt], [_OwnScheduler(opt)]), manual=True)  # the module steps it itself
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        assert parse_optimization(([opt], [plateau]), manual=True).schedulers[0].monitor is None
    with pytest.raises(ValueError, match="doesn't follow PyTorch's LRScheduler API.*automatic_optimization = False"):
        parse_optimization(([opt], [_OwnScheduler(opt)]))
    for manual in (False, True):
        with pytest.raises(TypeError, match="`_Stateless` is invalid.*`state_dict` and `load_state_dict`"):
            parse_optimization(([opt], [_Stateless(opt)]), manual=manual)
    with pytest.warns(RuntimeWarning, match=r"contains the key\(s\) \['monitor', 'strict'\], but the keys will be "
                                            r"ignored.*manually in manual optimization"):
        parse_optimization({"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "m", "strict": True,
                                                                 "interval": "step"}}, manual=True)


@pytest.mark.timeout(60)
def test_a_manual_module_steps_its_plateau_scheduler_without_a_monitor(tmp_path):
    class ManualPlateau(Probe):
        automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.layer(batch[0]).pow(2).mean())
            opt.step()

        def on_train_epoch_end(self):
            self.lr_schedulers().step(1.0)  # the same value every epoch: patience 0 lowers the rate each time

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)]

    trainer = _trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0)
    trainer.fit(ManualPlateau(), _loader())
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.1 ** 2)  # lowered after epochs 2, 3


class _LogsIn(Callback):
    def __init__(self, **flags):
        self.flags = flags

    def _log(self, trainer, module, *args, **kwargs):  # setup and teardown get stage by keyword, as in Lightning
        module.log("from_callback", 1.0, **self.flags)


def _logs_in(hook, **flags):
    """A callback whose ``hook`` logs ``from_callback``, defined on its class (the Trainer calls the hooks a
    callback's class overrides)."""
    return type(f"LogsIn_{hook}", (_LogsIn,), {hook: _LogsIn._log})(**flags)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("hook", "flags", "match"), [
    ("setup", {}, r"You can't `self.log\(\)` inside `setup`"),
    ("on_fit_start", {}, r"You can't `self.log\(\)` inside `on_fit_start`"),
    ("on_train_end", {}, r"You can't `self.log\(\)` inside `on_train_end`"),
    ("on_save_checkpoint", {}, r"You can't `self.log\(\)` inside `on_save_checkpoint`"),
    ("on_train_epoch_end", {"on_step": True}, r"self.log\(on_step=True\)` inside `on_train_epoch_end`, must be one"),
    ("on_train_batch_end", {"on_step": False, "on_epoch": False}, r"on_epoch=False\)` is not useful"),
])
def test_self_log_where_lightning_refuses_it_raises(tmp_path, hook, flags, match):
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=[_logs_in(hook, **flags)])
    with pytest.raises(ValueError, match=match):
        trainer.fit(Probe(), _loader())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("first", "then", "raises"), [
    ({}, {"prog_bar": True}, True), ({}, {"reduce_fx": "max"}, True), ({}, {"on_epoch": True}, True),
    ({}, {"logger": False}, True), ({}, {"on_step": True}, False), ({"reduce_fx": "mean"}, {"reduce_fx": "avg"}, False),
])
def test_one_name_logged_in_one_hook_must_keep_its_options(tmp_path, first, then, raises):
    # Lightning keeps one result per hook and name: logging it again there with other options (on a later batch
    # too) is its MisconfigurationException; the defaults spelt out, or "avg" for "mean", are the same options
    class Relogs(Probe):
        def training_step(self, batch, batch_idx):
            self.log("twice", 1.0, **(first if batch_idx == 0 else then))
            return super().training_step(batch, batch_idx)

    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    if raises:
        with pytest.raises(ValueError, match=r"You called `self.log\(twice, ...\)` twice in `training_step` with "):
            trainer.fit(Relogs(), _loader())
    else:
        trainer.fit(Relogs(), _loader())
        assert float(trainer.callback_metrics["twice"]) == 1.0


@pytest.mark.timeout(60)
def test_a_second_fit_may_log_a_name_with_other_options(tmp_path):
    class Logs(Probe):
        def __init__(self, prog_bar):
            super().__init__()
            self.prog_bar = prog_bar

        def training_step(self, batch, batch_idx):
            self.log("shown", 1.0, prog_bar=self.prog_bar)
            return super().training_step(batch, batch_idx)

    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(Logs(prog_bar=False), _loader())
    trainer.fit(Logs(prog_bar=True), _loader())  # a new run: Lightning's results start empty, options too
    assert trainer.progress_bar_metrics["shown"] == 1.0


def test_self_log_in_configure_optimizers_raises(tmp_path):
    class LogsThere(Probe):
        def configure_optimizers(self):
            self.log("lr", 0.05)
            return super().configure_optimizers()

    with pytest.raises(ValueError, match=r"You can't `self.log\(\)` inside `configure_optimizers`"):
        _trainer(tmp_path, max_epochs=1).fit(LogsThere(), _loader())


@pytest.mark.timeout(60)
def test_self_log_in_the_train_start_and_epoch_hooks_logs_epoch_values(tmp_path):
    class AtTrainStart(Probe):
        def on_train_start(self):
            self.log("at_start", 3.0)  # Lightning's default there: on_epoch=True

    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=[_logs_in("on_train_epoch_end")])
    trainer.fit(AtTrainStart(), _loader())
    assert trainer.history[-1]["at_start"] == 3.0 and trainer.callback_metrics["from_callback"] == 1.0


@pytest.mark.timeout(60)
def test_overfit_batches_reads_the_first_batches_in_order_with_lightnings_warning(tmp_path):
    from torch.utils.data import Sampler

    class Backwards(Sampler):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter(range(self.n - 1, -1, -1))

        def __len__(self):
            return self.n

    class Seen(Probe):
        def __init__(self):
            super().__init__()
            self.first = []

        def training_step(self, batch, batch_idx):
            self.first.append(batch[0][0, 0].item())
            return super().training_step(batch, batch_idx)

    data = _loader().dataset
    for name, loader in (("shuffled", DataLoader(data, batch_size=2, shuffle=True)),
                         ("own sampler", DataLoader(data, batch_size=2, sampler=Backwards(len(data))))):
        model = Seen()
        trainer = _trainer(tmp_path / name, max_epochs=2, overfit_batches=2, num_sanity_val_steps=0)
        with pytest.warns(UserWarning, match="requested to overfit but enabled train dataloader shuffling"):
            trainer.fit(model, loader)
        in_order = data.tensors[0][[0, 2], 0].tolist()
        assert model.first == in_order * 2, name  # the same first two batches, in the data set's order, each epoch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="You defined a `validation_step` but have no `val_dataloader`")
        _trainer(tmp_path / "sequential", max_epochs=1, overfit_batches=2, log_every_n_steps=1).fit(Seen(), _loader())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "warned"), [
    ({}, True), ({"max_epochs": 1}, False), ({"max_steps": 2}, False), ({"fast_dev_run": True}, False)])
def test_a_fit_without_max_epochs_says_it_trains_one_epoch(tmp_path, flags, warned):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, num_sanity_val_steps=0, **flags).fit(Probe(), _loader())
    said = [w for w in caught if "`max_epochs` was not set. Setting it to 1 epoch (trainscale's default; Lightning's "
            "is 1000 epochs)" in str(w.message)]
    assert len(said) == warned


@pytest.mark.timeout(60)
def test_fast_dev_run_skips_the_batch_size_search_with_lightnings_warning(tmp_path):
    loader = _loader()
    trainer = _trainer(tmp_path, fast_dev_run=True, batch_size="max", max_memory=2 ** 30)
    with pytest.warns(UserWarning, match="Skipping batch size scaler since `fast_dev_run` is enabled"):
        trainer.fit(Probe(), loader)
    assert trainer._fit.train_loader.batch_size == loader.batch_size


class _WithEncoder(Probe):
    def __init__(self, encoder, width=4, transform=None):
        super().__init__()
        self.save_hyperparameters(ignore=[] if transform is None else ["encoder"])


def test_save_hyperparameters_warns_of_a_module_saved_as_a_hyperparameter():
    with pytest.warns(UserWarning, match=r"'encoder' is an instance of `nn.Module`.*ignore=\['encoder'\]"):
        model = _WithEncoder(nn.Linear(2, 2))
    assert list(model.hparams) == ["encoder", "width", "transform"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(_WithEncoder(nn.Linear(2, 2), transform=abs).hparams) == ["width", "transform"]


@pytest.mark.timeout(60)
def test_an_unpicklable_hyperparameter_is_removed_at_fit_with_a_warning(tmp_path):
    model = _WithEncoder(None, transform=lambda x: x)  # a lambda: pickle cannot write it
    with pytest.warns(UserWarning, match="'transform' removed from hparams because it cannot be pickled.*ignore="):
        _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0).fit(model, _loader())
    assert dict(model.hparams) == {"width": 4}


class _Data(trainscale.DataModule):
    def __init__(self, width=4, root="data"):
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        return _loader()


@pytest.mark.timeout(60)
def test_the_data_modules_hyperparameters_are_logged_with_the_modules_and_must_agree(tmp_path):
    import json

    from trainscale.loggers import CSVLogger

    trainer = _trainer(tmp_path, max_epochs=1, logger=CSVLogger(tmp_path / "logs"))
    trainer.fit(_WithEncoder(None, width=4), datamodule=_Data(width=4))
    logged = json.loads(next((tmp_path / "logs").rglob("hparams.json")).read_text())
    assert logged["width"] == 4 and logged["root"] == "data"
    with pytest.raises(RuntimeError, match=r"Error while merging hparams: the keys \['width'\] are present in both"):
        _trainer(tmp_path, max_epochs=1).fit(_WithEncoder(None, width=4), datamodule=_Data(width=8))


# -- save_hyperparameters: the __init__ chain, dataclasses, containers, and what the loggers get -----------------------
class _Base(Probe):
    def __init__(self, depth=2, width=4, dropout=0.1):
        super().__init__()
        self.save_hyperparameters(ignore="dropout")


class _Quiet(_Base):  # never calls save_hyperparameters itself
    def __init__(self, *args, heads=8, **kwargs):
        super().__init__(*args, **kwargs)


class _Drops(_Base):
    def __init__(self, depth=2, width=4, dropout=0.1):
        super().__init__(depth, width, dropout)
        self.save_hyperparameters(ignore=["width"])


class _Owner:  # not a module: its own arguments are not a module's hyperparameters
    def __init__(self, width=99):
        self.model = _Base(width=5)


def test_save_hyperparameters_collects_every_init_of_the_object_on_the_stack():
    assert dict(_Quiet(3, width=6).hparams) == {"depth": 3, "width": 6, "heads": 8}  # the subclass's own argument too
    assert dict(_Drops(width=7).hparams) == {"depth": 2, "dropout": 0.1}  # its ignore= drops what the base kept
    assert dict(_Owner().model.hparams) == {"depth": 2, "width": 5}  # the walk ends at a frame of another object


def test_save_hyperparameters_of_a_dataclass_module_keeps_its_init_fields():
    import dataclasses

    @dataclasses.dataclass(eq=False)
    class Configured(Probe):
        width: int
        name: str = "net"
        cache: dict = dataclasses.field(default_factory=dict, init=False)

        def __post_init__(self):
            super().__init__()
            self.save_hyperparameters()

    assert dict(Configured(3, name="small").hparams) == {"width": 3, "name": "small"}


class _Configured(Probe):
    def __init__(self, config, seed=0):
        super().__init__()
        self.save_hyperparameters(config)


class _ConfiguredData(trainscale.DataModule):
    def __init__(self, options):
        super().__init__()
        self.save_hyperparameters(options)

    def train_dataloader(self):
        return _loader(n=4, batch_size=self.hparams.batch)


@pytest.mark.timeout(60)
def test_one_container_comes_back_as_the_argument_it_was_given_in(tmp_path):
    from argparse import Namespace

    from trainscale.checkpointing import run_dirs

    model, data = _Configured(Namespace(width=3, depth=2)), _ConfiguredData({"batch": 2})
    assert (model.__dict__["_hparams_name"], data.__dict__["_hparams_name"]) == ("config", "options")
    _trainer(tmp_path, max_epochs=1, logger=False).fit(model, datamodule=data)
    path = run_dirs.find_last(tmp_path)
    raw = torch.load(path, weights_only=True)
    assert raw["hyper_parameters"] == {"width": 3, "depth": 2} and raw["hparams_name"] == "config"
    assert raw["datamodule_hyper_parameters"] == {"batch": 2} and raw["datamodule_hparams_name"] == "options"
    assert dict(_Configured.load_from_checkpoint(path).hparams) == {"width": 3, "depth": 2}  # _Configured(config=...)
    assert dict(_Configured.load_from_checkpoint(path, width=5).hparams) == {"width": 5, "depth": 2}
    assert dict(_ConfiguredData.load_from_checkpoint(path).hparams) == {"batch": 2}
    with pytest.raises(ValueError, match=r"Primitives \(<class 'bool'>, <class 'int'>, <class 'float'>, <class 'str'>\)"):
        _Configured(0.5)


class _WithLoss(Probe):
    def __init__(self, width=4, loss=None):
        super().__init__()
        self.save_hyperparameters()


@pytest.mark.timeout(60)
def test_hyperparameters_of_other_types_come_back_with_weights_only_false(tmp_path):
    from trainscale.checkpointing import run_dirs

    _trainer(tmp_path, max_epochs=1, logger=False).fit(_WithLoss(loss=nn.SmoothL1Loss(beta=0.5)), _loader())
    path = run_dirs.find_last(tmp_path)
    assert torch.load(path, weights_only=True)["hyper_parameters"] == {"width": 4}  # still a weights-only file
    assert _WithLoss.load_from_checkpoint(path).hparams.loss is None  # left out: the default
    restored = _WithLoss.load_from_checkpoint(path, weights_only=False).hparams.loss  # Lightning's way to get it
    assert isinstance(restored, nn.SmoothL1Loss) and restored.beta == 0.5


class _Recorder:
    def __init__(self):
        self.hparams = []

    def setup(self, run_dir): ...

    def log_hyperparams(self, params):
        self.hparams.append(dict(params))

    def log_metrics(self, metrics, step): ...

    def finalize(self, status): ...


class _Unlogged(Probe):
    def __init__(self, width=4):
        super().__init__()
        self.save_hyperparameters(logger=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("model", "data", "logged"), [
    (lambda: _WithEncoder(None, width=4), lambda: _Data(width=4), [{"encoder": None, "width": 4, "transform": None,
                                                                    "root": "data"}]),
    (lambda: _WithEncoder(None, width=4), lambda: None, [{"encoder": None, "width": 4, "transform": None}]),
    (lambda: Probe(), lambda: _Data(width=4), [{"width": 4, "root": "data"}]),
    (lambda: Probe(), lambda: None, []),  # nothing saved: no log_hyperparams call
    (lambda: _Unlogged(), lambda: None, []),  # save_hyperparameters(logger=False)
], ids=["module-and-data", "module", "data", "neither", "logger-false"])
def test_the_loggers_get_the_saved_hyperparameters_only_as_first_saved(tmp_path, model, data, logged):
    recorder, model, data = _Recorder(), model(), data()
    if "width" in model.hparams:
        model.hparams.width = 16  # a change after the save: not what the loggers get (hparams_initial)
    trainer = _trainer(tmp_path, max_epochs=1, logger=recorder)
    trainer.fit(model, **({"datamodule": data} if data is not None else {"train_dataloaders": _loader()}))
    assert recorder.hparams == logged
    assert json.loads((trainer.run_dir / "summary.json").read_text())["flags"]["max_epochs"] == 1


@pytest.mark.timeout(60)
def test_fit_validate_test_and_predict_take_lightnings_weights_only(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1, logger=False)
    trainer.fit(Probe(), _loader(), weights_only=False)
    assert trainer.validate(dataloaders=_loader(), weights_only=False, verbose=False)[0]["val_loss"] >= 0
    tested = Probe()
    tested.test_step = tested.validation_step
    assert "val_loss" in trainer.test(tested, _loader(), weights_only=True, verbose=False)[0]
    assert trainer.predict(nn.Linear(2, 1), _loader(), weights_only=None).shape == (8, 1)


def test_early_stopping_and_timer_speak_lightnings_words(caplog):
    from trainscale.callbacks import Timer

    with pytest.raises(ValueError, match="`mode` can be min, max, got average"):
        EarlyStopping("m", mode="average")
    stop = EarlyStopping("m", stopping_threshold=0.5)
    assert stop._evaluate(0.4) == (True, "Stopping threshold reached: m = 0.4 < 0.5. Signaling Trainer to stop.")

    class _Trainer:  # what Timer reads: the runtime's broadcast and rank, and should_stop
        should_stop = False
        runtime = type("R", (), {"is_rank_zero": True, "broadcast_object": staticmethod(lambda x: x)})()

    loop = _Trainer()
    with caplog.at_level("INFO", logger="trainscale.callbacks.timer"):
        Timer({"seconds": 0})._check(loop)
    assert loop.should_stop
    assert [(r.name, r.levelname) for r in caplog.records] == [("trainscale.callbacks.timer", "INFO")]
    assert caplog.records[0].getMessage().startswith("Time limit reached. Elapsed time is 0:00:00. Signaling Trainer")


@pytest.mark.timeout(60)
def test_a_step_timer_reads_the_clock_once_per_optimizer_step(tmp_path):
    from trainscale.callbacks import Timer

    class Counted(Timer):
        checks = 0

        def _check(self, trainer):  # on several ranks each check is a broadcast of rank zero's clock
            Counted.checks += 1
            super()._check(trainer)

    trainer = _trainer(tmp_path, max_epochs=1, accumulate_grad_batches=2, num_sanity_val_steps=0,
                       callbacks=[Counted(duration={"days": 1})])
    trainer.fit(Probe(), _loader(n=16))  # 8 batches: 4 optimizer steps
    assert Counted.checks == 1 + 4  # at the fit's start, then at each step's end (not at each micro-batch)


@pytest.mark.timeout(60)
def test_trainer_model_and_lightning_module_are_the_module_in_its_hooks_and_after_fit(tmp_path):
    seen = []

    class Watches(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((trainer.model is pl_module, trainer.lightning_module is pl_module, trainer.model.training))

    trainer = _trainer(tmp_path, max_steps=1, num_sanity_val_steps=0, callbacks=[Watches()])
    assert trainer.model is None and trainer.lightning_module is None  # before any fit, as Lightning's
    module = Probe()
    trainer.fit(module, _loader())
    assert seen == [(True, True, True)] and trainer.model is module


# -- on_exception in every stage, the Trainer's own errors and pickling ---------------------------------------------
class _Counts(Callback):
    def __init__(self):
        self.errors: list[str] = []

    def on_exception(self, trainer, module, exception):
        self.errors.append(str(exception))


class _FailsIn(Probe):
    """Raises in the start hook of the stage named ``stage``."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def on_validation_start(self):
        if self.stage == "validation":
            raise RuntimeError("broken validation")

    def on_test_start(self):
        raise RuntimeError("broken test")

    def test_step(self, batch, batch_idx):
        return None

    def on_predict_start(self):
        raise RuntimeError("broken predict")


class _NotedData(trainscale.DataModule):
    def __init__(self):
        self.noted: list[str] = []

    def val_dataloader(self):
        return _loader()

    def on_exception(self, exception):
        self.noted.append(str(exception))


@pytest.mark.timeout(60)
def test_on_exception_is_called_when_validate_test_or_predict_raise(tmp_path):
    counts, data = _Counts(), _NotedData()
    trainer = _trainer(tmp_path, callbacks=[counts])
    with pytest.raises(RuntimeError, match="broken test"):
        trainer.test(_FailsIn("test"), _loader(), verbose=False)
    with pytest.raises(RuntimeError, match="broken predict"):
        trainer.predict(_FailsIn("predict"), _loader())
    with pytest.raises(RuntimeError, match="broken validation"):
        trainer.validate(_FailsIn("validation"), datamodule=data, verbose=False)
    assert counts.errors == ["broken test", "broken predict", "broken validation"]
    assert data.noted == ["broken validation"]  # the data module's hook too, as Lightning's _interrupt calls it


def test_an_unknown_trainer_keyword_is_pythons_type_error_for_a_subclass_too():
    class Custom(Trainer):
        def __init__(self, **kwargs):
            self.extra = kwargs.pop("extra", 0)
            super().__init__(**kwargs)

    with pytest.raises(TypeError, match=r"__init__\(\) got an unexpected keyword argument 'abcdefg'"):
        Custom(extra=1, abcdefg=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_epoch'; did you mean 'max_epochs'"):
        Trainer(max_epoch=2)


def test_a_trainer_pickles_before_fit(tmp_path):
    import pickle

    trainer = pickle.loads(pickle.dumps(_trainer(tmp_path, max_epochs=3, lr_scaling="linear", base_batch_size=4)))
    assert trainer.max_epochs == 3 and trainer.batch_scaling.rule == "linear"


# -- the module's step hooks: backward, optimizer_step, optimizer_zero_grad, configure_gradient_clipping ------------
class _StepHooks(Probe):
    """Overrides Lightning's step hooks, each calling the default, and notes what each sees."""

    def __init__(self):
        super().__init__()
        self.noted: list[tuple] = []

    def backward(self, loss, *args, **kwargs):
        self.noted.append(("backward", float(loss)))
        super().backward(loss, *args, **kwargs)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        before = self.layer.weight.detach().clone()
        assert self.layer.weight.grad is not None  # the step's backward ran already (Lightning: in the closure)
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self.noted.append(("optimizer_step", epoch, batch_idx, not torch.equal(before, self.layer.weight)))

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.noted.append(("optimizer_zero_grad", epoch, batch_idx))
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        largest = max(float(p.grad.abs().max()) for p in self.parameters())
        self.noted.append(("clip", gradient_clip_val, gradient_clip_algorithm, largest))


@pytest.mark.timeout(60)
def test_the_modules_step_hooks_run_once_per_optimizer_step_around_the_step(tmp_path):
    model = _StepHooks()
    trainer = _trainer(tmp_path, max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=1e-6,
                       gradient_clip_algorithm="value", num_sanity_val_steps=0)
    trainer.fit(model, _loader(8))  # 4 micro-batches, 2 optimizer steps
    names = [n[0] for n in model.noted]
    assert names == ["optimizer_zero_grad", "backward", "backward", "clip", "optimizer_step"] * 2
    steps = [n for n in model.noted if n[0] == "optimizer_step"]
    assert steps == [("optimizer_step", 0, 1, True), ("optimizer_step", 0, 3, True)]  # the step's last batch_idx
    zeroed = [n for n in model.noted if n[0] == "optimizer_zero_grad"]
    assert zeroed == [("optimizer_zero_grad", 0, 0), ("optimizer_zero_grad", 0, 2)]  # the step's first, as Lightning
    clips = [n for n in model.noted if n[0] == "clip"]
    assert all(c[1:3] == (1e-6, "value") and c[3] <= 1e-6 for c in clips)  # the default clipped, by value
    assert trainer.global_step == 2


class _GradientReader(Callback):
    """Notes the layer's gradient where a ported callback reads it: at each training batch's end and as
    validation starts."""

    def __init__(self):
        self.at_batch_end: list[torch.Tensor | None] = []
        self.at_validation_start: list[torch.Tensor | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        grad = pl_module.layer.weight.grad
        self.at_batch_end.append(None if grad is None else grad.clone())

    def on_validation_start(self, trainer, pl_module):
        self.at_validation_start.append(pl_module.layer.weight.grad)


@pytest.mark.timeout(60)
def test_the_steps_gradients_are_there_at_on_train_batch_end_and_freed_before_validation(tmp_path):
    torch.manual_seed(0)
    model = Probe()
    reference = copy.deepcopy(model.layer)
    reader = _GradientReader()
    trainer = _trainer(tmp_path, max_epochs=1, callbacks=[reader], num_sanity_val_steps=0)
    trainer.fit(model, _loader(6), _loader(2))  # 3 steps of one batch each, then validation
    # plain PyTorch: the gradient each step's backward left, at the weights before that step
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)  # Probe's
    expected = []
    for x, _ in _loader(6):
        optimizer.zero_grad()
        reference(x).pow(2).mean().backward()
        expected.append(reference.weight.grad.clone())
        optimizer.step()
    assert len(reader.at_batch_end) == 3 and all(g is not None for g in reader.at_batch_end)  # Lightning's: there
    for seen, want in zip(reader.at_batch_end, expected):
        torch.testing.assert_close(seen, want)
    assert reader.at_validation_start == [None]  # on_validation_model_zero_grad's default freed them, as Lightning's


class _SkipsOddSteps(Probe):
    """Lightning's pattern for a step taken only sometimes: the closure always, the step every other time."""

    def __init__(self):
        super().__init__()
        self.closure_results: list[float] = []
        self.moved: list[bool] = []

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        before = self.layer.weight.detach().clone()
        if batch_idx % 2 == 0:
            optimizer.step(closure=optimizer_closure)
        else:
            self.closure_results.append(float(optimizer_closure()))
        self.moved.append(not torch.equal(before, self.layer.weight))


@pytest.mark.timeout(60)
def test_an_optimizer_step_hook_may_skip_the_step(tmp_path):
    model = _SkipsOddSteps()
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model, _loader(8, batch_size=2))
    assert model.moved == [True, False, True, False]
    assert len(model.closure_results) == 2 and all(r > 0 for r in model.closure_results)  # the closure: the loss
    assert trainer.global_step == 4  # a skipped step counts, as Lightning counts it


def test_clip_gradients_refuses_a_value_other_than_the_trainers(tmp_path):
    model = Probe()
    model.trainer = _trainer(tmp_path, gradient_clip_val=0.5)
    with pytest.raises(ValueError, match=r"Trainer\(gradient_clip_val=0.5\)` and have passed `clip_gradients\("
                                         r"gradient_clip_val=0.1\)`. Please use only one of them"):
        model.clip_gradients(torch.optim.SGD(model.parameters(), lr=0.1), gradient_clip_val=0.1)


# -- manual optimization: the optimizer's step gets the closure and the keywords ------------------------------------
class _NotingSGD(torch.optim.SGD):
    def __init__(self, params, noted):
        super().__init__(params, lr=0.1)
        self.noted = noted

    def step(self, closure=None, **kwargs):
        self.noted.append(sorted(kwargs))
        return super().step(closure)


class _ManualLBFGS(TrainingModule):
    """Fits y = 3x with L-BFGS, whose step calls the closure several times (Lightning's manual pattern)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.w = nn.Parameter(torch.zeros(1))
        self.other = nn.Parameter(torch.zeros(1))  # the second optimizer's, never given a gradient
        self.closure_calls = 0
        self.noted: list = []

    def training_step(self, batch, batch_idx):
        lbfgs, noting = self.optimizers()
        x = batch[0][:, :1]

        def closure():
            self.closure_calls += 1
            lbfgs.zero_grad()
            loss = (x * self.w - 3 * x).pow(2).mean()
            self.manual_backward(loss)
            return loss

        loss = lbfgs.step(closure=closure)
        noting.step(closure=lambda: None, tag="sgd")  # keywords go to the optimizer's step
        return loss

    def configure_optimizers(self):
        return [torch.optim.LBFGS([self.w], lr=1, max_iter=20), _NotingSGD([self.other], self.noted)]


@pytest.mark.timeout(60)
def test_a_manual_optimizers_step_hands_the_closure_and_keywords_to_the_optimizer(tmp_path):
    model = _ManualLBFGS()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "_NotingSGD.step.. on rank 0 with no gradients")
        _trainer(tmp_path, max_steps=2, num_sanity_val_steps=0).fit(model, _loader(4, batch_size=4))
    assert model.closure_calls > 2  # L-BFGS called it several times within one step
    assert abs(float(model.w) - 3.0) < 1e-3
    assert model.noted == [["tag"]]


class _StopsEveryEpoch(Callback):
    def on_train_epoch_end(self, trainer, module):
        trainer.should_stop = True


@pytest.mark.timeout(60)
def test_min_epochs_holding_a_stop_back_is_said_once(tmp_path, caplog):
    import logging

    trainer = _trainer(tmp_path, max_epochs=10, min_epochs=3, num_sanity_val_steps=0, callbacks=[_StopsEveryEpoch()])
    with caplog.at_level(logging.INFO, logger="trainscale.loop.trainer"):
        trainer.fit(Probe(), _loader(4))
    assert trainer.current_epoch == 3
    said = [r.message for r in caplog.records if "has not been met" in r.message]
    assert said == ["Trainer was signaled to stop but the required `min_epochs=3` or `min_steps=None` has not been "
                    "met. Training will continue..."]


class _RandomData(Probe):
    """Draws its training and validation sets from the random state, as Lightning's BoringModel does."""

    def __init__(self):
        super().__init__()
        self.asked: list[str] = []

    def train_dataloader(self):
        self.asked.append("train")
        self.train_inputs = torch.randn(4, 2)
        return DataLoader(TensorDataset(self.train_inputs, torch.zeros(4)), batch_size=2)

    def val_dataloader(self):
        self.asked.append("val")
        self.val_inputs = torch.randn(4, 2)
        return DataLoader(TensorDataset(self.val_inputs, torch.zeros(4)), batch_size=2)


@pytest.mark.timeout(60)
def test_fit_asks_for_the_validation_loader_first_with_the_random_state_put_back(tmp_path):
    model = _RandomData()
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(model)
    assert model.asked == ["val", "train"]  # Lightning's order (its sanity check asks for validation data first)
    assert torch.equal(model.train_inputs, model.val_inputs)  # both drawn from the same random state


# -- the module's print, dtype and toggle_optimizer -----------------------------------------------------------------
@pytest.mark.timeout(60)
def test_print_dtype_and_toggle_optimizer_with_the_torch_optimizer(tmp_path, capsys):
    class Printing(TwoOptimizers):
        def training_step(self, batch, batch_idx):
            first, second = self.optimizers(use_pl_optimizer=False)  # the torch optimizers, as Lightning allows
            self.toggle_optimizer(first)
            frozen = [p.requires_grad for p in self.other.parameters()]
            self.untoggle_optimizer(first)
            self.print(f"step {batch_idx}: other frozen {frozen}, dtype {self.dtype}", end="|")
            super().training_step(batch, batch_idx)

    model = Printing()
    assert model.dtype == torch.float32 and model.double().dtype == torch.float64
    model.float()
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model, _loader(4))
    out = capsys.readouterr().out
    assert "step 0: other frozen [False, False], dtype torch.float32|" in out and "step 1:" in out
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match=r"toggle_optimizer\(SGD\) takes one of self.optimizers\(\)"):
        model.toggle_optimizer(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))


# -- trainer.estimated_stepping_batches ---------------------------------------------------------------------------------
class _OneCycle(Probe):
    """Lightning's recipe: a ``OneCycleLR`` sized by ``estimated_stepping_batches`` in ``configure_optimizers`` (it
    raises when stepped more often than ``total_steps``)."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        self.estimated = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=self.estimated)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, samples, expected", [
    ({"max_epochs": 2}, 8, 8),  # 4 batches of 2, twice
    ({"max_epochs": 2, "accumulate_grad_batches": 3}, 10, 4),  # 5 batches: steps after 3 and after the last 2
    ({"max_epochs": 2, "limit_train_batches": 3}, 10, 6),
    ({"max_epochs": 10, "max_steps": 5}, 8, 5),
    ({"max_steps": 3}, 8, 3),  # no epoch limit
])
def test_estimated_stepping_batches_is_read_in_configure_optimizers_and_is_the_steps_fit_takes(tmp_path, flags,
                                                                                               samples, expected):
    model = _OneCycle()
    trainer = _trainer(tmp_path, num_sanity_val_steps=0, **flags)
    trainer.fit(model, _loader(samples))
    assert model.estimated == expected == trainer.global_step
    assert trainer.estimated_stepping_batches == expected  # after fit too


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([(torch.ones(2), torch.zeros(())) for _ in range(6)])


@pytest.mark.timeout(60)
def test_estimated_stepping_batches_of_an_iterable_loader_and_of_endless_training_is_lightnings(tmp_path):
    assert _trainer(tmp_path, max_epochs=-1).estimated_stepping_batches == math.inf
    assert _trainer(tmp_path, max_epochs=-1, max_steps=7).estimated_stepping_batches == 7
    with pytest.raises(RuntimeError, match="configure_optimizers"):
        _trainer(tmp_path, max_epochs=1).estimated_stepping_batches  # no training loader yet
    noted = []

    class Noting(Probe):
        def configure_optimizers(self):
            noted.append(self.trainer.estimated_stepping_batches)
            return super().configure_optimizers()

    _trainer(tmp_path, max_steps=2, max_epochs=3).fit(Noting(), DataLoader(_Stream(), batch_size=2))
    _trainer(tmp_path, max_epochs=1).fit(Noting(), DataLoader(_Stream(), batch_size=2))
    assert noted == [2, -1]  # an iterable's length is unknown: max_steps, -1 without it (Lightning's value)


class _UsesStrategy(_OneCycle):
    """Calls Lightning's ``self.trainer.strategy`` collectives in ``on_train_start``, as user code does."""

    def on_train_start(self):
        strategy = self.trainer.strategy
        rank = strategy.global_rank
        strategy.barrier()
        strategy.barrier("named")
        x = torch.tensor([float(rank + 1)], requires_grad=True)
        gathered = strategy.all_gather(x, sync_grads=True)  # (2, 1): every rank's x
        (gathered[:, 0] * torch.tensor([1.0, 10.0])).sum().backward()  # each x's gradient, summed over the ranks
        self.seen = {
            "broadcast": strategy.broadcast({"from": rank}, src=1),
            "sum": strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item(),
            "mean": strategy.reduce(torch.tensor(float(rank + 1))).item(),  # Lightning's default: "mean"
            "max": strategy.reduce(torch.tensor(rank + 1), reduce_op="max").item(),
            "not_a_tensor": strategy.reduce(3.0),
            "gathered": gathered.detach().tolist(), "grad": x.grad.tolist(),
            "places": (strategy.world_size, rank, strategy.local_rank, strategy.is_global_zero,
                       str(strategy.root_device)),
            "modules": (strategy.lightning_module is self, type(strategy.model).__name__),
        }
        mine = self.all_gather({"n": rank, "pair": (torch.tensor([float(rank), 1.0]),)})  # the module's, nested
        self.seen["module_gather"] = (mine["n"].tolist(), type(mine["pair"]).__name__, mine["pair"][0].tolist())


def _fit_on_two_ranks(rank: int, root: str) -> dict:
    from trainscale.utilities import rank_zero_only

    rank_zero_only.rank = 0  # as a forked rank inherits it: Runtime.launch sets this process's rank
    trainer = Trainer(accelerator="cpu", devices="auto", strategy="ddp", timeout=60, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=root, max_epochs=2,
                      accumulate_grad_batches=2, num_sanity_val_steps=0)
    try:
        model = _UsesStrategy()
        trainer.fit(model, _loader(10))
        said = rank_zero_only(lambda: "said", default="quiet")()
        return {"estimated": model.estimated, "steps": trainer.global_step, "rank_zero_only": (rank_zero_only.rank, said),
                **model.seen}
    finally:
        trainer.runtime.teardown()


@pytest.fixture(scope="module")
def two_rank_fit(tmp_path_factory):
    """One 2-rank ddp fit of :class:`_UsesStrategy` (gloo), its ranks' results."""
    from tests.helpers import run_distributed

    return run_distributed(_fit_on_two_ranks, str(tmp_path_factory.mktemp("two_ranks")), timeout=100)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_estimated_stepping_batches_counts_this_ranks_share_on_two_ranks(two_rank_fit):
    # 10 samples: 5 per rank, 3 batches of 2, 2 optimizer steps per epoch (one process: 5 batches, 3 steps)
    for rank in two_rank_fit:
        assert (rank["estimated"], rank["steps"]) == (4, 4)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_strategys_collectives_work_from_a_hook_on_two_ranks(two_rank_fit):
    for rank, seen in enumerate(two_rank_fit):
        assert seen["broadcast"] == {"from": 1}
        assert (seen["sum"], seen["mean"], seen["max"], seen["not_a_tensor"]) == (3.0, 1.5, 2, 3.0)
        assert seen["gathered"] == [[1.0], [2.0]]
        assert seen["grad"] == [2.0 if rank == 0 else 20.0]  # d/dx of both ranks' losses: 1 + 1, 10 + 10
        assert seen["places"] == (2, rank, rank, rank == 0, "cpu")
        assert seen["modules"] == (True, "DistributedDataParallel")
        assert seen["rank_zero_only"] == (rank, "said" if rank == 0 else "quiet")
        assert seen["module_gather"] == ([0, 1], "tuple", [[0.0, 1.0], [1.0, 1.0]])


@pytest.mark.timeout(60)
def test_trainer_strategy_exists_from_trainer_and_its_collectives_pass_through_on_one_process(tmp_path):
    trainer = _trainer(tmp_path, max_steps=1, num_sanity_val_steps=0)
    strategy = trainer.strategy
    assert (strategy.world_size, strategy.global_rank, strategy.local_rank, strategy.is_global_zero) == (0 + 1, 0, 0,
                                                                                                          True)
    assert strategy.root_device == torch.device("cpu")
    assert strategy.model is None and strategy.lightning_module is None  # no model yet, as Lightning's
    t = torch.tensor([1.0, 2.0])
    assert strategy.reduce(t, reduce_op="sum") is t and strategy.all_gather(t) is t  # no process group: as given
    assert strategy.broadcast("x") == "x" and strategy.barrier() is None
    model = Probe()
    trainer.fit(model, _loader(4))
    assert strategy.lightning_module is model and trainer.strategy is strategy
    gathered = model.all_gather({"n": 3, "t": [t]})  # one process: as given, the number made a tensor
    assert torch.equal(gathered["n"], torch.tensor(3)) and gathered["t"][0] is t
    spawning = _trainer(tmp_path, strategy="ddp_spawn", devices=2)
    with pytest.raises(AttributeError, match="exists in the ranks that fit/validate/test/predict start"):
        spawning.strategy


# -- detect_anomaly ----------------------------------------------------------------------------------------------------
class _NanGradient(Probe):
    """A finite loss whose backward makes NaN (sqrt's gradient at 0 times 0), and a note of the anomaly mode."""

    def training_step(self, batch, batch_idx):
        self.mode_inside = torch.is_anomaly_enabled()
        return (self.layer(batch[0]) * 0).sqrt().sum()


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:Error detected in SqrtBackward0")  # torch's note of the forward's traceback
def test_detect_anomaly_names_the_operation_that_made_nan_and_restores_the_mode(tmp_path, caplog):
    import logging

    assert not torch.is_anomaly_enabled()
    model = _NanGradient()
    _trainer(tmp_path, max_steps=1, num_sanity_val_steps=0).fit(model, _loader(4))  # NaN gradients, unnoticed
    assert model.mode_inside is False
    with caplog.at_level(logging.INFO, logger="trainscale.loop.trainer"):
        trainer = _trainer(tmp_path, max_steps=1, num_sanity_val_steps=0, detect_anomaly=True)
    assert "You have turned on `Trainer(detect_anomaly=True)`" in caplog.text
    with pytest.raises(RuntimeError, match="'SqrtBackward0' returned nan values"):
        trainer.fit(model, _loader(4))
    assert model.mode_inside is True and not torch.is_anomaly_enabled()  # off again after the error
    torch.autograd.set_detect_anomaly(True)
    try:
        with pytest.raises(RuntimeError, match="returned nan values"):
            trainer.fit(model, _loader(4))
        assert torch.is_anomaly_enabled()  # the mode it found is restored
    finally:
        torch.autograd.set_detect_anomaly(False)


# -- Lightning's ddp spellings with find_unused_parameters ----------------------------------------------------------
@pytest.mark.parametrize("name, start_method, value", [
    ("ddp_find_unused_parameters_true", None, True), ("ddp_find_unused_parameters_false", None, False),
    ("ddp_spawn_find_unused_parameters_true", "spawn", True), ("ddp_spawn_find_unused_parameters_false", "spawn", False),
    ("ddp_notebook_find_unused_parameters_true", "fork", True), ("ddp_fork_find_unused_parameters_false", "fork", False),
])
def test_lightnings_find_unused_parameters_names_are_ddp_with_the_option(name, start_method, value):
    from trainscale.runtime.connector import resolve
    from trainscale.runtime.flags import RuntimeFlags
    from trainscale.runtime.strategies.ddp import DDPStrategy

    config = resolve(accelerator="cpu", devices=2, strategy=name)
    assert (config.strategy, config.start_method) == ("ddp", start_method)
    flags = RuntimeFlags(strategy=name)
    assert config.strategy_class.options_from({"static_graph": False}, config, flags) == {
        "static_graph": False, "find_unused_parameters": value}
    with pytest.raises(ValueError, match=f"strategy='{name}' sets find_unused_parameters={value}, but strategy_options"):
        DDPStrategy.options_from({"find_unused_parameters": not value}, config, flags)
    assert DDPStrategy.options_from(None, config, RuntimeFlags(strategy="ddp")) == {}  # "ddp" leaves it off


class _Unused(Probe):
    """A parameter no step uses: DDP's reducer waits for its gradient unless ``find_unused_parameters``."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(2, 1)


def _unused_on_two_ranks(rank: int, root: str, strategy) -> dict | str:
    from trainscale.strategies import DDPStrategy, ParallelStrategy

    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=root, max_steps=2,
                      num_sanity_val_steps=0)
    try:
        model = _Unused()
        trainer.fit(model, _loader(8))
        s = trainer.strategy
        return {"find_unused": s.model.find_unused_parameters, "steps": trainer.global_step,
                "classes": (isinstance(s, DDPStrategy), isinstance(s, ParallelStrategy)),
                "counts": (s.num_processes, s.num_nodes), "timeout": trainer.runtime.timeout,
                "unused_grad": model.unused.weight.grad}
    except RuntimeError as err:
        return str(err)
    finally:
        trainer.runtime.teardown()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ddp_find_unused_parameters_true_trains_a_model_with_an_unused_parameter_on_two_ranks(tmp_path):
    from tests.helpers import run_distributed

    ranks = run_distributed(_unused_on_two_ranks, str(tmp_path), "ddp_find_unused_parameters_true", timeout=100)
    assert [(r["find_unused"], r["steps"]) for r in ranks] == [(True, 2)] * 2
    refused = run_distributed(_unused_on_two_ranks, str(tmp_path), "ddp", timeout=100)
    assert all("Expected to have finished reduction" in err for err in refused)  # what the option is for


# -- Lightning's strategy objects: Trainer(strategy=DDPStrategy(...)) -------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_ddp_strategy_object_with_find_unused_parameters_trains_a_model_with_an_unused_parameter(tmp_path):
    """Lightning's ``Trainer(strategy=DDPStrategy(find_unused_parameters=True))`` on two gloo ranks: the Trainer's own
    bound strategy is a DDPStrategy and a ParallelStrategy, with the option and the timeout the object was built
    with; without the option DDP's reducer refuses the parameter that gets no gradient."""
    from datetime import timedelta

    from tests.helpers import run_distributed
    from trainscale.strategies import DDPStrategy

    given = DDPStrategy(find_unused_parameters=True, timeout=timedelta(minutes=1))
    ranks = run_distributed(_unused_on_two_ranks, str(tmp_path), given, timeout=100)
    assert ranks == [{"find_unused": True, "steps": 2, "classes": (True, True), "counts": (2, 1), "timeout": 60.0,
                      "unused_grad": None}] * 2
    refused = run_distributed(_unused_on_two_ranks, str(tmp_path), DDPStrategy(), timeout=100)
    assert all("Expected to have finished reduction" in err for err in refused)


@pytest.mark.timeout(60)
def test_a_single_device_strategy_object_runs_one_process(tmp_path):
    from trainscale.strategies import ParallelStrategy, SingleDeviceStrategy

    trainer = _trainer(tmp_path, strategy=SingleDeviceStrategy(), devices=1, max_steps=2, num_sanity_val_steps=0,
                       enable_checkpointing=False, logger=False)
    trainer.fit(Probe(), _loader())
    assert isinstance(trainer.strategy, SingleDeviceStrategy) and not isinstance(trainer.strategy, ParallelStrategy)
    assert (trainer.global_step, trainer.runtime.flags.strategy, trainer.strategy.world_size) == (2, "single", 1)


# -- trainer.training / validating / testing / predicting, num_devices, device_ids ------------------------------------
class _Stages(Callback):
    """Notes Lightning's stage flags at each hook it implements."""

    def __init__(self):
        self.seen: dict[str, tuple] = {}

    def _note(self, hook, trainer):
        self.seen.setdefault(hook, (trainer.training, trainer.sanity_checking, trainer.validating, trainer.testing,
                                    trainer.predicting))

    def on_sanity_check_start(self, trainer, module):
        self._note("sanity", trainer)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._note("train_batch", trainer)

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self._note("sanity_batch" if trainer.sanity_checking else "fit_validation" if trainer.fitting else "validate",
                   trainer)

    def on_train_epoch_end(self, trainer, module):
        self._note("train_epoch_end", trainer)

    def on_test_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self._note("test", trainer)

    def on_predict_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self._note("predict", trainer)


class _AllSteps(ValBoth):
    def test_step(self, batch, batch_idx):
        self.log("tb", float(batch_idx))

    def predict_step(self, batch, batch_idx):
        return batch[0]


@pytest.mark.timeout(60)
def test_the_stage_flags_say_what_runs_as_lightnings(tmp_path):
    stages = _Stages()
    trainer = _trainer(tmp_path, max_epochs=1, callbacks=[stages])
    model = _AllSteps()
    trainer.fit(model, _loader(4), _loader(4))
    assert (trainer.training, trainer.validating) == (False, False)  # after fit
    trainer.validate(model, _loader(4), verbose=False)
    trainer.test(model, _loader(4), verbose=False)
    trainer.predict(model, _loader(4))
    #                   training, sanity_checking, validating, testing, predicting
    assert stages.seen == {"sanity": (False, True, False, False, False),
                           "sanity_batch": (False, True, False, False, False),
                           "train_batch": (True, False, False, False, False),
                           "fit_validation": (False, False, True, False, False),
                           "train_epoch_end": (True, False, False, False, False),
                           "validate": (False, False, True, False, False),
                           "test": (False, False, False, True, False),
                           "predict": (False, False, False, False, True)}
    assert not any((trainer.training, trainer.validating, trainer.testing, trainer.predicting))
    trainer.testing = True  # Lightning's setters: one stage at a time
    assert trainer.testing and trainer.state.stage == "test"
    trainer.training = False  # not the running one: no change
    assert trainer.testing
    trainer.testing = False
    assert trainer.state.stage is None


@pytest.mark.timeout(60)
def test_num_devices_and_device_ids_count_this_nodes_devices(tmp_path):
    trainer = _trainer(tmp_path)
    assert (trainer.num_devices, trainer.device_ids) == (1, [0])
    spawning = _trainer(tmp_path, strategy="ddp_spawn", devices=2)  # no process started until fit
    assert (spawning.num_devices, spawning.device_ids) == (2, [0, 1])


# -- trainscale.utilities: rank_zero_only and the rank_zero_* messages -----------------------------------------------
def test_rank_zero_only_runs_on_rank_zero_and_returns_the_default_elsewhere(monkeypatch):
    from trainscale.utilities import rank_zero_only

    calls = []

    @rank_zero_only
    def noted(x):
        calls.append(x)
        return x * 2

    assert rank_zero_only.rank == 0  # this test process: no launcher
    assert noted(3) == 6 and calls == [3] and noted.__name__ == "noted"
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert noted(4) is None and rank_zero_only(lambda: 1, default=-1)() == -1 and calls == [3]
    monkeypatch.setattr(rank_zero_only, "rank", None)
    with pytest.raises(RuntimeError, match="rank_zero_only.rank is None"):
        noted(5)


@pytest.mark.parametrize("env, rank", [({"RANK": "3", "LOCAL_RANK": "1"}, 3), ({"LOCAL_RANK": "1", "SLURM_PROCID": "5"}, 1),
                                       ({"SLURM_PROCID": "5"}, 5), ({"JSM_NAMESPACE_RANK": "2"}, 2), ({}, 0)])
def test_the_rank_is_read_from_the_launchers_variables_in_lightnings_order(env, rank):
    from trainscale.utilities.rank_zero import launcher_rank

    assert launcher_rank(env) == rank


def test_rank_zero_only_rank_is_set_from_rank_when_imported(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "RANK": "2", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", "import trainscale.utilities as u; print(u.rank_zero_only.rank)"],
                         env=env, capture_output=True, text=True, timeout=60, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "2"


def test_rank_zero_messages_are_said_on_rank_zero_only_and_name_their_caller(monkeypatch, caplog):
    import logging

    from trainscale.utilities import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn

    with caplog.at_level(logging.DEBUG, logger="trainscale.utilities.rank_zero"):
        rank_zero_info("epoch %d done", 3)
        rank_zero_debug("details")
    assert [(r.levelname, r.getMessage(), r.funcName) for r in caplog.records] == [
        ("INFO", "epoch 3 done", "test_rank_zero_messages_are_said_on_rank_zero_only_and_name_their_caller"),
        ("DEBUG", "details", "test_rank_zero_messages_are_said_on_rank_zero_only_and_name_their_caller")]
    with pytest.warns(UserWarning, match="careful") as warned:
        rank_zero_warn("careful")
    assert warned[0].filename == __file__
    with pytest.warns(DeprecationWarning):
        rank_zero_warn("old", category=DeprecationWarning)
    caplog.clear()
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with caplog.at_level(logging.DEBUG, logger="trainscale.utilities.rank_zero"), warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would raise
        rank_zero_info("no")
        rank_zero_debug("no")
        rank_zero_warn("no")
    assert caplog.records == []


# -- several evaluation loaders: Lightning's "sequential" CombinedLoader, /dataloader_idx_N ------------------------------
def _values(values):
    """A loader of one feature per sample, in batches of 2 (the last one smaller for an odd count)."""
    x = torch.tensor(values, dtype=torch.float32).reshape(-1, 1)
    return DataLoader(TensorDataset(x, torch.zeros(len(values))), batch_size=2)


SET_A, SET_B = [0.5, 1.0, 4.0, -2.0, 7.5], [10.0, 30.0, 50.0]  # 3 and 2 batches; the means by hand: 2.2 and 30.0


class _TwoSets(TrainingModule):
    """Logs each batch's mean feature as "val_x"/"test_x" (sample-weighted by the batch's length) and, in
    ``on_validation_epoch_end``, a constant; notes what its steps and batch hooks are given."""

    def __init__(self, loaders=None):
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.loaders = loaders
        self.steps: list[tuple] = []
        self.hook_args: list[tuple] = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx, dataloader_idx="not given"):
        self.steps.append(("validation", batch_idx, dataloader_idx))
        self.log("val_x", batch[0].mean())

    def test_step(self, batch, batch_idx, dataloader_idx="not given"):
        self.log("test_x", batch[0].mean())

    def predict_step(self, batch, batch_idx, dataloader_idx="not given"):
        self.steps.append(("predict", batch_idx, dataloader_idx))
        return batch[0] * 2

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.hook_args.append((batch_idx, dataloader_idx))

    def on_validation_epoch_end(self):
        self.log("val_end", 3.0)

    def val_dataloader(self):
        return self.loaders

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights stay: every validation sees the same model


class _Records(_Recorder):
    def __init__(self):
        super().__init__()
        self.metrics: list[dict] = []

    def log_metrics(self, metrics, step):
        self.metrics.append(dict(metrics))


class _SeesBatches(Callback):
    def __init__(self):
        self.starts: list[tuple] = []

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self.starts.append((trainer.sanity_checking, batch_idx, dataloader_idx))


@pytest.mark.timeout(60)
def test_two_validation_loaders_log_each_loaders_mean_under_its_dataloader_idx(tmp_path):
    records, watch = _Records(), _SeesBatches()
    model = _TwoSets()
    trainer = _trainer(tmp_path, max_epochs=1, logger=records, callbacks=[watch], num_sanity_val_steps=1)
    trainer.fit(model, _values(SET_A), val_dataloaders=[_values(SET_A), _values(SET_B)])
    mean_a, mean_b = float(np.mean(SET_A)), float(np.mean(SET_B))
    # callback_metrics, the epoch record, and the loggers (which name an epoch record's fields "epoch/<name>")
    for where, prefix in ((trainer.callback_metrics, ""), (trainer.history[-1], ""), (records.metrics[-1], "epoch/")):
        assert float(where[f"{prefix}val_x/dataloader_idx_0"]) == pytest.approx(mean_a)
        assert float(where[f"{prefix}val_x/dataloader_idx_1"]) == pytest.approx(mean_b)
        assert f"{prefix}val_x" not in where and float(where[f"{prefix}val_end"]) == 3.0  # an epoch hook's: no suffix
    assert trainer.num_val_batches == [3, 2]
    # the sanity check ran num_sanity_val_steps=1 batch of each loader, then every batch of each, in turn
    assert watch.starts == [(True, 0, 0), (True, 0, 1), (False, 0, 0), (False, 1, 0), (False, 2, 0), (False, 0, 1),
                            (False, 1, 1)]
    assert [s[2] for s in model.steps] == [0, 1, 0, 0, 0, 1, 1]  # the step's third argument
    assert model.hook_args == [(0, 0), (0, 1), (0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]


@pytest.mark.timeout(60)
def test_validate_and_test_return_one_dict_per_loader_and_predict_one_list_per_loader(tmp_path):
    model, trainer = _TwoSets(), _trainer(tmp_path, limit_test_batches=1, limit_predict_batches=2)
    expected = [{"val_x/dataloader_idx_0": pytest.approx(np.mean(SET_A)), "val_end": 3.0},
                {"val_x/dataloader_idx_1": pytest.approx(np.mean(SET_B)), "val_end": 3.0}]
    assert trainer.validate(model, {"first": _values(SET_A), "second": _values(SET_B)}, verbose=False) == expected
    hooked = _TwoSets([_values(SET_A), _values(SET_B)])  # val_dataloader() returning a list
    assert trainer.validate(hooked, verbose=False) == expected
    labelled = [DataLoader(TensorDataset(torch.randn(n, 3), torch.arange(n) % 2), batch_size=2) for n in (5, 3)]
    plain = nn.Linear(3, 2)  # a plain model and loss: trainscale's val_loss and val_accuracy, per loader
    [first, second] = trainer.validate(plain, labelled, loss_fn=nn.functional.cross_entropy, verbose=False)
    for i, (results, loader) in enumerate(((first, labelled[0]), (second, labelled[1]))):
        x, y = loader.dataset.tensors
        with torch.no_grad():
            by_hand = float(nn.functional.cross_entropy(plain(x), y))  # the whole set at once
        assert results[f"val_loss/dataloader_idx_{i}"] == pytest.approx(by_hand)
    tested = trainer.test(model, (_values(SET_A), _values(SET_B)), verbose=False)  # a tuple; one batch of each
    assert tested == [{"test_x/dataloader_idx_0": pytest.approx(np.mean(SET_A[:2]))},
                      {"test_x/dataloader_idx_1": pytest.approx(np.mean(SET_B[:2]))}]
    assert trainer.num_test_batches == [1, 1]
    model.steps.clear()
    predictions = trainer.predict(model, [_values(SET_A), _values(SET_B)])
    assert trainer.num_predict_batches == [2, 2]
    assert len(predictions) == 2 and [len(p) for p in predictions] == [2, 2]
    assert torch.cat(predictions[0]).flatten().tolist() == [2 * v for v in SET_A[:4]]
    assert torch.cat(predictions[1]).flatten().tolist() == [2 * v for v in SET_B]
    assert [s[2] for s in model.steps] == [0, 0, 1, 1]


@pytest.mark.timeout(60)
def test_one_loader_passes_no_dataloader_idx_and_keeps_the_plain_names(tmp_path):
    model, trainer = _TwoSets(), _trainer(tmp_path)
    assert trainer.validate(model, [_values(SET_A)], verbose=False) == [  # a list of one: one loader
        {"val_x": pytest.approx(np.mean(SET_A)), "val_end": 3.0}]
    assert {s[2] for s in model.steps} == {"not given"} and {h[1] for h in model.hook_args} == {0}
    assert len(trainer.predict(model, _values(SET_A))) == 3  # one list of per-batch outputs, not a list of lists
    assert trainer.num_predict_batches == [3]  # Lightning's list, one entry per loader


class _OwnNames(_TwoSets):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log(f"x_of_{dataloader_idx}", batch[0].mean(), add_dataloader_idx=False)
        self.log("shared", 1.0, add_dataloader_idx=False)


class _NoIndex(_TwoSets):
    def validation_step(self, batch, batch_idx, dataloader_idx):
        self.log("val_x", batch[0].mean())


@pytest.mark.timeout(60)
def test_add_dataloader_idx_false_keeps_the_name_and_lightnings_refusals_name_the_fix(tmp_path):
    trainer = _trainer(tmp_path)
    with pytest.raises(ValueError, match=r"'shared'.*in dataloader 0 and in dataloader 1.*its own name"):
        trainer.validate(_OwnNames(), [_values(SET_A), _values(SET_B)], verbose=False)

    class Distinct(_OwnNames):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log(f"x_of_{dataloader_idx}", batch[0].mean(), add_dataloader_idx=False)

    results = trainer.validate(Distinct(), [_values(SET_A), _values(SET_B)], verbose=False)
    assert results == [{"x_of_0": pytest.approx(np.mean(SET_A)), "val_end": 3.0},
                       {"x_of_1": pytest.approx(np.mean(SET_B)), "val_end": 3.0}]
    with pytest.raises(RuntimeError, match=r"only a single `val_dataloader`, but have included `dataloader_idx` in "
                                           r"`_NoIndex.validation_step\(\)`.*`dataloader_idx=0`"):
        trainer.validate(_NoIndex(), _values(SET_A), verbose=False)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # fsdp: the rank with fewer batches of a loader adds forwards
def test_two_loaders_on_two_ranks_give_the_single_process_values(tmp_path, strategy):
    from tests import module_workers as mw
    from tests.helpers import run_distributed

    one = mw.two_loaders_body(0, SET_A, SET_B, str(tmp_path / "one"))  # one process: the reference
    ranks = run_distributed(mw.two_loaders_body, SET_A, SET_B, str(tmp_path / "two"), strategy, timeout=80)
    assert one["validate"][0]["val_x/dataloader_idx_0"] == pytest.approx(np.mean(SET_A))
    assert one["validate"][1]["val_x/dataloader_idx_1"] == pytest.approx(np.mean(SET_B))
    for out in ranks:
        assert out["validate"] == [{k: pytest.approx(v) for k, v in r.items()} for r in one["validate"]]
        assert out["predict"] == one["predict"]  # each loader's predictions in dataset order
    assert [r["num_val_batches"] for r in ranks] == [[2, 1], [1, 1]]  # SET_A: 3 + 2 samples; SET_B: 2 + 1


def test_cli_lightning_logo_prints_one_line_on_rank_zero_only(capsys, monkeypatch):
    """Lightning's examples call ``cli_lightning_logo()`` first; ``import lightning.pytorch as pl`` ports to trainscale."""
    trainscale.cli_lightning_logo()
    assert capsys.readouterr().out == f"trainscale {trainscale.__version__}\n"
    monkeypatch.setenv("RANK", "1")
    trainscale.cli_lightning_logo()
    assert capsys.readouterr().out == ""


def test_get_torchvision_model_builds_through_torchvision_or_names_the_install(monkeypatch):
    import sys
    import types

    from trainscale.utilities.model_helpers import get_torchvision_model

    monkeypatch.setitem(sys.modules, "torchvision", None)  # not installed: the import fails
    with pytest.raises(ModuleNotFoundError, match=r"needs torchvision: pip install torchvision"):
        get_torchvision_model("resnet18")
    built = []
    fake = types.ModuleType("torchvision")
    fake.models = types.SimpleNamespace(get_model=lambda name, **kwargs: built.append((name, kwargs)) or nn.Linear(1, 1))
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    assert isinstance(get_torchvision_model("resnet18", weights=None, num_classes=3), nn.Linear)
    assert built == [("resnet18", {"weights": None, "num_classes": 3})]


# -- the loggers' Lightning arguments and directories, and trainer.log_dir -------------------------------------------
def test_lightnings_common_logger_lines_construct_with_lightnings_directories(tmp_path, monkeypatch):
    import importlib.util

    from trainscale.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

    monkeypatch.chdir(tmp_path)
    logger = CSVLogger("logs", name="my_exp_name")
    assert (logger.log_dir, logger.root_dir, logger.save_dir) == ("logs/my_exp_name/version_0", "logs/my_exp_name",
                                                                  "logs")
    if importlib.util.find_spec("tensorboard"):
        assert TensorBoardLogger("tb_logs", name="my_model", version=3).log_dir == "tb_logs/my_model/version_3"
        assert TensorBoardLogger(save_dir=".", default_hp_metric=False).log_dir == "./lightning_logs/version_0"
    if importlib.util.find_spec("mlflow"):
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        mlflow_logger = MLFlowLogger(experiment_name="lightning_logs", tracking_uri="file:./ml-runs", log_model=False)
        assert (mlflow_logger.name, mlflow_logger.version) == (None, None)  # the experiment and run: at setup
    if importlib.util.find_spec("wandb"):
        monkeypatch.setenv("WANDB_MODE", "offline")  # no credentials needed to make it
        assert WandbLogger(project="p", log_model=False).name == "p"
    assert not list(tmp_path.iterdir())  # making a logger writes nothing


class _SavesToLogDir(Probe):
    """Saves its own file where ported Lightning code does: ``self.trainer.log_dir``, named by the logger."""

    def on_train_end(self):
        name = f"{self.logger.name}-{self.logger.version}.txt"
        with open(os.path.join(self.trainer.log_dir, name), "w") as f:
            f.write(self.logger.root_dir)


@pytest.mark.timeout(60)
def test_a_module_saves_its_files_into_trainer_log_dir_beside_the_csv_loggers(tmp_path):
    from trainscale.loggers import CSVLogger

    for n in range(2):
        trainer = _trainer(tmp_path / "runs", max_epochs=1, logger=CSVLogger(tmp_path / "logs", name="exp"))
        trainer.fit(_SavesToLogDir(), _loader())
        assert trainer.log_dir == trainer.logger.log_dir == str(tmp_path / "logs" / "exp" / f"version_{n}")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "logs").rglob("*.*")) == [
        "logs/exp/version_0/exp-0.txt", "logs/exp/version_0/metrics.csv",
        "logs/exp/version_1/exp-1.txt", "logs/exp/version_1/metrics.csv"]
    assert (tmp_path / "logs" / "exp" / "version_1" / "exp-1.txt").read_text() == str(tmp_path / "logs" / "exp")


@pytest.mark.timeout(60)
def test_fit_with_a_training_loader_validates_on_the_modules_own_val_dataloader(tmp_path):
    """Lightning's ``fit(model, train_dataloaders=loader)`` takes the validation loader from the module's
    ``val_dataloader()``; a validation loader passed to ``fit`` wins over it."""

    class OwnValidation(Probe):
        def validation_step(self, batch, batch_idx):
            self.log("v", batch[0].sum())

        def val_dataloader(self):
            return _loader(4, batch_size=4)  # one batch: its inputs' sum

    own = _loader(4, batch_size=4)
    expected = float(next(iter(own))[0].sum())
    trainer = _trainer(tmp_path / "hook", max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(OwnValidation(), _loader())
    assert float(trainer.callback_metrics["v"]) == pytest.approx(expected)
    passed = DataLoader(TensorDataset(torch.ones(2, 2), torch.zeros(2)), batch_size=2)
    trainer = _trainer(tmp_path / "passed", max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(OwnValidation(), _loader(), passed)
    assert float(trainer.callback_metrics["v"]) == 4.0


@pytest.mark.timeout(60)
def test_ckpt_path_is_the_checkpoint_each_stage_loaded_as_a_str(tmp_path):
    """Lightning's ``trainer.ckpt_path``: set by ``fit``, ``validate``, ``test`` and ``predict`` to the checkpoint
    they loaded (a str, as ``checkpoint_callback.best_model_path`` is), None when they loaded none."""

    class Evaluated(Probe):
        def validation_step(self, batch, batch_idx):
            self.log("v", 1.0)

        def test_step(self, batch, batch_idx):
            self.log("t", 1.0)

    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    model = Evaluated()
    trainer.fit(model, _loader())
    assert trainer.ckpt_path is None
    trainer.test(model, _loader(4), ckpt_path="best", verbose=False)
    assert trainer.ckpt_path == trainer.checkpoint_callback.best_model_path != ""
    trainer.validate(model, _loader(4), verbose=False)
    assert trainer.ckpt_path is None


def test_a_bad_pl_global_seed_is_an_error_naming_the_variable(monkeypatch):
    from trainscale.checkpointing.rng import fit_seed

    for value in ("forty-two", str(2**32)):
        monkeypatch.setenv("PL_GLOBAL_SEED", value)
        with pytest.raises(ValueError, match=r"PL_GLOBAL_SEED=.* must be an int in \[0, 2\*\*32\)"):
            fit_seed(None)
        with pytest.raises(ValueError, match="PL_GLOBAL_SEED"):
            trainscale.seed_everything()
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    assert fit_seed(None) == 7 and fit_seed(3) == 3


@pytest.mark.timeout(60)
def test_a_callback_logs_through_self_log_into_the_modules_metrics(tmp_path):
    """A callback's ``self.log``/``self.log_dict`` are the module's, attached when the stage sets up (Lightning's
    ``_attach_model_logging_functions``): values logged in its hooks reach ``callback_metrics``."""

    class Logs(Callback):
        def on_train_start(self, trainer, pl_module):
            self.log("started", 1.0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.log_dict({"batch_end": float(batch_idx)})

        def on_train_epoch_end(self, trainer, pl_module):
            self.log("epoch_end", 5.0)

    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=[Logs()])
    trainer.fit(Probe(), _loader())
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["started"] == 1.0 and metrics["batch_end"] == 3.0 and metrics["epoch_end"] == 5.0
    assert not hasattr(Logs(), "log")  # attached to the Trainer's callbacks only


# -- is_overridden, is_picklable and the default predict_step ---------------------------------------------------------
def test_is_overridden_compares_with_the_base_class_and_unwraps_what_lightning_unwraps():
    import functools
    from unittest import mock

    from trainscale.callbacks import Callback
    from trainscale.utilities import is_picklable
    from trainscale.utilities.model_helpers import is_overridden

    model = Probe()  # defines on_train_epoch_start, not on_test_epoch_start
    assert is_overridden("training_step", model) and is_overridden("on_train_epoch_start", model)
    assert not is_overridden("on_test_epoch_start", model) and not is_overridden("predict_step", model)
    assert not is_overridden("on_test_epoch_start", None)
    model.on_train_epoch_start = None  # a hook switched off on the instance is not overridden
    assert not is_overridden("on_train_epoch_start", model)

    class Stopper(Callback):
        def on_fit_end(self, trainer, pl_module):
            pass

    stopper = Stopper()
    assert is_overridden("on_fit_end", stopper) and not is_overridden("on_fit_start", stopper)
    stopper.on_fit_end = functools.partial(Callback.on_fit_end, stopper)  # the base's code again, partly applied
    assert not is_overridden("on_fit_end", stopper)
    stopper.on_fit_end = mock.Mock(wraps=Stopper.on_fit_end)
    assert is_overridden("on_fit_end", stopper)
    with pytest.raises(ValueError, match="parent="):
        is_overridden("forward", nn.Linear(1, 1))
    assert is_overridden("forward", nn.Linear(1, 1), parent=nn.Module)
    assert not is_overridden("prepare_data", model)  # TrainingModule's no-op, not overridden

    class Configured(Probe):
        def configure_model(self):  # a hook TrainingModule defines (a no-op)
            pass

        def train_dataloader(self):  # Lightning's hook, not TrainingModule's: nothing to compare
            return None

    assert is_overridden("configure_model", Configured()) and not is_overridden("configure_model", model)
    with pytest.raises(ValueError, match="defines no train_dataloader"):
        is_overridden("train_dataloader", Configured())
    assert is_picklable({"lr": 0.1}) and not is_picklable(lambda: 0)


def test_the_default_predict_step_calls_the_module_on_the_whole_batch(tmp_path):
    class Doubler(Probe):
        def forward(self, x):
            return 2 * x

    class Shifted(Doubler):
        def predict_step(self, batch, batch_idx):
            return super().predict_step(batch, batch_idx) + 1

    inputs = torch.arange(6.0).reshape(3, 2)
    loader = DataLoader(inputs, batch_size=2)  # batches of inputs only: the default passes each one whole
    predicted = _trainer(tmp_path).predict(Doubler(), loader)
    assert [p.tolist() for p in predicted] == [[[0.0, 2.0], [4.0, 6.0]], [[8.0, 10.0]]]
    shifted = _trainer(tmp_path).predict(Shifted(), loader)
    assert torch.equal(torch.cat(shifted), 2 * inputs + 1)
    assert torch.equal(Doubler().predict_step(batch=inputs), 2 * inputs)


# -- Trainer(plugins=...) and Trainer(barebones=True) ------------------------------------------------------------------
def test_plugins_none_or_empty_are_taken_and_a_plugin_object_names_the_flag_to_use(tmp_path):
    for empty in (None, [], ()):
        _trainer(tmp_path, plugins=empty)

    # stand-ins named as Lightning's base classes: the refusal reads the plugin's class hierarchy
    class Precision:
        pass

    class HalfPrecision(Precision):
        pass

    class ClusterEnvironment:
        pass

    class SLURMEnvironment(ClusterEnvironment):
        pass

    class LayerSync:
        pass

    for plugin, instead in [(HalfPrecision(), r"Trainer\(precision=\.\.\.\)"),
                            ([SLURMEnvironment()], "reads the launcher's variables itself"),
                            (LayerSync(), r"Trainer\(sync_batchnorm=True\)"),
                            ("bitsandbytes", "Precision, CheckpointIO, ClusterEnvironment and LayerSync")]:
        with pytest.raises(ValueError, match=f"trainscale takes no plugins; .*{instead}"):
            _trainer(tmp_path, plugins=plugin)


def test_barebones_turns_off_what_costs_speed_writes_nothing_and_ignores_self_log(tmp_path, caplog):
    import logging

    class Logging(Probe):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("seen", 1.0)
            return loss

    with caplog.at_level(logging.INFO):
        trainer = Trainer(accelerator="cpu", barebones=True, default_root_dir=tmp_path / "root", max_epochs=1)
    assert "You are running in `Trainer(barebones=True)` mode" in caplog.text
    cfg = trainer.config
    assert not (cfg.enable_checkpointing or cfg.enable_progress_bar or cfg.enable_model_summary
                or cfg.enable_telemetry or cfg.writes_files)
    assert cfg.num_sanity_val_steps == 0 and trainer.loggers == [] and trainer.checkpoint_callbacks == []
    assert trainer.progress_bar_callback is None
    assert trainer.barebones is True and _trainer(tmp_path).barebones is False  # Lightning's attribute
    with pytest.warns(UserWarning, match=r"`self.log\(\)` but `Trainer\(barebones=True\)` is configured"):
        trainer.fit(Logging(), _loader())
    assert trainer.global_step == 4 and "seen" not in trainer.callback_metrics
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("flags, named", [
    ({"fast_dev_run": True}, "fast_dev_run=True"), ({"detect_anomaly": True}, "detect_anomaly=True"),
    ({"num_sanity_val_steps": -1}, "num_sanity_val_steps=-1"), ({"checkpoint_every_n_steps": 5},
                                                                "checkpoint_every_n_steps=5"),
    ({"logger": True}, "logger=True"), ({"profiler": "simple"}, "profiler='simple'"),
    ({"callbacks": [ModelCheckpoint()]}, "found `ModelCheckpoint` in callbacks list")])
def test_barebones_refuses_what_it_turns_off_when_given(tmp_path, flags, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        _trainer(tmp_path, barebones=True, **flags)
    _trainer(tmp_path, barebones=True, num_sanity_val_steps=0, logger=False)  # the values it sets itself


# -- trainer.state.fn, trainer.train_dataloader, limit_train_batches=0 ------------------------------------------------
def test_state_fn_names_the_method_running_or_last_run_and_train_dataloader_is_the_fits(tmp_path):
    seen = {}

    class Noting(Probe):
        def on_train_start(self):
            seen["train_start"] = (self.trainer.state.fn, self.trainer.train_dataloader)

        def on_validation_start(self):
            seen.setdefault("validation_start", []).append(self.trainer.state.fn)

        def predict_step(self, batch, batch_idx):
            seen["predict"] = self.trainer.state.fn
            return self.layer(batch[0])

    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    assert trainer.state.fn is None and trainer.train_dataloader is None
    model, loader = Noting(), _loader()
    trainer.fit(model, loader, _loader(4))
    assert seen["train_start"][0] == "fit" and seen["validation_start"] == ["fit"]  # validation inside fit
    assert seen["train_start"][1] is trainer.train_dataloader
    assert list(trainer.train_dataloader) and len(trainer.train_dataloader) == len(loader)
    assert trainer.state.fn == "fit"  # kept after fit returns, as Lightning's
    trainer.validate(model, _loader(4), verbose=False)
    assert seen["validation_start"] == ["fit", "validate"] and trainer.state.fn == "validate"
    trainer.predict(model, _loader(4))
    assert seen["predict"] == "predict" == trainer.state.fn


@pytest.mark.parametrize("zero", [0, 0.0])
def test_limit_train_batches_0_trains_nothing_but_runs_the_sanity_check(tmp_path, zero):
    class Counting(Probe):
        steps = 0
        checked = 0

        def training_step(self, batch, batch_idx):
            self.steps += 1
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            self.checked += 1
            return super().validation_step(batch, batch_idx)

    model = Counting()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(tmp_path, max_epochs=3, limit_train_batches=zero)
    trainer.fit(model, _loader(), _loader(4))
    assert model.steps == 0 and trainer.current_epoch == 0 and trainer.global_step == 0 and trainer.state.finished
    assert model.checked == 2  # the sanity check's two batches, as Lightning runs it
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert trainer.num_training_batches == 0 and trainer.estimated_stepping_batches == 0
    with pytest.raises(ValueError, match="limit_train_batches=-1 must be an int >= 0 .*0 turns training off"):
        _trainer(tmp_path, limit_train_batches=-1)


# -- a training_step that returns None under automatic optimization ---------------------------------------------------
def test_a_training_step_returning_none_skips_that_batchs_backward_as_lightning(tmp_path):
    """Four batches, two micro-batches per step, batch 1 returning None: the first step's gradient is batch 0's
    alone (still divided by the two micro-batches, as Lightning's closure divides it); the second step's both
    batches'. Checked against the same SGD steps in plain PyTorch."""

    class Skipping(Probe):
        def training_step(self, batch, batch_idx):
            return None if batch_idx == 1 else self.layer(batch[0]).pow(2).mean()

    torch.manual_seed(0)
    model = Skipping()
    reference = nn.Linear(2, 1)
    reference.load_state_dict(model.layer.state_dict())
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, accumulate_grad_batches=2)
    with pytest.warns(UserWarning, match="`training_step` returned `None`. If this was on purpose"):
        trainer.fit(model, _loader())
    assert trainer.global_step == 2  # the step of the skipped batch is still taken and counted, as in Lightning

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)  # Probe.configure_optimizers'
    batches = [x for x, _ in _loader()]
    for step in ([batches[0]], [batches[2], batches[3]]):
        for x in step:
            (reference(x).pow(2).mean() / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(model.layer.weight, reference.weight)
    torch.testing.assert_close(model.layer.bias, reference.bias)


@pytest.mark.timeout(120)
def test_a_training_step_returning_none_on_several_ranks_is_lightnings_error():
    from tests import module_workers as mw
    from tests.helpers import run_distributed

    for said in run_distributed(mw.skipped_step_body, timeout=100):
        assert said.startswith("Skipping the `training_step` by returning None in distributed training is not "
                               "supported")


def test_the_trainer_shows_its_flags_under_lightnings_attribute_names():
    """``trainer.accumulate_grad_batches``, ``gradient_clip_val``/``_algorithm``, ``check_val_every_n_epoch``,
    ``val_check_interval`` (1.0 when not given, a duration as a timedelta), ``reload_dataloaders_every_n_epochs``,
    ``overfit_batches`` and ``precision`` in Lightning's spelling, as callbacks and modules read them."""
    from datetime import timedelta

    trainer = Trainer(accelerator="cpu", accumulate_grad_batches=3, gradient_clip_val=0.5,
                      gradient_clip_algorithm="value", precision="bf16-mixed",
                      check_val_every_n_epoch=None, val_check_interval=4, reload_dataloaders_every_n_epochs=2,
                      overfit_batches=5)
    seen = {name: getattr(trainer, name) for name in ("accumulate_grad_batches", "gradient_clip_val",
                                                      "gradient_clip_algorithm", "check_val_every_n_epoch",
                                                      "val_check_interval", "reload_dataloaders_every_n_epochs",
                                                      "overfit_batches", "precision")}
    assert seen == {"accumulate_grad_batches": 3, "gradient_clip_val": 0.5, "gradient_clip_algorithm": "value",
                    "check_val_every_n_epoch": None, "val_check_interval": 4, "reload_dataloaders_every_n_epochs": 2,
                    "overfit_batches": 5, "precision": "bf16-mixed"}
    plain = Trainer(accelerator="cpu")
    assert plain.val_check_interval == 1.0 and plain.check_val_every_n_epoch == 1 and plain.precision == "32-true"
    assert Trainer(accelerator="cpu", val_check_interval="00:00:01:30").val_check_interval == timedelta(seconds=90)


def test_possible_user_warnings_are_one_class_a_script_can_silence(tmp_path):
    """Lightning's ``PossibleUserWarning`` (a ``UserWarning``): the warning of an unset ``max_epochs`` is one, and
    ``disable_possible_user_warnings()`` silences it as Lightning's function does."""
    from trainscale.utilities.warnings import disable_possible_user_warnings

    assert issubclass(PossibleUserWarning, UserWarning)
    with warnings.catch_warnings(record=True) as caught:  # restores the filters after
        warnings.simplefilter("always")
        _trainer(tmp_path / "a", num_sanity_val_steps=0).fit(Probe(), _loader())
        assert any(w.category is PossibleUserWarning and "`max_epochs` was not set" in str(w.message) for w in caught)
        caught.clear()
        disable_possible_user_warnings()
        _trainer(tmp_path / "b", num_sanity_val_steps=0).fit(Probe(), _loader())
        assert not [w for w in caught if w.category is PossibleUserWarning]


class _CallsLogger:
    """A logger (the ``Logger`` protocol) that notes every call made on it."""

    def __init__(self):
        self.calls: list[str] = []

    def setup(self, run_dir):
        self.calls.append("setup")

    def log_hyperparams(self, params):
        self.calls.append("log_hyperparams")

    def log_metrics(self, metrics, step):
        self.calls.append("log_metrics")

    def finalize(self, status):
        self.calls.append("finalize")

    @property
    def experiment(self):
        self.calls.append("experiment")
        return self


def test_fast_dev_run_puts_a_dummy_logger_in_place_of_the_users(tmp_path):
    """Under ``fast_dev_run`` Lightning replaces the loggers by one ``DummyLogger``: ``trainer.logger`` is it, a
    module's ``self.logger.experiment.<anything>(...)`` runs and does nothing, and no method of the user's logger is
    called; without ``fast_dev_run`` the same logger is the Trainer's and is called."""
    from trainscale.loggers import DummyLogger

    class Experimenting(Probe):
        def training_step(self, batch, batch_idx):
            self.logger.experiment.add_histogram("w", self.layer.weight)  # not a method of _CallsLogger
            self.logger[0].experiment.anything_at_all(batch_idx)
            return super().training_step(batch, batch_idx)

    given = _CallsLogger()  # an EarlyStopping on a name never logged is not checked (nor refused) either
    saver, unplaced = ModelCheckpoint(dirpath=tmp_path / "never"), ModelCheckpoint(every_n_epochs=2)
    stopper = EarlyStopping(monitor="never_logged")
    trainer = _trainer(tmp_path, fast_dev_run=2, logger=given, callbacks=[stopper, saver, unplaced])
    assert isinstance(trainer.logger, DummyLogger) and len(trainer.loggers) == 1
    assert trainer.checkpoint_callback is saver  # there, as Lightning's, and saves nothing
    assert trainer.early_stopping_callback is stopper and trainer.early_stopping_callbacks == [stopper]
    trainer.fit(Experimenting(), _loader())
    assert trainer.global_step == 2 and given.calls == [] and trainer.log_dir is None
    assert not (tmp_path / "never").exists()
    # Lightning names a dirpath under fast_dev_run (the DummyLogger's empty name and version) and makes none
    assert saver.dirpath == str(tmp_path / "never") and unplaced.dirpath == str(tmp_path / "checkpoints")
    assert not (tmp_path / "checkpoints").exists()
    assert trainer.logger.name == trainer.logger.version == ""
    assert _trainer(tmp_path, fast_dev_run=True, logger=False).loggers == []  # no logger stays none, as Lightning's
    used = _CallsLogger()
    normal = _trainer(tmp_path, max_steps=1, logger=used)
    assert normal.logger is used
    normal.fit(Probe(), _loader())
    assert "setup" in used.calls and "log_metrics" in used.calls


def test_evaluation_values_logged_on_step_are_in_logged_metrics_not_in_callback_metrics(tmp_path):
    """A value a ``validation_step`` logs ``on_step`` reaches Lightning's ``trainer.logged_metrics`` as ``name_step``
    (the last batch's value; with ``logger=False`` it does not), and not ``callback_metrics``, where only the epoch
    values of an evaluation go; the sanity check's batches are not kept."""

    class StepLogging(Probe):
        def validation_step(self, batch, batch_idx):
            self.log("n", 10.0 + batch_idx, on_step=True, on_epoch=True)
            self.log("only_step", 5.0 + batch_idx, on_step=True, on_epoch=False)
            self.log("hidden", 1.0, on_step=True, on_epoch=False, logger=False)

    trainer = _trainer(tmp_path, max_steps=1, num_sanity_val_steps=1, limit_val_batches=3)
    trainer.fit(StepLogging(), _loader(), _loader())
    logged = trainer.logged_metrics
    assert {"n_step", "n_epoch", "only_step"} <= set(logged) and "hidden" not in logged
    assert float(logged["n_step"]) == 12.0 and float(logged["only_step"]) == 7.0  # the third (last) batch's
    assert float(logged["n_epoch"]) == 11.0
    assert not {"n_step", "only_step", "hidden"} & set(trainer.callback_metrics)
    sanity_only = _trainer(tmp_path, max_steps=0, num_sanity_val_steps=1)
    sanity_only.fit(StepLogging(), _loader(), _loader())
    assert "n_step" not in sanity_only.logged_metrics
    trainer.validate(StepLogging(), _loader(n=4), verbose=False)  # two batches
    assert float(trainer.logged_metrics["n_step"]) == 11.0


@pytest.mark.parametrize(("given", "before", "after"), [({}, None, 1), ({"max_steps": 2}, None, -1),
                                                         ({"max_epochs": 3, "max_steps": 2}, 3, 3),
                                                         ({"max_epochs": -1, "max_steps": 2}, -1, -1)])
def test_max_epochs_reads_as_given_until_fit_resolves_it(tmp_path, given, before, after):
    """``trainer.max_epochs`` is the flag as given until a fit starts (None when not given, as Lightning's), then
    the value the fit resolved it to (trainscale's 1 epoch without ``max_steps``; -1, no limit, with it)."""
    trainer = _trainer(tmp_path, num_sanity_val_steps=0, **given)
    assert trainer.max_epochs == before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PossibleUserWarning)  # the unset max_epochs
        trainer.fit(Probe(), _loader())
    assert trainer.max_epochs == after


def _with_scheduler(model, make_scheduler, **config):
    def configure_optimizers():
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": make_scheduler(opt), **config}}

    model.configure_optimizers = configure_optimizers
    return model


@pytest.mark.parametrize("max_steps", [2, -1])
def test_epoch_schedulers_step_only_after_an_epoch_whose_batches_were_all_seen(tmp_path, max_steps):
    """An ``interval="epoch"`` scheduler steps at the end of an epoch that ran all its batches, and not at the end
    of one ``max_steps`` cut short (4 batches, 2 steps), as Lightning's: a ``ReduceLROnPlateau`` on a metric nobody
    logged is refused only when it would step."""
    steplr = _with_scheduler(Probe(), lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    trainer = _trainer(tmp_path / "a", max_epochs=1, max_steps=max_steps, num_sanity_val_steps=0)
    trainer.fit(steplr, _loader())
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == (0 if max_steps == 2 else 1)
    plateau = _with_scheduler(Probe(), lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
                              monitor="giraffe", strict=True)
    trainer = _trainer(tmp_path / "b", max_epochs=1, max_steps=max_steps, num_sanity_val_steps=0)
    if max_steps == 2:
        trainer.fit(plateau, _loader())
        assert trainer.global_step == 2
    else:
        with pytest.raises(ValueError, match="ReduceLROnPlateau conditioned on metric 'giraffe' which is not available"):
            trainer.fit(plateau, _loader())


def test_lr_scheduler_configs_are_lightnings_lr_scheduler_config(tmp_path):
    """``trainer.lr_scheduler_configs`` holds Lightning's ``LRSchedulerConfig`` (``trainscale.utilities.types``), one
    per scheduler with the dict's keys and Lightning's defaults: ``reduce_on_plateau`` True for a
    ``ReduceLROnPlateau``, which takes the optimizer dict's ``monitor`` when given alone; the key is accepted."""
    from trainscale.lightning.optimizers import parse_optimization
    from trainscale.utilities.types import LRSchedulerConfig

    class TwoSchedulers(Probe):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            steplr = torch.optim.lr_scheduler.StepLR(opt, 1)
            return [opt], [{"scheduler": plateau, "monitor": "idx", "interval": "step", "name": "p"}, steplr]

    trainer = _trainer(tmp_path, max_steps=1, num_sanity_val_steps=0)
    trainer.fit(TwoSchedulers(), _loader())
    plateau, steplr = (config.scheduler for config in trainer.lr_scheduler_configs)
    assert trainer.lr_scheduler_configs == [
        LRSchedulerConfig(plateau, name="p", interval="step", frequency=1, reduce_on_plateau=True, monitor="idx",
                          strict=True),
        LRSchedulerConfig(steplr)]
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    parsed = parse_optimization({"optimizer": opt, "lr_scheduler": plateau, "monitor": "val_loss"})
    assert parsed.schedulers == (LRSchedulerConfig(plateau, reduce_on_plateau=True, monitor="val_loss"),)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reduce_on_plateau is one of Lightning's keys: no "unsupported keys"
        parsed = parse_optimization({"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "m",
                                                                         "reduce_on_plateau": True}})
    assert parsed.schedulers[0].reduce_on_plateau


class _EpochNoted:
    """A scheduler that is not torch's: ``step(epoch)`` notes the epoch (``lr_scheduler_step`` must step it)."""

    def __init__(self, optimizer):
        self.optimizer, self.epochs = optimizer, []

    def step(self, epoch):
        self.epochs.append(epoch)

    def state_dict(self):
        return {"epochs": list(self.epochs)}

    def load_state_dict(self, state):
        self.epochs = list(state["epochs"])


@pytest.mark.timeout(60)
def test_lr_scheduler_step_steps_every_scheduler_and_lets_a_module_use_its_own(tmp_path):
    """The module's ``lr_scheduler_step(scheduler, metric)`` steps each due scheduler (``metric``: the monitored value
    for a ``ReduceLROnPlateau``, else None), in Lightning's order within a step: "step" schedulers, after the epoch's
    last step its "epoch" ones, then the plateau ones; so a scheduler that is not torch's is accepted where the
    module overrides the hook, and refused with Lightning's words where it does not."""
    calls = []

    class OwnStep(Probe):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), "interval": "step"},
                           _EpochNoted(opt),
                           {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=100),
                            "monitor": "idx", "interval": "step"}]

        def lr_scheduler_step(self, scheduler, metric):
            calls.append((type(scheduler).__name__, None if metric is None else float(metric)))
            if isinstance(scheduler, _EpochNoted):
                scheduler.step(epoch=self.current_epoch)
            else:
                super().lr_scheduler_step(scheduler, metric)

    trainer = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(OwnStep(), _loader(4))  # 2 steps an epoch, logging idx 0 and 1
    one_epoch = [("StepLR", None), ("ReduceLROnPlateau", 0.0),
                 ("StepLR", None), ("_EpochNoted", None), ("ReduceLROnPlateau", 1.0)]
    assert calls == one_epoch * 2
    assert trainer.lr_scheduler_configs[1].scheduler.epochs == [0, 1]
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.5 ** 4  # the default hook stepped StepLR

    class NoHook(OwnStep):
        lr_scheduler_step = TrainingModule.lr_scheduler_step

    with pytest.raises(ValueError, match="`_EpochNoted` doesn't follow PyTorch's LRScheduler API. You should override "
                                         "the `LightningModule.lr_scheduler_step` hook"):
        _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0).fit(NoHook(), _loader(4))


@pytest.mark.timeout(60)
def test_epoch_schedulers_step_before_the_epochs_last_checkpoint_which_resumes_exactly(tmp_path):
    """An "epoch" scheduler steps right after the epoch's last optimizer step, before that step's
    ``on_train_batch_end`` and checkpoints (Lightning's order): a checkpoint saved at that step holds the scheduler
    after its epoch step, and a fit resumed from it (the epoch counts as done) takes the learning rates of a fit that
    ran through."""
    seen = []

    class Noting(Probe):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen.append(self.lr_schedulers().last_epoch)

    def model():
        return _with_scheduler(Noting(), lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))

    through = _trainer(tmp_path / "through", max_epochs=3, num_sanity_val_steps=0)
    through.fit(model(), _loader(4))
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2)
    first = _trainer(tmp_path / "first", max_epochs=1, num_sanity_val_steps=0, callbacks=[saving])
    seen.clear()
    first.fit(model(), _loader(4))
    assert seen == [0, 1]  # the epoch's last batch end sees the scheduler stepped
    path = saving.last_model_path or saving.best_model_path
    assert torch.load(path, weights_only=True)["scheduler"]["last_epoch"] == 1
    resumed = _trainer(tmp_path / "resumed", max_epochs=3, num_sanity_val_steps=0)
    resumed.fit(model(), _loader(4), ckpt_path=path)
    assert resumed.optimizers[0].param_groups[0]["lr"] == through.optimizers[0].param_groups[0]["lr"] == 0.5 ** 3


def test_trainer_lightning_module_is_the_strategys_before_any_fit(tmp_path):
    """Before a fit or evaluation ``trainer.lightning_module`` is the module given to ``trainer.strategy.connect``
    (Lightning's reads the strategy's), then the module of the fit."""
    trainer = _trainer(tmp_path, max_steps=1, num_sanity_val_steps=0)
    assert trainer.lightning_module is None
    connected, fitted = Probe(), Probe()
    trainer.strategy.connect(connected)
    assert trainer.lightning_module is connected
    trainer.fit(fitted, _loader())
    assert trainer.lightning_module is fitted


def test_on_save_checkpoint_sees_lightnings_optimizer_and_scheduler_states_which_the_file_holds_once(tmp_path):
    """``on_save_checkpoint`` finds Lightning's ``optimizer_states`` and ``lr_schedulers`` (lists of state dicts); the
    file keeps those states once, under trainscale's keys, so the two lists are not in it."""
    seen = {}

    class Saving(Probe):
        def on_save_checkpoint(self, checkpoint):
            seen["scheduler"] = dict(checkpoint["lr_schedulers"][0])
            seen["lr"] = checkpoint["optimizer_states"][0]["param_groups"][0]["lr"]

    model = _with_scheduler(Saving(), lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), interval="step")
    trainer = _trainer(tmp_path, max_steps=3, num_sanity_val_steps=0)
    trainer.fit(model, _loader())
    path = tmp_path / "saved.ckpt"
    trainer.save_checkpoint(path)
    assert seen["scheduler"]["_step_count"] == 4 and seen["scheduler"]["_last_lr"] == [0.5 ** 3]
    assert seen["lr"] == 0.5 ** 3
    saved = torch.load(path, weights_only=True)
    assert not {"lr_schedulers", "optimizer_states"} & set(saved)
    assert saved["scheduler"]["_step_count"] == 4  # the one copy, which a resume reads


def test_a_logged_metric_must_be_an_attribute_of_the_module(tmp_path):
    """``self.log(name, metric)`` of a torchmetrics ``Metric`` that is not one of the module's attributes is
    Lightning's error (a ``ValueError``; Lightning: ``MisconfigurationException``): with no Metric attribute, "set an
    attribute"; with others, naming them and ``metric_attribute``; an attribute, or ``metric_attribute=``, logs."""
    torchmetrics = pytest.importorskip("torchmetrics")

    class Logs(Probe):
        def __init__(self, keep: bool, inline: bool, attribute: str | None = None):
            super().__init__()
            if keep:
                self.acc = torchmetrics.MeanMetric()
            self.inline, self.attribute = inline, attribute

        def training_step(self, batch, batch_idx):
            metric = torchmetrics.MeanMetric() if self.inline else self.acc
            metric(batch[0].sum())
            self.log("m", metric, metric_attribute=self.attribute)
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="fix this by setting an attribute for the metric in your `LightningModule`"):
        _trainer(tmp_path, max_steps=1).fit(Logs(keep=False, inline=True), _loader())
    with pytest.raises(ValueError, match=r"`self.log\(m, ..., metric_attribute=name\)` where `name` is one of \['acc'\]"):
        _trainer(tmp_path, max_steps=1).fit(Logs(keep=True, inline=True), _loader())
    for model in (Logs(keep=True, inline=False), Logs(keep=False, inline=True, attribute="mine")):
        trainer = _trainer(tmp_path, max_steps=1)
        trainer.fit(model, _loader())
        assert "m" in trainer.callback_metrics


@pytest.mark.timeout(60)
def test_a_step_interval_plateau_scheduler_reads_what_this_step_logged(tmp_path):
    """A ``ReduceLROnPlateau`` with ``interval="step"`` steps once the step's ``self.log`` values are in
    ``callback_metrics`` (Lightning's ``update_plateau_schedulers`` after the step): it monitors a value logged in
    that same ``training_step`` from the first step on, and sees each step's own value."""

    class StepPlateau(Probe):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", patience=0, factor=0.5)
            return {"optimizer": opt,
                    "lr_scheduler": {"scheduler": sched, "monitor": "idx", "interval": "step", "strict": True}}

    model = StepPlateau()
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model, _loader())  # 4 steps logging idx = 0, 1, 2, 3: no step improves on the first
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 4 and float(sched.best) == 0.0  # the first value seen was step 0's own
    assert [g["lr"] for g in sched.optimizer.param_groups] == [0.1 * 0.5 ** 3]  # halved after steps 2, 3 and 4


class _UploadsCheckpoints(_Recorder):
    """A logger as Lightning users write to upload checkpoints: its ``after_save_checkpoint`` reads the callback."""

    def __init__(self):
        super().__init__()
        self.saved: list[str] = []

    def after_save_checkpoint(self, checkpoint_callback):  # without a monitor Lightning's best_model_path: the newest
        self.saved.append(os.path.basename(checkpoint_callback.last_model_path or checkpoint_callback.best_model_path))


@pytest.mark.timeout(60)
def test_loggers_hear_of_each_checkpoint_model_checkpoint_writes(tmp_path):
    uploads = _UploadsCheckpoints()
    every_epoch = ModelCheckpoint(dirpath=tmp_path / "c", save_top_k=-1, filename="{epoch}")
    _trainer(tmp_path, max_epochs=3, logger=uploads, callbacks=[every_epoch]).fit(Probe(), _loader())
    assert uploads.saved == ["epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt"]
    last_only = _UploadsCheckpoints()  # save_top_k=0 writes only last.ckpt, at each epoch end: heard each time
    _trainer(tmp_path / "b", max_epochs=2, logger=[last_only, _Recorder()],
             callbacks=[ModelCheckpoint(dirpath=tmp_path / "d", save_top_k=0, save_last=True)]).fit(Probe(), _loader())
    assert last_only.saved == ["last.ckpt", "last.ckpt"]


class _CountsSchedulerSteps(Probe):
    """Notes the optimizer steps taken when each "step" scheduler steps (through ``lr_scheduler_step``)."""

    def __init__(self, frequency: int):
        super().__init__()
        self.frequency, self.stepped_after = frequency, []

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1.0)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": self.frequency}}

    def lr_scheduler_step(self, scheduler, metric):
        self.stepped_after.append(self.trainer.global_step + 1)  # the count includes the step just taken
        scheduler.step()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("frequency", "accumulate", "batches", "epochs", "expected"), [
    (2, 2, 8, 1, [1, 2, 3, 4]),  # batch indices 1, 3, 5, 7 end the steps: (index + 1) % 2 == 0 at each
    (3, 1, 4, 2, [3, 7]),  # the index restarts each epoch: its 3rd batch, not the 3rd and 6th optimizer steps
])
def test_a_step_schedulers_frequency_counts_the_epochs_batches_as_lightnings(tmp_path, frequency, accumulate, batches,
                                                                             epochs, expected):
    module = _CountsSchedulerSteps(frequency)
    _trainer(tmp_path, max_epochs=epochs, accumulate_grad_batches=accumulate, num_sanity_val_steps=0).fit(
        module, _loader(n=2 * batches))
    assert module.stepped_after == expected


# -- pickling a trained module ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_trained_module_pickles_and_deep_copies_without_its_trainer(tmp_path):
    import io

    model = Probe()
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(model, _loader(4))
    buffer = io.BytesIO()
    torch.save(model, buffer)  # Lightning's LightningModule.__getstate__ leaves the Trainer out
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded.state_dict(), model.state_dict())
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        loaded.trainer  # noqa: B018
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin.state_dict(), model.state_dict())
    assert model.trainer is trainer  # the original stays attached


@pytest.mark.timeout(60)
def test_a_plain_module_after_fit_is_only_the_users_module(tmp_path):
    import io

    model = nn.Linear(2, 1)
    _trainer(tmp_path, max_epochs=1).fit(model, _loader(4), loss_fn=lambda out, y: out.squeeze(-1).sub(y).pow(2).mean(),
                                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert set(vars(model)) == set(vars(nn.Linear(2, 1)))  # nothing of trainscale's left on it
    torch.save(model, io.BytesIO())
    torch.testing.assert_close(copy.deepcopy(model).state_dict(), model.state_dict())


# -- Lightning's checks of a module before a stage, in Lightning's words ----------------------------------------------
def _without(**attrs):
    model = Probe()
    for name, value in attrs.items():
        setattr(model, name, value)
    return model


@pytest.mark.timeout(60)
def test_a_module_without_training_step_or_configure_optimizers_gets_lightnings_errors(tmp_path):
    with pytest.raises(ValueError, match=r"No `training_step\(\)` method defined\. .*define Probe\.training_step"):
        _trainer(tmp_path, max_epochs=1).fit(_without(training_step=None), _loader(4))

    class NoStep(TrainingModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 1)

    with pytest.raises(ValueError, match=r"No `training_step\(\)` method defined"):
        _trainer(tmp_path, max_epochs=1).fit(NoStep(), _loader(4))
    with pytest.raises(ValueError, match=r"No `configure_optimizers\(\)` method defined.*optimizer=lambda params"):
        _trainer(tmp_path, max_epochs=1).fit(_without(configure_optimizers=None), _loader(4))
    trainer = _trainer(tmp_path, max_epochs=1)  # the fix the message names
    trainer.fit(_without(configure_optimizers=None), _loader(4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert trainer.global_step == 2


@pytest.mark.timeout(60)
def test_a_validation_step_without_a_validation_loader_is_lightnings_warning(tmp_path):
    with pytest.warns(PossibleUserWarning, match=r"You defined a `validation_step` but have no `val_dataloader`\. "
                                                 r"Skipping val loop"):
        _trainer(tmp_path, max_epochs=1).fit(Probe(), _loader(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PossibleUserWarning)  # validation turned off: nothing to say
        _trainer(tmp_path, max_epochs=1, limit_val_batches=0, log_every_n_steps=1).fit(Probe(), _loader(4))
    with pytest.warns(UserWarning, match=r"You passed in a `val_dataloader` but have no `validation_step`\. "):
        _trainer(tmp_path, max_epochs=1).fit(_without(validation_step=None), _loader(4), _loader(2))


@pytest.mark.timeout(60)
def test_evaluation_stages_without_their_step_get_lightnings_errors(tmp_path):
    with pytest.raises(ValueError, match=r"No `validation_step\(\)` method defined to run `Trainer\.validate`"):
        _trainer(tmp_path).validate(_without(validation_step=None), _loader(2))
    with pytest.raises(ValueError, match=r"No `test_step\(\)` method defined to run `Trainer\.test`"):
        _trainer(tmp_path).test(Probe(), _loader(2))
    with pytest.raises(ValueError, match=r"`predict_step` cannot be None to run `Trainer\.predict`"):
        _trainer(tmp_path).predict(_without(predict_step=None), _loader(2))
    with pytest.raises(ValueError, match=r"`Trainer\.predict` requires `forward` method to run"):
        _trainer(tmp_path).predict(_without(forward=None), _loader(2))


@pytest.mark.timeout(60)
def test_lightning_1x_optimizer_idx_and_manual_optimization_flags_get_lightnings_errors(tmp_path):
    class OldStyle(Probe):
        def training_step(self, batch, batch_idx, optimizer_idx):
            return super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match=r"Remove the `optimizer_idx` argument from `training_step`"):
        _trainer(tmp_path, max_epochs=1).fit(OldStyle(), _loader(4))
    with pytest.raises(ValueError, match=r"Automatic gradient clipping is not supported for manual optimization\. "
                                         r"Remove `Trainer\(gradient_clip_val=1\.0\)`"):
        _trainer(tmp_path, max_epochs=1, gradient_clip_val=1.0).fit(_without(automatic_optimization=False),
                                                                     _loader(4))
    with pytest.raises(ValueError, match=r"Automatic gradient accumulation is not supported for manual optimization\. "
                                         r"Remove `Trainer\(accumulate_grad_batches=2\)`"):
        _trainer(tmp_path, max_epochs=1, accumulate_grad_batches=2).fit(_without(automatic_optimization=False),
                                                                        _loader(4))


# -- ModelCheckpoint's step saves wait for validation's fresh value ---------------------------------------------------
class _ScoredByEpoch(Probe):
    """Logs ``score`` at each validation's end: 0.1, 0.5, 1.0 in epochs 0, 1, 2."""

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        self.log("score", (0.1, 0.5, 1.0)[self.current_epoch])


@pytest.mark.timeout(60)
def test_a_step_save_ranking_by_a_validation_value_waits_for_that_validation(tmp_path):
    checkpoint = ModelCheckpoint(monitor="score", mode="max", save_top_k=1, every_n_train_steps=2, every_n_epochs=0,
                                 save_on_train_epoch_end=False, dirpath=tmp_path / "ckpt")
    trainer = _trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0, callbacks=[checkpoint])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "not among the metrics yet ... ranks last"
        trainer.fit(_ScoredByEpoch(), _loader(4), _loader(2))  # 2 steps an epoch: each step save ends an epoch
    # Lightning 2.6: the save of each epoch's last step is made at that epoch's validation end, on its value
    assert float(checkpoint.best_model_score) == 1.0
    assert Path(checkpoint.best_model_path).name == "epoch=2-step=6.ckpt"
    assert float(torch.load(checkpoint.best_model_path, weights_only=False)["callbacks"][checkpoint.state_key]
                 ["best_model_score"]) == 1.0


# -- inference_mode ----------------------------------------------------------------------------------------------------
class _GradModes(Probe):
    """Notes (grad enabled, inference mode enabled) at each evaluation stage's start and in its steps."""

    def __init__(self):
        super().__init__()
        self.modes: list[tuple[str, bool, bool]] = []

    def _note(self, where):
        self.modes.append((where, torch.is_grad_enabled(), torch.is_inference_mode_enabled()))

    def on_validation_start(self):
        self._note("validation")

    def test_step(self, batch, batch_idx):
        self._note("test_step")

    def predict_step(self, batch, batch_idx):
        self._note("predict_step")


# -- dataloader attributes and order --------------------------------------------------------------------------------
class _SeveralEval(Probe):
    """Validates, tests and predicts on several loaders (``dataloader_idx``); notes ``trainer.val_dataloaders`` in
    each validation batch."""

    def __init__(self):
        super().__init__()
        self.val_seen_in_step: list = []

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.val_seen_in_step.append(self.trainer.val_dataloaders)
        self.log("val_loss", self.layer(batch[0]).pow(2).mean())

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("test_loss", self.layer(batch[0]).pow(2).mean())

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self.layer(batch[0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("inference_mode", [True, False])
def test_evaluation_stages_run_under_inference_mode_or_no_grad_as_the_flag_says(tmp_path, inference_mode):
    model = _GradModes()
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, inference_mode=inference_mode)
    trainer.fit(model, _loader(4), _loader(2))
    trainer.validate(model, _loader(2))
    trainer.test(model, _loader(2))
    trainer.predict(model, _loader(2))
    assert [m[0] for m in model.modes] == ["validation", "validation", "test_step", "predict_step"]
    assert {m[1:] for m in model.modes} == {(False, inference_mode)}  # never grad; inference mode as asked
    assert trainer.global_step == 2 and model.layer.weight.requires_grad  # training after validation: as before


# -- closure optimizers (LBFGS) ----------------------------------------------------------------------------------------
class _LBFGSFit(TrainingModule):
    """A small regression fitted with L-BFGS under automatic optimization; notes each evaluation's hooks."""

    def __init__(self, line_search_fn=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        self.line_search_fn = line_search_fn
        self.noted: list[str] = []

    def training_step(self, batch, batch_idx):
        self.noted.append("training_step")
        x, y = batch
        return (self.net(x).squeeze(-1) - y).pow(2).mean()

    def on_before_backward(self, loss):
        self.noted.append("backward")

    def on_before_optimizer_step(self, optimizer):
        self.noted.append("before_optimizer_step")

    def on_before_zero_grad(self, optimizer):
        self.noted.append("zero_grad")

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=6, line_search_fn=self.line_search_fn)


def _regression_batches(n=16, batch_size=4):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(n, 3, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(n, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("line_search_fn", "clip"), [(None, None), ("strong_wolfe", 0.5)])
def test_lbfgs_under_automatic_optimization_trains_as_a_plain_pytorch_lbfgs_loop(tmp_path, line_search_fn, clip):
    """``configure_optimizers`` returning L-BFGS: each call of the closure after the first runs zero_grad, the
    batch's forward and backward again, then the hook before the step and the clipping, as Lightning's closure does;
    the weights after three steps are those of the same closure in plain PyTorch, where each evaluation is one
    backward."""
    torch.manual_seed(0)
    model = _LBFGSFit(line_search_fn)
    reference = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    reference.load_state_dict(model.net.state_dict())
    trainer = _trainer(tmp_path, max_steps=3, num_sanity_val_steps=0, gradient_clip_val=clip)
    trainer.fit(model, _regression_batches())

    optimizer = torch.optim.LBFGS(reference.parameters(), lr=0.5, max_iter=6, line_search_fn=line_search_fn)
    evaluations = 0
    for x, y in list(_regression_batches())[:3]:
        def closure(x=x, y=y):
            nonlocal evaluations
            evaluations += 1
            optimizer.zero_grad()
            loss = (reference(x).squeeze(-1) - y).pow(2).mean()
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(reference.parameters(), clip)
            return loss

        optimizer.step(closure)
    for ours, theirs in zip(model.net.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    assert evaluations > 3  # the optimizer evaluated the loss several times per step
    assert model.noted.count("training_step") == model.noted.count("backward") == evaluations
    assert model.noted.count("before_optimizer_step") == evaluations
    # each evaluation after a step's first zeroes the gradients first; the step's own zeroing follows it
    assert model.noted.count("zero_grad") == evaluations
    assert model.noted[:5] == ["zero_grad", "training_step", "backward", "before_optimizer_step", "zero_grad"]
    assert trainer.global_step == 3


@pytest.mark.timeout(60)
def test_lbfgs_with_accumulated_batches_is_refused_when_it_evaluates_again(tmp_path):
    """Evaluating one batch again would mix its new gradients with the step's other batches' old ones: the
    error names the flag to change."""
    model = _LBFGSFit()
    trainer = _trainer(tmp_path, max_steps=2, num_sanity_val_steps=0, accumulate_grad_batches=2)
    with pytest.raises(ValueError, match=r"LBFGS evaluated the loss again.*accumulated the gradients of 2 batches.*"
                                         r"Use accumulate_grad_batches=1"):
        trainer.fit(model, _regression_batches())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("manual", [False, True])
def test_lbfgs_under_16_mixed_is_lightnings_error(tmp_path, manual):
    """The GradScaler steps without a closure: Lightning's words, then the precisions that work, under automatic and
    manual optimization."""
    model = _ManualLBFGS() if manual else _LBFGSFit()
    trainer = _trainer(tmp_path, max_steps=1, num_sanity_val_steps=0, precision="16-mixed")
    with pytest.raises(ValueError, match="AMP and the LBFGS optimizer are not compatible.*precision='bf16-mixed'"):
        trainer.fit(model, _regression_batches())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("line_search_fn", [None, "strong_wolfe"])
def test_lbfgs_under_ddp_steps_as_one_process_on_the_ranks_batches_together(line_search_fn):
    """Two ranks, 4 samples each per step: the gradients are averaged and L-BFGS reads the ranks' mean loss, so its
    line search and stopping tests take the same path on every rank and the weights are those of plain PyTorch's
    L-BFGS on the 8 samples (their loss written as the mean of the two halves', the ranks' arithmetic: L-BFGS near
    its minimum magnifies a rounding difference)."""
    from tests import module_workers as mw
    from tests.helpers import run_distributed

    ranks = run_distributed(mw.lbfgs_ddp_body, line_search_fn, timeout=100)
    reference = nn.Linear(3, 1)
    reference.load_state_dict(ranks[0]["first"])  # ddp starts every rank from rank 0's weights
    optimizer = torch.optim.LBFGS(reference.parameters(), lr=0.5, max_iter=6, line_search_fn=line_search_fn)
    evaluations = 0
    for halves in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True):
        def closure(halves=halves):
            nonlocal evaluations
            evaluations += 1
            optimizer.zero_grad()
            loss = sum((reference(x).squeeze(-1) - y).pow(2).mean() for x, y in halves) / 2
            loss.backward()
            return loss

        optimizer.step(closure)
    assert len(ranks[0]["steps"]) == 3
    for rank in ranks:
        assert rank["evaluations"] == evaluations
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(rank["last"][name], value, atol=1e-6, rtol=1e-6)


# -- eval-loop logging and callbacks --------------------------------------------------------------------------------
class _ReturnsExtras(Probe):
    """Returns the loss with an extra key, and nothing on batch 1 (no backward there: Lightning's skip)."""

    def __init__(self):
        super().__init__()
        self.module_outputs: list = []

    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            return None
        return {"loss": self.layer(batch[0]).pow(2).mean(), "tag": batch_idx}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.module_outputs.append(outputs)


class _Outputs(Callback):
    def __init__(self):
        self.seen: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(outputs)


@pytest.mark.timeout(60)
def test_on_train_batch_end_gets_a_dict_of_the_detached_loss_and_the_other_keys_the_step_returned(tmp_path):
    model, seen = _ReturnsExtras(), _Outputs()
    with pytest.warns(UserWarning, match="`training_step` returned `None`"):
        _trainer(tmp_path, max_epochs=1, limit_train_batches=3, callbacks=[seen]).fit(model, _loader())
    assert [sorted(o) for o in seen.seen] == [["loss", "tag"], [], ["loss", "tag"]]  # None: {} (Lightning's)
    assert [o.get("tag") for o in seen.seen] == [0, None, 2]
    assert all(not o["loss"].requires_grad and o["loss"].ndim == 0 for o in seen.seen if o)
    assert model.module_outputs == seen.seen  # the module's hook gets the same dicts


class _LogsInValidationBatchEnd(Callback):
    """Logs the batch index at each validation batch's end: step only (shown), step and epoch (shown), and step only
    with ``logger=False`` (shown, not logged)."""

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        pl_module.log("shown", float(batch_idx), on_step=True, on_epoch=False, prog_bar=True)
        pl_module.log("both_ways", float(batch_idx), on_step=True, on_epoch=True, prog_bar=True, reduce_fx="max")
        pl_module.log("bar_only", float(batch_idx), on_step=True, on_epoch=False, prog_bar=True, logger=False)


@pytest.mark.timeout(60)
def test_a_value_an_evaluation_hook_logs_on_step_with_prog_bar_is_in_progress_bar_metrics(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1, limit_train_batches=1, num_sanity_val_steps=0,
                       callbacks=[_LogsInValidationBatchEnd()])
    trainer.fit(Probe(), _loader(), _loader(n=6))  # 3 validation batches: the last one's index is 2
    shown = trainer.progress_bar_metrics
    assert (shown["shown"], shown["both_ways_step"], shown["both_ways_epoch"], shown["bar_only"]) == (2.0, 2.0, 2.0, 2.0)
    assert "both_ways" not in shown  # the bare name only in callback_metrics, as Lightning's
    assert "bar_only" not in trainer.logged_metrics and float(trainer.logged_metrics["shown"]) == 2.0
    assert "shown" not in trainer.callback_metrics  # an evaluation's step value stays out of it, as Lightning's


@pytest.mark.timeout(60)
def test_a_mock_callback_has_every_hook_called_as_lightning_calls_them(tmp_path):
    from unittest.mock import Mock

    given, configured = Mock(spec=Callback), Mock(spec=Callback)

    class Configures(Probe):
        def configure_callbacks(self):
            return configured

    trainer = _trainer(tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=1, callbacks=[given],
                       enable_checkpointing=False)
    trainer.fit(Configures(), _loader(), _loader())
    called = [c[0] for c in given.method_calls]
    assert {"setup", "on_fit_start", "on_train_batch_end", "on_validation_end", "on_fit_end"} <= set(called)
    assert [c[0] for c in configured.method_calls] == called  # the module's callback: the same calls
    assert trainer.callbacks.count(configured) == 1
    trainer.validate(Configures(), _loader())  # configure_callbacks again: the same callback, not a second copy
    assert trainer.callbacks.count(configured) == 1


@pytest.mark.timeout(60)
def test_a_monitor_missing_before_the_fits_first_validation_warns_after_it_is_an_error(tmp_path):
    with pytest.warns(RuntimeWarning, match="monitors 'typo', not among the metrics yet"):
        _trainer(tmp_path / "a", max_steps=1, callbacks=[ModelCheckpoint(monitor="typo")]).fit(Probe(), _loader())
    with pytest.raises(ValueError, match="monitors 'typo', which is not among the metrics"):
        _trainer(tmp_path / "b", max_epochs=1, limit_val_batches=1, num_sanity_val_steps=0,
                 callbacks=[ModelCheckpoint(monitor="typo")]).fit(Probe(), _loader(), _loader())


def test_filter_on_optimizer_says_lightnings_hint():
    from trainscale.callbacks import BaseFinetuning

    layer = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"Did you init your optimizer in `configure_optimizer` as such:\n .*SGD"):
        assert BaseFinetuning.filter_on_optimizer(optimizer, [layer.weight]) == []


@pytest.mark.timeout(60)
def test_lambda_callback_calls_the_functions_given_by_hook_name(tmp_path):
    from trainscale.callbacks import LambdaCallback

    calls = []
    callback = LambdaCallback(setup=lambda trainer, module, stage: calls.append(("setup", stage)),
                              on_train_epoch_end=lambda trainer, module: calls.append(("epoch", trainer.current_epoch)),
                              on_fit_end=None)
    _trainer(tmp_path, max_epochs=2, limit_train_batches=1, limit_val_batches=0).fit(Probe(), _loader())
    assert calls == []  # not given to that Trainer
    _trainer(tmp_path, max_epochs=2, limit_train_batches=1, limit_val_batches=0, callbacks=[callback]).fit(
        Probe(), _loader())
    assert calls == [("setup", "fit"), ("epoch", 0), ("epoch", 1)]
    with pytest.raises(TypeError, match="'on_epoch_end', which is not a Callback hook"):
        LambdaCallback(on_epoch_end=print)


def test_val_test_and_predict_dataloaders_hold_each_stages_loaders_in_the_form_given(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, log_every_n_steps=1)
    assert (trainer.train_dataloader, trainer.val_dataloaders, trainer.test_dataloaders,
            trainer.predict_dataloaders) == (None, None, None, None)
    model, one = _SeveralEval(), _loader(4)
    trainer.fit(model, _loader(), one)
    assert trainer.val_dataloaders is one  # one rank, in order: the loader as given, as Lightning's
    assert model.val_seen_in_step and all(seen is one for seen in model.val_seen_in_step)
    assert trainer.enable_validation and trainer.train_dataloader is not None

    pair = [_loader(4), _loader(6)]
    trainer.fit(model, _loader(), pair)
    assert isinstance(trainer.val_dataloaders, list) and [dl.dataset for dl in trainer.val_dataloaders] == [
        dl.dataset for dl in pair]
    named = {"a": _loader(4), "b": _loader(6)}
    trainer.validate(model, named, verbose=False)
    assert list(trainer.val_dataloaders) == ["a", "b"] and trainer.val_dataloaders["b"].dataset is named["b"].dataset
    assert trainer.train_dataloader is None  # validate started: fit's loaders are forgotten, as Lightning's

    trainer.test(model, pair, verbose=False)
    assert len(trainer.test_dataloaders) == 2 and trainer.val_dataloaders is None
    trainer.predict(model, one)
    assert trainer.predict_dataloaders.dataset is one.dataset and trainer.test_dataloaders is None


class _AsksForLoaders(Probe):
    """Notes each data hook's call: its name, whether the sanity check was running, the epoch."""

    def __init__(self):
        super().__init__()
        self.asked: list[tuple[str, bool, int]] = []

    def train_dataloader(self):
        self.asked.append(("train", self.trainer.sanity_checking, self.current_epoch))
        return _loader()

    def val_dataloader(self):
        self.asked.append(("val", self.trainer.sanity_checking, self.current_epoch))
        return _loader(4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "expected"), [
    ({"max_epochs": 2}, [("val", True, 0), ("train", False, 0)]),  # the sanity check asks first
    ({"max_epochs": 2, "num_sanity_val_steps": 0}, [("train", False, 0), ("val", False, 0)]),
    ({"max_epochs": 4, "num_sanity_val_steps": 0, "check_val_every_n_epoch": 2},
     [("train", False, 0), ("val", False, 1)]),  # at the first validation
    ({"max_epochs": 3, "num_sanity_val_steps": 0, "reload_dataloaders_every_n_epochs": 1},
     [("train", False, 0), ("val", False, 0), ("train", False, 1), ("val", False, 1), ("train", False, 2),
      ("val", False, 2)]),
    ({"max_epochs": 6, "check_val_every_n_epoch": 3, "reload_dataloaders_every_n_epochs": 4},
     [("val", True, 0), ("train", False, 0), ("val", False, 2), ("train", False, 4)]),  # the sanity check's asking
    # does not count for epoch 0, which does not validate; epoch 5 is 3 epochs after epoch 2's: not again
])
def test_the_data_hooks_are_asked_in_lightnings_order(tmp_path, flags, expected):
    model = _AsksForLoaders()
    _trainer(tmp_path, log_every_n_steps=1, **flags).fit(model)
    assert model.asked == expected


class _TrainBuildsValReads(trainscale.DataModule):
    """A data module whose val_dataloader() reads what train_dataloader() built (a split made there)."""

    def train_dataloader(self):
        data = _loader(12).dataset
        self.train_part, self.val_part = torch.utils.data.random_split(data, [8, 4])
        return DataLoader(self.train_part, batch_size=2)

    def val_dataloader(self):
        return DataLoader(self.val_part, batch_size=2)


@pytest.mark.timeout(60)
def test_a_datamodule_whose_val_loader_needs_its_train_loader_fits_without_the_sanity_check(tmp_path):
    dm = _TrainBuildsValReads()
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(Probe(), datamodule=dm)  # training's loader first, as Lightning without its sanity check
    assert trainer.num_val_batches == [2] and trainer.val_dataloaders.dataset is dm.val_part
    with pytest.raises(AttributeError, match="val_part"):  # with it, validation's first: Lightning's order too
        _trainer(tmp_path / "sanity", max_epochs=1).fit(Probe(), datamodule=_TrainBuildsValReads())


@pytest.mark.timeout(60)
def test_fewer_training_batches_than_log_every_n_steps_warns_as_lightning(tmp_path):
    from trainscale.loggers import CSVLogger

    with pytest.warns(PossibleUserWarning, match=re.escape(
            "The number of training batches (4) is smaller than the logging interval Trainer(log_every_n_steps=5). "
            "Set a lower value for log_every_n_steps if you want to see logs for the training epoch.")):
        _trainer(tmp_path, max_epochs=1, log_every_n_steps=5, logger=CSVLogger(tmp_path)).fit(Probe(), _loader())
    with pytest.warns(PossibleUserWarning, match=re.escape("training batches (2) is smaller")):  # after the limit
        _trainer(tmp_path / "l", max_epochs=1, log_every_n_steps=3, limit_train_batches=2,
                 logger=CSVLogger(tmp_path / "l")).fit(Probe(), _loader())
    for flags in ({"log_every_n_steps": 4, "logger": CSVLogger(tmp_path / "e")},  # enough batches
                  {"log_every_n_steps": 5, "logger": False},  # nothing to log to
                  {"log_every_n_steps": 5, "fast_dev_run": True}):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="The number of training batches")
            _trainer(tmp_path / "q", max_epochs=1, **flags).fit(Probe(), _loader())


@pytest.mark.parametrize(("flags", "words"), [
    ({"limit_val_batches": 1.2}, "You have passed invalid value 1.2 for limit_val_batches, it has to be in [0.0, 1.0] "
                                 "or an int."),
    ({"overfit_batches": -0.1}, "You have passed invalid value -0.1 for overfit_batches"),
    ({"val_check_interval": 1.2}, "You have passed invalid value 1.2 for val_check_interval"),
    ({"fast_dev_run": -1}, "fast_dev_run=-1 is not a valid configuration. It should be >= 0."),
    ({"reload_dataloaders_every_n_epochs": -1}, "`reload_dataloaders_every_n_epochs` should be an int >= 0, got -1."),
    ({"reload_dataloaders_every_n_epochs": "2"}, "`reload_dataloaders_every_n_epochs` should be an int >= 0, got 2."),
])
def test_bad_loop_flag_values_are_refused_in_lightnings_words(tmp_path, flags, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        _trainer(tmp_path, **flags)


def test_fast_dev_run_sets_max_epochs_to_1_from_the_start(tmp_path):
    assert _trainer(tmp_path, fast_dev_run=3, max_epochs=5).max_epochs == 1
    assert _trainer(tmp_path, max_epochs=5).max_epochs == 5


class _Wrapped:
    """An iterable over a DataLoader that is no DataLoader (a user's wrapper)."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)


@pytest.mark.timeout(60)
def test_an_evaluation_loader_may_be_any_iterable_on_one_rank(tmp_path):
    model, wrapped = _SeveralEval(), _Wrapped(_loader(4))
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(model, _loader(), wrapped)
    assert trainer.val_dataloaders is wrapped and trainer.num_val_batches == [math.inf]
    assert model.val_seen_in_step and len(model.val_seen_in_step) == 2  # its two batches
    [result] = trainer.validate(model, wrapped, verbose=False)
    assert result["val_loss"] == pytest.approx(trainer.validate(model, _loader(4), verbose=False)[0]["val_loss"])


def test_an_evaluation_iterable_on_several_data_parallel_ranks_is_refused_naming_the_fix():
    from types import SimpleNamespace

    from trainscale.loop.evaluation import eval_loader

    two_ranks = SimpleNamespace(data_parallel_size=2)  # all eval_loader reads of a runtime for such an iterable
    with pytest.raises(TypeError, match="not a torch.utils.data.DataLoader.*pass the DataLoader itself"):
        eval_loader(two_ranks, _Wrapped(_loader(4)), 0)
    with pytest.raises(TypeError, match="An invalid dataloader was passed. Found 3"):  # not even an iterable
        eval_loader(SimpleNamespace(data_parallel_size=1), 3, 0)


@pytest.mark.parametrize(("train", "words"), [
    (_Wrapped(_loader()), "the training loader is a _Wrapped, not a torch.utils.data.DataLoader.*pass the DataLoader "
                          "itself"),
    ([_loader(), _loader()], "came as a list: trainscale trains on one DataLoader .*no CombinedLoader"),
])
def test_a_training_loader_that_is_no_dataloader_is_refused_naming_the_fix(tmp_path, train, words):
    with pytest.raises(TypeError, match=words):
        _trainer(tmp_path, max_epochs=1).fit(Probe(), train)


@pytest.mark.timeout(60)
def test_a_datamodule_passed_as_fits_loader_is_the_trainers_datamodule_and_not_with_loaders(tmp_path):
    dm = _TrainBuildsValReads()
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(Probe(), dm)
    assert trainer.datamodule is dm
    with pytest.raises(ValueError, match=re.escape("You cannot pass `train_dataloader` or `val_dataloaders` to "
                                                   "`trainer.fit(datamodule=...)`")):
        trainer.fit(Probe(), val_dataloaders=_loader(4), datamodule=dm)


# -- trainer state and log_dir ---------------------------------------------------------------------------------------
def test_the_state_enums_are_lightnings_str_enums():
    from trainscale.trainer.states import RunningStage, TrainerFn, TrainerStatus

    assert [fn.value for fn in TrainerFn] == ["fit", "validate", "test", "predict"]
    assert [s.value for s in RunningStage] == ["train", "sanity_check", "validate", "test", "predict"]
    assert [s.value for s in TrainerStatus] == ["initializing", "running", "finished", "interrupted"]
    stage = RunningStage.SANITY_CHECKING
    assert stage == "sanity_check" and str(stage) == f"{stage}" == "sanity_check" and {"sanity_check": 1}[stage] == 1
    assert [s.evaluating for s in RunningStage] == [False, True, True, True, False]
    assert [s.dataloader_prefix for s in RunningStage] == ["train", "val", "val", "test", "predict"]
    assert [s.stopped for s in TrainerStatus] == [False, False, True, True]
    assert pickle.loads(pickle.dumps(TrainerFn.TESTING)) is TrainerFn.TESTING  # a ddp_spawn rank sends its state back


class _StateWatch(_Stages):
    """Notes ``trainer.state``'s status, fn and stage, and ``trainer.evaluating``, at the hooks ``_Stages`` implements."""

    def _note(self, hook, trainer):
        state = trainer.state
        self.seen.setdefault(hook, (state.status, state.fn, state.stage, trainer.evaluating))

    def setup(self, trainer, module, stage):
        self._note(f"setup_{stage}", trainer)


@pytest.mark.timeout(60)
def test_trainer_state_holds_lightnings_enums_in_each_hook_and_after_each_call(tmp_path):
    from trainscale.trainer.states import RunningStage, TrainerFn, TrainerState, TrainerStatus

    watch = _StateWatch()
    trainer = _trainer(tmp_path, max_steps=2, callbacks=[watch])
    assert trainer.state == TrainerState(status=TrainerStatus.INITIALIZING, fn=None, stage=None)
    model = _AllSteps()
    after = []
    for call in (lambda: trainer.validate(model, _loader(4), verbose=False),  # before any fit: no fit needed
                 lambda: trainer.fit(model, _loader(4), _loader(4)),
                 lambda: trainer.test(model, _loader(4), verbose=False),
                 lambda: trainer.predict(model, _loader(4))):
        call()
        after.append((trainer.state.status, trainer.state.fn, trainer.state.stage, trainer.state.finished))
    running = TrainerStatus.RUNNING
    assert watch.seen == {
        "setup_validate": (running, TrainerFn.VALIDATING, RunningStage.VALIDATING, True),
        "validate": (running, TrainerFn.VALIDATING, RunningStage.VALIDATING, True),
        "setup_fit": (running, TrainerFn.FITTING, RunningStage.TRAINING, False),  # before the module is wrapped
        "sanity": (running, TrainerFn.FITTING, RunningStage.SANITY_CHECKING, True),
        "sanity_batch": (running, TrainerFn.FITTING, RunningStage.SANITY_CHECKING, True),
        "train_batch": (running, TrainerFn.FITTING, RunningStage.TRAINING, False),
        "train_epoch_end": (running, TrainerFn.FITTING, RunningStage.TRAINING, False),
        "fit_validation": (running, TrainerFn.FITTING, RunningStage.VALIDATING, True),
        "setup_test": (running, TrainerFn.TESTING, RunningStage.TESTING, True),
        "test": (running, TrainerFn.TESTING, RunningStage.TESTING, True),
        "setup_predict": (running, TrainerFn.PREDICTING, RunningStage.PREDICTING, False),
        "predict": (running, TrainerFn.PREDICTING, RunningStage.PREDICTING, False)}
    kinds = {type(value) for seen in watch.seen.values() for value in seen[:3]}
    assert kinds == {TrainerStatus, TrainerFn, RunningStage}  # the enums themselves, not plain strings
    assert watch.seen["train_batch"][:3] == ("running", "fit", "train")  # and equal to Lightning's strings
    assert after == [(TrainerStatus.FINISHED, fn, None, True) for fn in ("validate", "fit", "test", "predict")]


@pytest.mark.timeout(60)
def test_an_exception_in_validate_test_or_predict_leaves_the_trainer_interrupted(tmp_path):
    class Raising(_AllSteps):
        def test_step(self, batch, batch_idx):
            raise RuntimeError("test failed")

    trainer = _trainer(tmp_path, max_steps=1)
    with pytest.raises(RuntimeError, match="test failed"):
        trainer.test(Raising(), _loader(4), verbose=False)
    assert trainer.interrupted and trainer.state.status == "interrupted" and trainer.state.stopped
    assert (trainer.state.fn, trainer.state.stage) == ("test", None)
    trainer.validate(Raising(), _loader(4), verbose=False)
    assert trainer.state.finished and not trainer.interrupted

    class Stopped(_AllSteps):
        def predict_step(self, batch, batch_idx):
            raise KeyboardInterrupt  # Ctrl+C: it reaches the caller (Lightning exits the process instead)

    with pytest.raises(KeyboardInterrupt):
        trainer.predict(Stopped(), _loader(4))
    assert trainer.interrupted and (trainer.state.fn, trainer.state.stage) == ("predict", None)


    class FailsToSetUp(Callback):
        def setup(self, trainer, module, stage):
            raise RuntimeError("no setup")

    trainer = _trainer(tmp_path, max_steps=1, callbacks=[FailsToSetUp()])
    with pytest.raises(RuntimeError, match="no setup"):
        trainer.fit(Probe(), _loader(4))
    assert trainer.interrupted and (trainer.state.fn, trainer.state.stage) == ("fit", None)


class _SeesLogDir(Probe):
    """Notes ``self.trainer.log_dir`` at each training step."""

    def __init__(self):
        super().__init__()
        self.log_dirs: list[str | None] = []

    def training_step(self, batch, batch_idx):
        self.log_dirs.append(self.trainer.log_dir)
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(60)
def test_log_dir_is_default_root_dir_without_a_logger_and_the_run_directory_of_the_default_logger(tmp_path):
    root = tmp_path / "no_logger"
    model, trainer = _SeesLogDir(), _trainer(root, logger=False, max_steps=2)
    assert trainer.log_dir == str(root)  # Lightning's: default_root_dir, before, during and after fit
    trainer.fit(model, _loader())
    assert model.log_dirs == [str(root)] * 2 and trainer.log_dir == str(root)
    assert _trainer(root, logger=False, fast_dev_run=1).log_dir == str(root)
    # the default CSVLogger writes into the run directory: log_dir names the one the fit takes, before it too
    root = tmp_path / "default_logger"
    for n in (0, 1):
        model, trainer = _SeesLogDir(), _trainer(root, max_steps=2)
        before = trainer.log_dir
        assert before == str(root / f"version_{n}")
        trainer.fit(model, _loader())
        assert model.log_dirs == [before] * 2 and trainer.log_dir == before == str(trainer.run_dir)
        assert (trainer.run_dir / "metrics.csv").is_file()
    assert _trainer(root, fast_dev_run=1).log_dir is None  # a debug run writes nothing (Lightning's DummyLogger)


@pytest.mark.timeout(60)
def test_log_dir_before_the_first_fit_is_where_a_tensorboard_logger_without_save_dir_will_write(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'trainscale[tensorboard]'")
    from trainscale.loggers import TensorBoardLogger

    model, trainer = _SeesLogDir(), _trainer(tmp_path, max_steps=2, logger=TensorBoardLogger(sub_dir="train"))
    before = trainer.log_dir
    assert before == str(tmp_path / "version_0" / "tensorboard" / "train")  # its place in the run directory
    trainer.fit(model, _loader())
    assert model.log_dirs == [before] * 2 and trainer.log_dir == trainer.logger.log_dir == before
    assert any(Path(before).glob("events.out.tfevents.*"))


@pytest.mark.timeout(60)
def test_trainer_loggers_and_logger_are_settable_as_lightnings(tmp_path):
    from trainscale.loggers import CSVLogger

    trainer = _trainer(tmp_path, max_steps=1)
    assert trainer.loggers == [trainer.logger] and isinstance(trainer.logger, CSVLogger)
    one, two = CSVLogger(tmp_path / "one"), CSVLogger(tmp_path / "two")
    trainer.logger = one
    assert trainer.loggers == [one] and trainer.logger is one
    trainer.logger = None
    assert (trainer.loggers, trainer.logger, trainer.log_dir) == ([], None, str(tmp_path))
    trainer.loggers = (two, one)
    assert trainer.loggers == [two, one] and trainer.logger is two
    trainer.loggers = None
    assert trainer.loggers == [] and trainer.logger is None
    with pytest.raises(TypeError, match="is not a logger"):
        trainer.loggers = ["csv"]
    trainer.loggers = [one]  # set before fit: the fit writes to it
    trainer.fit(Probe(), _loader())
    assert trainer.log_dir == one.log_dir == str(tmp_path / "one" / "lightning_logs" / "version_0")
    assert (tmp_path / "one" / "lightning_logs" / "version_0" / "metrics.csv").is_file()
    assert not (tmp_path / "two").exists()


# -- on_<stage>_batch_end outputs of an evaluation step -----------------------------------------------------------------
class _OutputsSeen(Callback):
    def __init__(self):
        self.seen: list = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.seen.append(outputs)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.seen.append(outputs)


@pytest.mark.timeout(60)
def test_an_evaluation_steps_outputs_reach_on_batch_end_as_it_returned_them(tmp_path):
    class ReturnsTensor(Probe):
        def validation_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()  # Lightning passes the tensor itself

        def test_step(self, batch, batch_idx):
            return None

    seen = _OutputsSeen()
    trainer = _trainer(tmp_path, callbacks=[seen])
    model = ReturnsTensor()
    trainer.validate(model, _loader(2))
    assert len(seen.seen) == 1 and isinstance(seen.seen[0], torch.Tensor) and seen.seen[0].ndim == 0
    trainer.test(model, _loader(2))
    assert seen.seen[1] is None
    seen.seen.clear()
    _trainer(tmp_path, callbacks=[seen]).validate(nn.Linear(2, 1), _loader(2),
                                                 loss_fn=lambda out, y: out.squeeze(-1).sub(y).pow(2).mean())
    assert set(seen.seen[0]) == {"loss"}  # a plain model: trainscale's metrics


def test_a_detached_modules_ranks_epoch_and_step_are_zero_as_in_lightning(tmp_path):
    class AnnealedInForward(Probe):
        def forward(self, x):  # a schedule read in the forward, then used for inference after fit
            return self.layer(x) * (1.0 + self.current_epoch + self.global_step)

    model = AnnealedInForward()
    assert (model.global_rank, model.local_rank, model.current_epoch, model.global_step) == (0, 0, 0, 0)
    model(torch.zeros(1, 2))  # Lightning: no Trainer, 0 (it raised "not attached to a Trainer")
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model, _loader(4))
    assert (model.current_epoch, model.global_step, model.local_rank) == (1, 2, 0)
    model.trainer = None
    assert (model.current_epoch, model.global_step) == (0, 0)


@pytest.mark.timeout(60)
def test_toggled_optimizer_freezes_the_other_optimizers_parameters_inside_the_block(tmp_path):
    class TwoParts(TrainingModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.first, self.second = nn.Linear(2, 1), nn.Linear(2, 1)
            self.example_input_array = torch.zeros(1, 2)  # Lightning's attribute: kept as set, not a buffer
            self.inside: list[tuple[bool, bool]] = []

        def training_step(self, batch, batch_idx):
            opt_first, _ = self.optimizers()
            with self.toggled_optimizer(opt_first):
                self.inside.append((self.first.weight.requires_grad, self.second.weight.requires_grad))
                loss = (self.first(batch[0]) + self.second(batch[0])).pow(2).mean()
                opt_first.zero_grad()
                self.manual_backward(loss)
                opt_first.step()
            self.inside.append((self.first.weight.requires_grad, self.second.weight.requires_grad))

        def configure_optimizers(self):
            return torch.optim.SGD(self.first.parameters(), lr=0.1), torch.optim.SGD(self.second.parameters(), lr=0.1)

    model = TwoParts()
    _trainer(tmp_path, max_epochs=1, limit_train_batches=1).fit(model, _loader(2))
    assert model.inside == [(True, False), (True, True)]  # frozen inside the block, as before after it
    assert model.example_input_array.shape == (1, 2) and "example_input_array" not in model.state_dict()


# -- Lightning's Trainer attributes a callback or a script reads ----------------------------------------------------------
@pytest.mark.timeout(60)
def test_is_last_batch_default_root_dir_print_and_init_module_as_lightnings(tmp_path, capsys):
    class LastBatch(Callback):
        def __init__(self):
            self.seen: list[bool] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append(trainer.is_last_batch)

    seen = LastBatch()
    trainer = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, callbacks=[seen], precision="64-true")
    assert trainer.default_root_dir == str(tmp_path) and not trainer.is_last_batch
    with trainer.init_module():
        model = Probe()
    assert model.layer.weight.dtype == torch.float64  # built as "64-true" trains it
    trainer.fit(model, _loader(6))  # 3 batches an epoch
    assert seen.seen == [False, False, True] * 2
    trainer.print("from rank zero", 1)
    assert "from rank zero 1" in capsys.readouterr().out


# -- a stateful data module --------------------------------------------------------------------------------------------
class _Curriculum(trainscale.DataModule):
    """A data module whose level the module raises at each epoch's end (Lightning's stateful data module)."""

    def __init__(self):
        super().__init__()
        self.level = 0
        self.loaded: list[dict] = []

    def train_dataloader(self):
        return _loader(4)

    def state_dict(self):
        return {"level": self.level}

    def load_state_dict(self, state_dict):
        self.loaded.append(dict(state_dict))
        self.level = state_dict["level"]


class _RaisesLevel(Probe):
    def on_train_epoch_end(self):
        super().on_train_epoch_end()
        self.trainer.datamodule.level += 1


@pytest.mark.timeout(60)
def test_a_data_modules_state_is_saved_in_checkpoints_and_given_back_on_resume(tmp_path):
    first = _Curriculum()
    trainer = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(_RaisesLevel(), datamodule=first)
    saved = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=True)
    assert saved[type(first).__qualname__] == {"level": 2}  # Lightning's key: the class's __qualname__
    again = _Curriculum()
    resumed = _trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0)
    resumed.fit(_RaisesLevel(), datamodule=again, ckpt_path=trainer.checkpoint_callback.best_model_path)
    assert again.loaded == [{"level": 2}] and again.level == 3  # given back, then raised by the third epoch


@pytest.mark.timeout(60)
def test_strict_loading_false_lets_load_from_checkpoint_take_a_checkpoint_with_fewer_weights(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(Probe(), _loader(4))
    path = trainer.checkpoint_callback.best_model_path

    class Grown(Probe):  # a head the checkpoint does not hold
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(1, 1)

    with pytest.raises(RuntimeError, match="Missing key"):
        Grown.load_from_checkpoint(path)  # strict by default, as Lightning's

    class Lenient(Grown):
        def __init__(self):
            super().__init__()
            self.strict_loading = False  # Lightning's attribute

    loaded = Lenient.load_from_checkpoint(path)
    torch.testing.assert_close(loaded.layer.weight, torch.load(path, weights_only=True)["state_dict"]["layer.weight"])
    with pytest.raises(RuntimeError, match="Missing key"):
        Lenient.load_from_checkpoint(path, strict=True)  # the argument wins


def test_a_training_step_called_without_a_trainer_logs_nothing_with_lightnings_warning():
    class Logs(Probe):
        def training_step(self, batch, batch_idx):
            self.log_dict({"a": 1.0, "b": torch.tensor(2.0)})
            return super().training_step(batch, batch_idx)  # logs three more values

    model = Logs()
    with pytest.warns(UserWarning, match="the `self.trainer` reference is not registered") as seen:
        loss = model.training_step((torch.ones(3, 2), torch.zeros(3)), 0)  # a unit test of the step, as in Lightning
    assert loss.ndim == 0 and len(seen) >= 1
    assert model.logger is None and model.loggers == []
    with pytest.raises(ValueError, match="cannot be logged"):  # a bad value is still refused, as Lightning's
        model.log("x", "text")


def test_trainer_flags_not_given_are_read_from_pl_trainer_environment_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("PL_TRAINER_MAX_STEPS", "7")
    monkeypatch.setenv("PL_TRAINER_LOGGER", "False")
    monkeypatch.setenv("PL_TRAINER_ACCELERATOR", "cpu")  # not a Python literal: kept as the string
    monkeypatch.setenv("PL_TRAINER_LOG_EVERY_N_STEPS", "")  # empty: not set
    trainer = Trainer(default_root_dir=tmp_path)
    assert trainer.max_steps == 7 and trainer.logger is None and trainer.loggers == []
    assert trainer.log_every_n_steps == 50
    given = Trainer(default_root_dir=tmp_path, max_steps=3, logger=None)  # a flag given in the call wins
    assert given.max_steps == 3 and given.logger is not None
    monkeypatch.setenv("PL_TRAINER_MAX_EPOCHS", "-5")  # checked as the flag itself is
    with pytest.raises(ValueError, match="max_epochs"):
        Trainer(default_root_dir=tmp_path)


@pytest.mark.timeout(60)
def test_url_paths_are_refused_not_written_as_local_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a URL taken as a local path would land here, as ./memory:/runs
    with pytest.raises(ValueError, match="default_root_dir='memory://runs' is a URL"):
        Trainer(default_root_dir="memory://runs")
    trainer = _trainer(tmp_path / "runs", max_epochs=1)
    trainer.fit(Probe(), _loader(4))
    with pytest.raises(ValueError, match="save_checkpoint.filepath='s3://bucket/a.ckpt' is a URL"):
        trainer.save_checkpoint("s3://bucket/a.ckpt")
    with pytest.raises(ValueError, match="ckpt_path='s3://bucket/a.ckpt' is a URL"):
        _trainer(tmp_path / "runs", max_epochs=2).fit(Probe(), _loader(4), ckpt_path="s3://bucket/a.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["runs"]  # no memory: or s3: directory was made


@pytest.mark.timeout(60)
def test_resume_and_evaluation_load_weights_non_strictly_when_the_module_sets_strict_loading_false(tmp_path):
    class WithHead(Probe):  # a frozen part added after the checkpoint was written: its weights are not in it
        def __init__(self):
            super().__init__()
            self.frozen = nn.Linear(1, 1).requires_grad_(False)

        def configure_optimizers(self):
            return torch.optim.SGD(self.layer.parameters(), lr=0.05)

    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(Probe(), _loader(4))
    path = tmp_path / "probe.ckpt"
    trainer.save_checkpoint(path)
    saved = Probe()
    saved.load_state_dict(torch.load(path, weights_only=True)["state_dict"])

    strict = WithHead()
    with pytest.raises(RuntimeError, match="does not fit"):  # strict by default, as Lightning's
        _trainer(tmp_path, max_epochs=2).fit(strict, _loader(4), ckpt_path=path)
    model = WithHead()
    model.strict_loading = False
    loaded = {}

    class Seen(Callback):
        def on_train_start(self, trainer, pl_module):
            loaded.update({k: v.clone() for k, v in pl_module.layer.state_dict().items()})

    _trainer(tmp_path, max_epochs=2, callbacks=[Seen()]).fit(model, _loader(4), ckpt_path=path)
    torch.testing.assert_close(loaded, saved.layer.state_dict())  # the saved weights were restored
    evaluated = WithHead()
    evaluated.strict_loading = False
    _trainer(tmp_path).validate(evaluated, _loader(2), ckpt_path=path)
    torch.testing.assert_close(evaluated.layer.state_dict(), saved.layer.state_dict())


@pytest.mark.timeout(60)
def test_a_sharded_checkpoint_loads_non_strictly_when_asked(tmp_path):
    """The DCP directory of fsdp/model_parallel: strict=False (a module's ``strict_loading = False``) keeps the weights
    the checkpoint lacks, as a file's ``load_state_dict(strict=False)`` does."""
    import torch.distributed as dist

    from trainscale.runtime.checkpoint_io import CheckpointError
    from trainscale.runtime.strategies.dcp_checkpoint import DCPCheckpointer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        saved = nn.Sequential(nn.Linear(2, 2))
        DCPCheckpointer(0, "fsdp").save(tmp_path / "c.ckpt", {"model": saved, "epoch": 3})
        grown = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        kept = grown[1].weight.detach().clone()
        with pytest.raises(CheckpointError, match="Missing key"):
            DCPCheckpointer(0, "fsdp").load(tmp_path / "c.ckpt", {"model": grown})
        assert DCPCheckpointer(0, "fsdp").load(tmp_path / "c.ckpt", {"model": grown}, strict=False) == {"epoch": 3}
        torch.testing.assert_close(grown[0].state_dict(), saved[0].state_dict())
        torch.testing.assert_close(grown[1].weight.detach(), kept)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_setup_and_teardown_get_the_stage_as_lightnings_trainer_fn(tmp_path):
    from trainscale.trainer.states import TrainerFn

    seen = []

    class Stages(Probe):
        def setup(self, stage):
            seen.append(("module.setup", stage.value))  # Lightning's TrainerFn: `.value` works, as does == "fit"

        def teardown(self, stage):
            seen.append(("module.teardown", stage.value))

    class Noted(Callback):
        def setup(self, trainer, pl_module, stage):
            assert isinstance(stage, TrainerFn) and stage == trainer.state.fn
            seen.append(("callback.setup", stage.value))

        def teardown(self, trainer, pl_module, stage):
            seen.append(("callback.teardown", stage.value))

    trainer = _trainer(tmp_path, max_epochs=1, callbacks=[Noted()])
    model = Stages()
    trainer.fit(model, _loader(4))
    trainer.validate(model, _loader(2))
    assert seen == [("callback.setup", "fit"), ("module.setup", "fit"), ("callback.teardown", "fit"),
                    ("module.teardown", "fit"), ("callback.setup", "validate"), ("module.setup", "validate"),
                    ("callback.teardown", "validate"), ("module.teardown", "validate")]


@pytest.mark.timeout(60)
def test_a_loggers_log_graph_is_given_the_module_once_per_fit_after_its_hyperparameters(tmp_path):
    class DrawsGraphs(_Recorder):
        def __init__(self):
            super().__init__()
            self.calls: list[str] = []

        def log_hyperparams(self, params):
            self.calls.append("log_hyperparams")

        def log_graph(self, model, input_array=None):  # Lightning's Logger.log_graph
            self.calls.append(("log_graph", model))

    class SeesTheGraphFirst(Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.logger.calls.append("on_train_start")

    class Saves(Probe):
        def __init__(self, width=2):
            super().__init__()
            self.save_hyperparameters()

    drawn, model = DrawsGraphs(), Saves()
    _trainer(tmp_path, max_epochs=1, logger=[drawn, _Recorder()], callbacks=[SeesTheGraphFirst()]).fit(model, _loader(4))
    assert drawn.calls == ["log_hyperparams", ("log_graph", model), "on_train_start"]


@pytest.mark.timeout(60)
def test_a_fitted_trainer_pickles_with_torch_save_and_evaluates_after_loading(tmp_path):
    import io

    from trainscale.telemetry.nvml import GpuSampler

    trainer = Trainer(accelerator="cpu", default_root_dir=tmp_path, max_epochs=1, log_every_n_steps=1)  # a tqdm bar
    trainer.fit(Probe(), _loader(4), _loader(2))
    buffer = io.BytesIO()
    torch.save(trainer, buffer)  # Lightning's Trainer pickles (its test_torch_saving)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.current_epoch == 1 and set(loaded.callback_metrics) == set(trainer.callback_metrics)
    assert loaded.validate(loaded.model, _loader(2))[0]["val_loss"] >= 0
    sampler = GpuSampler(None, interval_s=0.01, read=lambda: (50.0, 1024.0)).start()  # a live thread and lock
    try:
        copy_ = pickle.loads(pickle.dumps(sampler))
        assert not copy_.available and copy_.start()._thread is None  # a stopped copy: no reader, no thread
        assert sampler.available  # the original goes on sampling
    finally:
        sampler.stop()


@pytest.mark.timeout(60)
def test_received_sigterm_and_a_sigterm_handler_of_ones_own_in_fit(tmp_path):
    import signal

    from trainscale.faults.signals import Preempted
    from trainscale.utilities.exceptions import SIGTERMException

    ran = []

    class SendsSigterm(Probe):
        def training_step(self, batch, batch_idx):
            if self.global_step == 1 and not ran:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().training_step(batch, batch_idx)

    def own(signum, frame):
        ran.append(signum)

    before = signal.signal(signal.SIGTERM, own)
    try:
        trainer = _trainer(tmp_path, max_epochs=1)
        assert trainer.received_sigterm is False
        with pytest.raises(SIGTERMException) as info:  # Lightning's exception; trainscale's Preempted too
            trainer.fit(SendsSigterm(), _loader(8))
        assert info.value.code == 128 + signal.SIGTERM and isinstance(info.value, Preempted)
        assert SIGTERMException().code == 128 + signal.SIGTERM
        assert trainer.received_sigterm is True  # Lightning's property, read after the fit
        assert ran == [signal.SIGTERM]  # the handler installed before fit still ran, as Lightning calls it
        assert signal.getsignal(signal.SIGTERM) is own  # put back once fit has ended
        trainer.validate(Probe(), _loader(2))
        assert trainer.received_sigterm is False  # False again as the next stage starts, as Lightning's
    finally:
        signal.signal(signal.SIGTERM, before)


class _Scriptable(TrainingModule):
    """A module with hyperparameters and a forward TorchScript can compile."""

    def __init__(self, width: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(width, 3)

    def forward(self, x):
        return torch.relu(self.layer(x)).sum(dim=1)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).mean()


def test_to_torchscript_scripts_or_traces_the_module_as_lightnings(tmp_path):
    model = _Scriptable()
    x = torch.randn(4, 2)
    with pytest.warns(DeprecationWarning, match="to_torchscript` is deprecated") as seen:
        scripted = model.to_torchscript(file_path=tmp_path / "scripted.pt")  # a detached module: no Trainer needed
    assert seen[0].filename == __file__  # the warning names the caller
    assert isinstance(scripted, torch.jit.ScriptModule) and model.training  # its mode is put back
    torch.testing.assert_close(scripted(x), model(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.testing.assert_close(torch.jit.load(str(tmp_path / "scripted.pt"))(x), model(x))
        traced = model.to_torchscript(method="trace", example_inputs=x)
        torch.testing.assert_close(traced(x), model(x))
        with pytest.raises(ValueError, match="requires either `example_inputs` or `model.example_input_array`"):
            model.to_torchscript(method="trace")
        model.example_input_array = torch.zeros(1, 2)  # what trace uses without example_inputs
        torch.testing.assert_close(model.to_torchscript(method="trace")(x), model(x))
        with pytest.raises(ValueError, match="only supports 'script' or 'trace'"):
            model.to_torchscript(method="compile")
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        model.trainer  # noqa: B018 - outside to_torchscript a detached module still has none


@pytest.mark.parametrize("name", ["limit_train_batches", "limit_val_batches", "limit_test_batches",
                                  "limit_predict_batches", "overfit_batches", "val_check_interval"])
def test_a_whole_float_above_one_counts_batches_and_another_is_refused_as_in_lightning(tmp_path, name):
    trainer = _trainer(tmp_path, **{name: 3.0})
    assert getattr(trainer.config, name) == 3 and isinstance(getattr(trainer.config, name), int)
    with pytest.raises(ValueError, match=rf"invalid value 2.5 for {name}, it has to be in \[0.0, 1.0\] or an int"):
        _trainer(tmp_path, **{name: 2.5})


@pytest.mark.timeout(60)
def test_limit_train_batches_of_a_whole_float_trains_that_many_batches(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1, limit_train_batches=3.0, limit_val_batches=2.0)
    trainer.fit(Probe(), _loader(16), _loader(16))
    assert trainer.global_step == 3 and trainer.limit_train_batches == 3 and trainer.num_val_batches == [2]
