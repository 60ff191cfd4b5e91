"""Lightning's loop flags with Lightning's semantics: limit_test_batches, limit_predict_batches, min_epochs, min_steps,
val_check_interval, check_val_every_n_epoch, num_sanity_val_steps, fast_dev_run, max_time, overfit_batches,
deterministic, enable_model_summary (``ModelSummary``)."""

import json
import math
import os
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainscale.callbacks import EarlyStopping
from trainscale.lightning.module import TrainingModule
from trainscale.loop.config import resolve_trainer_config
from trainscale.loop.trainer import Trainer
from tests import workers


class Counted(TrainingModule):
    """Counts its test and predict steps; logs a constant ``score`` each validation (it never improves)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.steps = {"test": 0, "predict": 0}

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("score", 1.0)

    def test_step(self, batch, batch_idx):
        self.steps["test"] += 1
        self.log("x", batch[0][:, 0].mean())

    def predict_step(self, batch, batch_idx):
        self.steps["predict"] += 1
        return batch[0][:, 0]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(n=10):
    x = torch.arange(n, dtype=torch.float32).repeat(2, 1).T
    return DataLoader(TensorDataset(x, torch.zeros(n, dtype=torch.long)), batch_size=2)


def _trainer(tmp_path, **kw):
    return Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, **kw)


@pytest.mark.timeout(60)
def test_limit_test_and_predict_batches_count_or_fraction(tmp_path):
    model = Counted()
    (out,) = _trainer(tmp_path, limit_test_batches=2).test(model, _loader())
    assert model.steps["test"] == 2 and out["x"] == pytest.approx(1.5)  # samples 0..3
    predicted = _trainer(tmp_path, limit_predict_batches=0.4).predict(model, _loader())  # 5 batches × 0.4 = 2
    assert model.steps["predict"] == 2 and torch.cat(predicted).tolist() == [0.0, 1.0, 2.0, 3.0]


class Staged(Counted):
    """Records the stage hooks it sees, asks for its loaders through the data hooks, and says at each step whether
    the gradients were freed; its ``setup``/``teardown`` call the defaults through ``super()``."""

    def __init__(self):
        super().__init__()
        self.seen, self.grads_freed = [], []

    def setup(self, stage):
        super().setup(stage)
        self.seen.append(f"setup:{stage}")

    def teardown(self, stage):
        super().teardown(stage)
        self.seen.append(f"teardown:{stage}")

    def val_dataloader(self):
        self.seen.append("val_dataloader")
        return _loader()

    def test_dataloader(self):
        self.seen.append("test_dataloader")
        return _loader()

    def predict_dataloader(self):
        self.seen.append("predict_dataloader")
        return _loader()

    def on_validation_start(self):
        self.seen.append("on_validation_start")

    def on_test_start(self):
        self.seen.append("on_test_start")

    def on_predict_start(self):
        self.seen.append("on_predict_start")

    def test_step(self, batch, batch_idx):
        self.grads_freed.append(all(p.grad is None for p in self.parameters()))
        return super().test_step(batch, batch_idx)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("method", "flag", "returned"), [("validate", "limit_val_batches", []),
                                                          ("test", "limit_test_batches", []),
                                                          ("predict", "limit_predict_batches", None)])
@pytest.mark.parametrize("zero", [0, 0.0])
def test_a_zero_limit_turns_the_evaluation_stage_off(tmp_path, method, flag, returned, zero):
    # Lightning's loops skip a stage whose limit is 0: setup and teardown run, no loader is asked for, no stage hook
    model = Staged()
    trainer = _trainer(tmp_path, **{flag: zero})
    assert getattr(trainer, method)(model) == returned
    assert model.seen == [f"setup:{method}", f"teardown:{method}"]
    assert model.steps == {"test": 0, "predict": 0}


@pytest.mark.timeout(60)
def test_each_stage_starts_with_the_gradients_freed(tmp_path):
    # Lightning's _run_stage calls the module's zero_grad() before the stage's loop; with limit 2 the stage runs
    model = Staged()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    (out,) = _trainer(tmp_path, limit_test_batches=2).test(model)
    assert model.grads_freed == [True, True] and out["x"] == pytest.approx(1.5)
    assert model.seen == ["setup:test", "test_dataloader", "on_test_start", "teardown:test"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "epochs"), [({}, 2), ({"min_epochs": 4}, 4), ({"min_steps": 13}, 3)])
def test_min_epochs_and_min_steps_hold_back_an_early_stop(tmp_path, flags, epochs):
    # score never improves: EarlyStopping(patience=1) asks to stop after epoch 2 (Lightning's wait_count >= patience);
    # Lightning's _can_stop_early lets it stop only once min_epochs epochs / min_steps steps (5 per epoch) are done
    trainer = _trainer(tmp_path, max_epochs=10, callbacks=[EarlyStopping("score", patience=1)], **flags)
    trainer.fit(Counted(), _loader(), _loader(2))
    assert len(trainer.history) == epochs


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "step", "epochs"), [({"val_check_interval": 3}, 8, 2),
                                                       ({"check_val_every_n_epoch": 2}, 20, 4)])
def test_early_stopping_checks_after_each_validation_when_it_is_not_at_every_epoch_end(tmp_path, flags, step, epochs):
    # Lightning's check_on_train_epoch_end=None: 5 batches per epoch; score constant, patience 1: the second
    # validation stops training (mid-epoch validations at steps 3, 8; or the ends of epochs 2 and 4)
    trainer = _trainer(tmp_path, max_epochs=10, callbacks=[EarlyStopping("score", patience=1)], **flags)
    trainer.fit(Counted(), _loader(), _loader(2))
    assert (trainer.global_step, len(trainer.history)) == (step, epochs)


def test_the_new_flags_are_validated():
    for flags in ({"limit_test_batches": -1}, {"limit_predict_batches": 1.5}, {"min_epochs": -1}, {"min_steps": -1}):
        with pytest.raises(ValueError, match=next(iter(flags))):
            resolve_trainer_config(**flags)


# -- val_check_interval, check_val_every_n_epoch, num_sanity_val_steps, fast_dev_run, max_time, overfit_batches,
#    deterministic, enable_model_summary ----------------------------------------------------------------------------

class Watched(TrainingModule):
    """Records each validation's global step (and whether it was the sanity check) and each training batch's first
    sample; dropout makes the training depend on the random state."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Sequential(nn.Dropout(0.5), nn.Linear(2, 2))
        self.validations, self.val_batches, self.trained = [], 0, []

    def training_step(self, batch, batch_idx):
        self.trained.append(batch[0][0, 0].item())
        return self.layer(batch[0] / 20).pow(2).mean()

    def on_validation_start(self):
        self.validations.append(("sanity" if self.trainer.sanity_checking else "fit", self.trainer.global_step))

    def validation_step(self, batch, batch_idx):
        self.val_batches += 1
        self.log("val_loss", self.layer(batch[0] / 20).pow(2).mean())

    def test_step(self, batch, batch_idx):
        self.log("t", batch[0].sum())

    def predict_step(self, batch, batch_idx):
        return batch[0][:, 0]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_watched(root, n_train=20, n_val=8, **flags):
    torch.manual_seed(0)  # the same initial weights in every run
    model = Watched()
    trainer = _trainer(root, **{"max_epochs": 2, "enable_model_summary": False, **flags})
    trainer.fit(model, _loader(n_train), _loader(n_val))
    return trainer, model


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "steps"), [
    ({}, [10, 20]),  # 10 batches per epoch: each epoch end
    ({"val_check_interval": 3}, [3, 6, 9, 13, 16, 19]),  # every 3rd batch of each epoch (not at its end)
    ({"val_check_interval": 1, "max_epochs": 1}, list(range(1, 11))),  # the int 1: after every batch (1.0: the end)
    ({"val_check_interval": 1.0}, [10, 20]),  # the float 1.0: once, at each epoch's end
    ({"val_check_interval": 0.25}, [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]),  # int(10 × 0.25) = 2
    ({"val_check_interval": 0.5, "check_val_every_n_epoch": 2}, [15, 20]),  # the 2nd epoch only
    ({"val_check_interval": 7, "check_val_every_n_epoch": None}, [7, 14]),  # every 7th batch of the run
    # accumulate 3: steps train batches 0-2, 3-5, 6-8, 9; batches 4 and 8 (1-based) are due, so validation runs
    # after steps 2 and 3 (Lightning validates mid-step, after batch 4 at step 1: the documented difference)
    ({"val_check_interval": 4, "accumulate_grad_batches": 3}, [2, 3, 6, 7]),
])
def test_validation_runs_at_the_batches_lightning_runs_it(tmp_path, flags, steps):
    trainer, model = _fit_watched(tmp_path, num_sanity_val_steps=0, **flags)
    assert [step for kind, step in model.validations] == steps == trainer.validated_at
    with pytest.raises(ValueError, match="check_val_every_n_epoch=None"):  # Lightning's error, at the fit's start
        _fit_watched(tmp_path, val_check_interval=11)


@pytest.mark.timeout(60)
def test_resume_after_a_mid_epoch_validation_equals_the_uninterrupted_run(tmp_path):
    # ModelCheckpoint(monitor="val_loss") every 3 steps, after the validation of that step: it sees its val_loss
    from trainscale.callbacks import ModelCheckpoint

    def run(root, ckpt_path=None):
        torch.manual_seed(0)  # the same weights in both runs (with these, a float64 carried loss sum is off by 1 ulp)
        model = Watched()
        trainer = _trainer(root, max_epochs=2, val_check_interval=3, enable_model_summary=False, callbacks=[
            ModelCheckpoint(monitor="val_loss", every_n_train_steps=3, save_top_k=-1)])
        trainer.fit(model, _loader(20), _loader(8), ckpt_path=ckpt_path)
        return trainer, model

    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full, full_model = run(tmp_path / "a")
    assert not [w for w in caught if "ranks last" in str(w.message)]  # each step save found the step's val_loss
    step6 = next((tmp_path / "a").rglob("epoch=0-step=6.ckpt"))
    resumed, resumed_model = run(tmp_path / "b", ckpt_path=step6)
    assert [s for _, s in resumed_model.validations] == [9, 13, 16, 19]  # no sanity check when resuming mid-epoch
    for key, value in full_model.state_dict().items():
        torch.testing.assert_close(resumed_model.state_dict()[key], value, rtol=0, atol=0)
    assert resumed.callback_metrics["val_loss"] == full.callback_metrics["val_loss"]
    assert [h["train_loss"] for h in resumed.history] == [h["train_loss"] for h in full.history]
    records = [json.loads(line) for line in open(next((tmp_path / "a").rglob("metrics.jsonl")))]
    assert [r["step"] for r in records if r["kind"] == "validation"] == [3, 6, 9, 13, 16, 19]
    assert all("val_loss" in r for r in records if r["kind"] == "validation")


class PlateauWatched(Watched):
    """``Watched`` with a "step" ``ReduceLROnPlateau`` on ``val_loss`` (halving at every validation that does not
    improve it), noting the learning rate after each optimizer step."""

    def __init__(self):
        super().__init__()
        self.rates: list[float] = []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.rates.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "interval": "step", "frequency": 3,
                                                   "monitor": "val_loss"}}  # at each validation's step


@pytest.mark.timeout(60)
def test_resume_from_a_validation_end_checkpoint_keeps_the_step_plateau_schedulers_update(tmp_path):
    # the checkpoint is written at the mid-epoch validation's end, before that step's ReduceLROnPlateau update (as
    # Lightning orders them): the resumed fit must still make that update
    from trainscale.callbacks import ModelCheckpoint

    def run(root, ckpt_path=None):
        torch.manual_seed(0)
        model = PlateauWatched()
        trainer = _trainer(root, max_epochs=2, val_check_interval=3, enable_model_summary=False,
                           num_sanity_val_steps=0, callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=-1)])
        trainer.fit(model, _loader(20), _loader(8), ckpt_path=ckpt_path)
        return trainer, model

    full, full_model = run(tmp_path / "a")
    assert len(set(full_model.rates)) > 2  # the scheduler halved the rate more than once
    step6 = next((tmp_path / "a").rglob("epoch=0-step=6.ckpt"))
    resumed, resumed_model = run(tmp_path / "b", ckpt_path=step6)
    assert resumed_model.rates == full_model.rates[6:]
    for key, value in full_model.state_dict().items():
        torch.testing.assert_close(resumed_model.state_dict()[key], value, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_sanity_check_runs_two_batches_first_and_leaves_no_trace(tmp_path):
    checked, model = _fit_watched(tmp_path, max_epochs=1, limit_val_batches=3)
    assert model.validations == [("sanity", 0), ("fit", 10)] and model.val_batches == 2 + 3
    assert checked.validated_at == [10]
    _, plain = _fit_watched(tmp_path, max_epochs=1, limit_val_batches=3, num_sanity_val_steps=0)
    for key, value in plain.state_dict().items():  # the random states were restored after it: the same training
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)
    _, every = _fit_watched(tmp_path, max_epochs=1, num_sanity_val_steps=-1)
    assert every.val_batches == 4 + 4  # -1: all 4 validation batches, then the epoch end's


@pytest.mark.timeout(60)
def test_fast_dev_run_runs_n_batches_of_each_loop_and_writes_nothing(tmp_path):
    from trainscale.callbacks import ModelCheckpoint

    root = tmp_path / "root"
    model = Watched()
    trainer = _trainer(root, fast_dev_run=2, max_epochs=5, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts")])
    summary = trainer.fit(model, _loader(20), _loader(8))
    assert summary["steps"] == 2 and len(model.trained) == 2 and model.validations == [("fit", 2)]
    assert model.val_batches == 2
    assert trainer.test(model, _loader(20))[0] and torch.cat(trainer.predict(model, _loader(20))).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert list(tmp_path.rglob("*")) == []  # no run directory, record, logger file or checkpoint


@pytest.mark.timeout(60)
def test_a_monitored_checkpoint_saves_only_in_the_epochs_that_validate(tmp_path):
    from trainscale.callbacks import ModelCheckpoint

    _fit_watched(tmp_path, max_epochs=4, check_val_every_n_epoch=2,
                 callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=-1)])
    assert sorted(p.name for p in tmp_path.rglob("epoch=*.ckpt")) == ["epoch=1-step=20.ckpt", "epoch=3-step=40.ckpt"]


@pytest.mark.timeout(60)
def test_max_time_stops_after_a_step_and_checkpoints(tmp_path):
    # a zero duration has run out when fit starts, whatever the machine's speed; min_steps holds it back until the
    # third step, whose epoch then ends as usual: it validates and checkpoints, as Lightning
    trainer, model = _fit_watched(tmp_path, max_time={"seconds": 0}, min_steps=3, max_epochs=3, num_sanity_val_steps=0)
    assert trainer.global_step == 3 and len(trainer.history) == 1
    assert trainer.validated_at == [3]
    assert [p.name for p in tmp_path.rglob("epoch=*.ckpt")] == ["epoch=0-step=3.ckpt"]


@pytest.mark.timeout(60)
def test_max_time_is_a_timer_callback_as_lightnings(tmp_path, caplog):
    from trainscale.callbacks import ModelCheckpoint, Timer

    trainer = _trainer(tmp_path, max_time="00:00:00:00", max_epochs=3, num_sanity_val_steps=0)
    (timer,) = [cb for cb in trainer.callbacks if isinstance(cb, Timer)]
    saver = next(i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, ModelCheckpoint))
    assert timer.time_remaining() == 0.0 and trainer.callbacks.index(timer) < saver  # before the checkpoints
    trainer.fit(Watched(), _loader(20), _loader(8))
    assert trainer.global_step == 0 and trainer.validated_at == []  # out of time when fit starts: nothing trains
    mine = Timer(duration={"hours": 1})
    with caplog.at_level("INFO"):
        given = _trainer(tmp_path, max_time={"seconds": 5}, callbacks=[mine])
    assert [cb for cb in given.callbacks if isinstance(cb, Timer)] == [mine]
    assert "Ignoring `Trainer(max_time=...)`, callbacks list already contains a Timer." in caplog.text


@pytest.mark.timeout(60)
def test_overfit_batches_trains_on_the_first_batches_unshuffled(tmp_path):
    x = torch.arange(20, dtype=torch.float32).repeat(2, 1).T
    shuffled = DataLoader(TensorDataset(x, torch.zeros(20, dtype=torch.long)), batch_size=2, shuffle=True)
    model = Watched()
    _trainer(tmp_path, overfit_batches=2, max_epochs=2, num_sanity_val_steps=0, enable_model_summary=False).fit(
        model, shuffled, _loader(8))
    assert model.trained == [0.0, 2.0, 0.0, 2.0] and model.val_batches == 2 * 2


def test_deterministic_sets_torch_as_lightning(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        _trainer("runs", deterministic="warn")
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        _trainer("runs", deterministic=True)
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)


def test_benchmark_sets_cudnn_benchmark_as_lightning(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.backends.cudnn.benchmark
    try:
        _trainer("runs", benchmark=True)
        assert torch.backends.cudnn.benchmark is True
        _trainer("runs")  # None: left as it is
        assert torch.backends.cudnn.benchmark is True
        _trainer("runs", benchmark=False)
        assert torch.backends.cudnn.benchmark is False
        with pytest.warns(UserWarning, match="PyTorch ignores torch.backends.cudnn.deterministic=True"):
            _trainer("runs", deterministic=True, benchmark=True)
        assert torch.backends.cudnn.benchmark is True
        torch.use_deterministic_algorithms(False)
        _trainer("runs", deterministic=True)  # benchmark None with deterministic: off
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = before


def test_model_summary_counts_layers_trainable_and_total_parameters(tmp_path, capsys):
    from trainscale.callbacks import ModelSummary
    from trainscale.callbacks.model_summary import summarize

    net = nn.Sequential(nn.Linear(10, 20), nn.Sequential(nn.Linear(20, 5), nn.ReLU()), nn.Linear(5, 1))
    net[2].requires_grad_(False)
    summary = summarize(net, max_depth=1)
    assert [(l.name, l.type, l.params) for l in summary.layers] == [("0", "Linear", 220), ("1", "Sequential", 105),
                                                                   ("2", "Linear", 6)]
    assert (summary.trainable_params, summary.total_params) == (325, 331)
    assert summary.size_mb == pytest.approx(331 * 4 / 1e6)
    assert [l.name for l in summarize(net, max_depth=-1).layers] == ["0", "1", "1.0", "1.1", "2"]
    text = str(summary)
    for line in ("325       Trainable params", "6         Non-trainable params", "331       Total params",
                 "0.001     Total estimated model params size (MB)"):
        assert line in text
    with pytest.raises(ValueError, match="max_depth"):
        ModelSummary(max_depth=-2)
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(Watched(), _loader(4))
    assert "Total estimated model params size (MB)" in capsys.readouterr().out  # the default ModelSummary
    _trainer(tmp_path, max_epochs=1, enable_model_summary=False).fit(Watched(), _loader(4))
    assert "Total params" not in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "match"), [
    ({"val_check_interval": 0}, "val_check_interval"), ({"val_check_interval": 1.5}, "val_check_interval"),
    ({"check_val_every_n_epoch": 0}, "check_val_every_n_epoch"),
    ({"check_val_every_n_epoch": None, "val_check_interval": 0.5}, "must then be an int|must be an int"),
    ({"num_sanity_val_steps": -2}, "num_sanity_val_steps"), ({"fast_dev_run": -1}, "fast_dev_run"),
    ({"max_time": "1:00:00"}, "DD:HH:MM:SS"), ({"max_time": {"hourz": 1}}, "max_time"), ({"max_time": 5}, "max_time"),
    ({"overfit_batches": 1.5}, "overfit_batches"), ({"deterministic": "yes"}, "deterministic"), ({"benchmark": "yes"}, "benchmark"),
    ({"enable_model_summary": 1}, "enable_model_summary")])
def test_loop_flags_are_validated(flags, match):
    with pytest.raises(ValueError, match=match):
        resolve_trainer_config(**flags)


def test_debugging_flags_resolve_as_lightnings():
    from datetime import timedelta

    cfg = resolve_trainer_config(fast_dev_run=True, max_epochs=7, val_check_interval=3)
    assert (cfg.fast_dev_run, cfg.max_steps, cfg.max_epochs, cfg.num_sanity_val_steps, cfg.val_check_interval) == (
        True, 1, 1, 0, None)
    assert (cfg.limit_train_batches, cfg.limit_val_batches, cfg.limit_test_batches) == (1, 1, 1)
    cfg = resolve_trainer_config(overfit_batches=0.1, limit_train_batches=5)
    assert (cfg.limit_train_batches, cfg.limit_val_batches) == (0.1, 0.1)
    assert resolve_trainer_config(max_time="01:02:03:04").max_time == timedelta(days=1, hours=2, minutes=3, seconds=4)
    assert resolve_trainer_config(max_time={"minutes": 90}).max_time == timedelta(minutes=90)


# -- a time-based val_check_interval (Lightning 2.6): the clock is faked, so the steps do not depend on the machine -----
# Each training step moves the clock 1000 s on and each validation 1200 s; the interval is 2500 s ("00:00:41:40").
# Counted from each validation's end, 3 steps pass between validations (3000 s >= 2500 s); counted from the moment
# the previous one was due, 2 would (2000 s + 1200 s of validation).

@pytest.mark.timeout(60)
@pytest.mark.parametrize("interval", ["00:00:41:40", {"seconds": 2500}, timedelta(seconds=2500)])
def test_a_duration_validates_when_that_much_time_has_passed_since_the_last_validation(tmp_path, interval):
    trainer = workers.fit_on_a_fake_clock(str(tmp_path), 1000.0, {"max_epochs": 1, "val_check_interval": interval})
    # 10 steps; the epoch's 10th is 1000 s after a validation: its end does not validate (1.0 would)
    assert trainer.validated_at == [3, 6, 9]


@pytest.mark.timeout(60)
def test_a_duration_validates_only_in_the_epochs_check_val_every_n_epoch_names(tmp_path):
    trainer = workers.fit_on_a_fake_clock(str(tmp_path), 1000.0, {
        "max_epochs": 2, "val_check_interval": timedelta(seconds=2500), "check_val_every_n_epoch": 2})
    # epoch 0's 10 000 s count: its first step validates, then every 3rd; step 20 ends the epoch and is due
    assert trainer.validated_at == [11, 14, 17, 20]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_duration_validates_after_the_same_step_on_every_rank_by_rank_zeros_clock(tmp_path):
    from tests.helpers import run_distributed

    # rank 1's clock would say step 9 only: the ranks would part ways in the validation's all-reduce
    assert run_distributed(workers.clocks_apart_body, str(tmp_path), timeout=55) == [[3, 6, 9], [3, 6, 9]]


def test_a_duration_is_read_as_lightning_reads_it():
    cfg = resolve_trainer_config(val_check_interval="00:01:00:30", check_val_every_n_epoch=None)
    assert cfg.val_check_interval == timedelta(hours=1, seconds=30) and cfg.val_check_seconds == 3630.0
    assert resolve_trainer_config(val_check_interval={"minutes": 2}).val_check_seconds == 120.0
    assert resolve_trainer_config(val_check_interval="0:0:1:75").val_check_seconds == 135.0  # Lightning's int parts
    assert resolve_trainer_config(val_check_interval=3).val_check_seconds == math.inf
    assert resolve_trainer_config(fast_dev_run=True, val_check_interval="00:00:00:05").val_check_interval is None
    for bad, match in (("1:00:00", "DD:HH:MM:SS"), ({"hourz": 1}, "val_check_interval"),
                       (timedelta(seconds=-1), "not negative")):
        with pytest.raises(ValueError, match=match):
            resolve_trainer_config(val_check_interval=bad)
