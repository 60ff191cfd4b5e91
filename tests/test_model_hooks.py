"""The module hooks that set a stage up and feed it batches, as Lightning 2.6 calls them: ``configure_callbacks``,
``configure_model``, the batch-transfer hooks, the evaluation mode hooks, and the warning for a hook trainscale never
calls. Each hook is shown to change what a run computes (not only to be called), and its place in Lightning's order
(``core/hooks.py``, ``loops/*.py``, ``trainer/call.py``) is checked against the hooks around it."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests import hook_workers as hw
from tests.helpers import run_distributed
from trainscale.callbacks import Callback, EarlyStopping, ModelCheckpoint, merge_model_callbacks
from trainscale.lightning.data_sources import DataModule
from trainscale.lightning.module import CALLED_HOOKS, LIGHTNING_HOOKS, TrainingModule, uncalled_hooks
from trainscale.loop.trainer import Trainer


def _trainer(tmp_path, **kw):
    flags = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                 max_epochs=1, num_sanity_val_steps=0)
    return Trainer(**{**flags, **kw})


def _loader(n=4, batch_size=2):
    return DataLoader(hw.regression_data(n), batch_size=batch_size)


class Linear(TrainingModule):
    """One linear layer with fixed weights (``hw.initial_layer``); each step's loss and each batch it saw recorded."""

    def __init__(self):
        super().__init__()
        self.layer = hw.initial_layer()
        self.losses, self.seen = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(x.clone())
        loss = F.mse_loss(self.layer(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.seen.append(batch[0].clone())
        self.log("val_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.seen.append(batch[0].clone())
        self.log("test_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


# -- the batch-transfer hooks ------------------------------------------------------------------------------------------
class Transferring(Linear):
    """Records the three hooks and each stage's batch-start hook, with the batch they saw."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.calls.append(("on_before_batch_transfer", dataloader_idx))
        return batch

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.calls.append(("transfer_batch_to_device", dataloader_idx))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.calls.append(("on_after_batch_transfer", dataloader_idx))
        return batch


for _stage in ("train", "validation", "test", "predict"):
    def _start(self, batch, batch_idx, *rest, _name=f"on_{_stage}_batch_start"):
        self.calls.append((_name, batch_idx))
    setattr(Transferring, f"on_{_stage}_batch_start", _start)


def _per_batch(start_hook, batches, dataloader_idx=0):
    return [call for i in range(batches) for call in (("on_before_batch_transfer", dataloader_idx),
                                                       ("transfer_batch_to_device", dataloader_idx),
                                                       ("on_after_batch_transfer", dataloader_idx), (start_hook, i))]


@pytest.mark.timeout(60)
def test_batch_transfer_hooks_run_in_lightnings_order_before_each_batch_start_hook_of_every_stage(tmp_path):
    model = Transferring()
    trainer = _trainer(tmp_path)
    trainer.fit(model, _loader(4), _loader(2))
    assert model.calls == [*_per_batch("on_train_batch_start", 2), *_per_batch("on_validation_batch_start", 1)]
    for verb, hook in (("test", "on_test_batch_start"), ("predict", "on_predict_batch_start")):
        model.calls.clear()
        getattr(trainer, verb)(model, _loader(4))
        assert model.calls == _per_batch(hook, 2), verb
    model.calls.clear()
    trainer.validate(model, [_loader(2), _loader(2)])  # several loaders: each batch gets its loader's index
    assert [c for c in model.calls if c[0] == "on_after_batch_transfer"] == [("on_after_batch_transfer", 0),
                                                                             ("on_after_batch_transfer", 1)]


class ScaledAfterTransfer(Linear):
    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x * hw.SCALE, y


class NegatedBeforeTransfer(Linear):
    def on_before_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return -x, y


class Pair:
    """A batch type trainscale's default move does not know (no ``.to``): only the module's hook can unpack it."""

    def __init__(self, x, y):
        self.x, self.y = x, y


class CustomTransfer(Linear):
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return (batch.x.to(device) + 1.0, batch.y.to(device))  # its own unpacking, and a shift we can see


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("module", "transform"), [(ScaledAfterTransfer, lambda x: x * hw.SCALE),
                                                    (NegatedBeforeTransfer, lambda x: -x)])
def test_a_batch_hook_that_changes_the_batch_changes_the_loss_and_the_predictions(tmp_path, module, transform):
    x, y = hw.regression_data(4).tensors
    model = module()
    expected_loss = F.mse_loss(hw.initial_layer()(transform(x[:2])), y[:2]).item()  # the first step's, before it
    trainer = _trainer(tmp_path, max_steps=1)
    trainer.fit(model, _loader(4))
    assert model.losses[0] == pytest.approx(expected_loss, rel=1e-6)
    assert model.losses[0] != pytest.approx(F.mse_loss(hw.initial_layer()(x[:2]), y[:2]).item(), rel=1e-3)
    predictions = torch.cat(trainer.predict(model, _loader(4)))
    torch.testing.assert_close(predictions, model.layer(transform(x)).detach())


@pytest.mark.timeout(60)
def test_transfer_batch_to_device_moves_a_batch_type_of_its_own(tmp_path):
    x, y = hw.regression_data(4).tensors
    loader = DataLoader(TensorDataset(x, y), batch_size=2, collate_fn=lambda rows: Pair(
        torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])))
    model = CustomTransfer()
    _trainer(tmp_path, max_steps=1).fit(model, loader)
    torch.testing.assert_close(model.seen[0], x[:2] + 1.0)
    assert model.losses[0] == pytest.approx(F.mse_loss(hw.initial_layer()(x[:2] + 1.0), y[:2]).item(), rel=1e-6)


class ScalingData(DataModule):
    def train_dataloader(self):
        return _loader(4)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch[0] * 10.0, batch[1]


@pytest.mark.timeout(60)
def test_a_data_modules_batch_hook_wins_over_the_modules_with_lightnings_warning(tmp_path):
    x = hw.regression_data(4).tensors[0]
    model = ScaledAfterTransfer()
    with pytest.warns(UserWarning, match="overridden `on_after_batch_transfer` in both"):
        _trainer(tmp_path, max_steps=1).fit(model, datamodule=ScalingData())
    torch.testing.assert_close(model.seen[0], x[:2] * 10.0)


@pytest.mark.timeout(60)
def test_without_batch_hooks_the_loops_keep_the_runtimes_move(tmp_path):
    trainer = _trainer(tmp_path, max_steps=1)
    trainer.fit(Linear(), _loader(4))
    assert trainer.batch_transfer is None  # the step calls Runtime.to_device, as before (test_benchmarks counts it)
    trainer.fit(ScaledAfterTransfer(), _loader(4))
    assert trainer.batch_transfer is not None


# -- configure_model ------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_configure_model_runs_after_setup_in_every_stage_and_builds_the_layer_that_trains(tmp_path):
    model = hw.BuiltInConfigureModel()
    trainer = _trainer(tmp_path)
    trainer.fit(model, _loader(8), _loader(4))
    trainer.validate(model, _loader(4))
    trainer.predict(model, _loader(4))
    assert model.calls == ["setup:fit", "configure_model", "configure_optimizers", "setup:validate",
                           "configure_model", "setup:predict", "configure_model"]
    assert model.builds == 1
    trained = {k: v for k, v in model.state_dict().items()}
    for key, value in hw.reference_weights(1, 2, 4).items():  # the layer it built is the one the optimizer trained
        torch.testing.assert_close(trained[key], value)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_configure_model_under_fsdp_on_two_ranks_builds_a_sharded_layer_that_matches_plain_pytorch(tmp_path):
    ranks = run_distributed(hw.configure_model_fsdp_body, str(tmp_path), timeout=55)
    reference = hw.reference_weights(2, 2, 2)
    for out in ranks:
        assert out["calls"] == ["setup:fit", "configure_model", "configure_optimizers", "setup:validate",
                                "configure_model"]
        assert out["builds"] == 1 and out["local_rows"] is not None  # sharded: a DTensor as the optimizer was built
        for key, value in reference.items():
            torch.testing.assert_close(out["weights"][key], value)
    assert sum(out["local_rows"] for out in ranks) == 1  # the (1, 4) weight's one row lives on one rank


# -- configure_callbacks -----------------------------------------------------------------------------------------------
class StopAfterFirstEpoch(Callback):
    def on_train_epoch_end(self, trainer, module):
        trainer.should_stop = True


class WithCallbacks(Linear):
    def __init__(self, callbacks):
        super().__init__()
        self.made = callbacks

    def configure_callbacks(self):
        return self.made


@pytest.mark.timeout(60)
def test_configure_callbacks_adds_its_callbacks_which_change_the_run(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=4)
    trainer.fit(WithCallbacks(StopAfterFirstEpoch()), _loader(4))
    assert trainer.current_epoch == 1  # 4 without the module's callback
    assert isinstance(trainer.callbacks[-1], ModelCheckpoint)  # checkpoint callbacks last, as Lightning


@pytest.mark.timeout(60)
def test_configure_callbacks_replaces_the_trainers_callback_of_its_type(tmp_path):
    mine = EarlyStopping("val_loss", patience=0, min_delta=10.0)  # no step improves by 10: stops after 2 epochs
    theirs = EarlyStopping("val_loss", patience=100)
    trainer = _trainer(tmp_path, max_epochs=5, callbacks=[theirs])
    trainer.fit(WithCallbacks([mine]), _loader(4), _loader(2))
    assert mine in trainer.callbacks and theirs not in trainer.callbacks
    assert trainer.current_epoch == 2


def test_merge_model_callbacks_follows_lightnings_rules():
    class Mine(StopAfterFirstEpoch):
        pass

    plain, stop, checkpoint = Callback(), StopAfterFirstEpoch(), ModelCheckpoint()
    mine, own_checkpoint = Mine(), ModelCheckpoint(monitor="val_loss")
    merged = merge_model_callbacks([checkpoint, plain, stop], [own_checkpoint, mine])
    # a subclass replaces its parent's, a plain Callback stays, the two checkpoints go last in their order
    assert merged == [plain, mine, own_checkpoint]
    assert merge_model_callbacks([plain], None) == [plain]
    with pytest.raises(TypeError, match="configure_callbacks returned a str"):
        merge_model_callbacks([], ["not a callback"])


# -- the evaluation mode hooks -----------------------------------------------------------------------------------------
class MonteCarloDropout(Linear):
    """Dropout kept on while predicting and validating (Monte Carlo dropout), through the mode hooks."""

    def __init__(self, keep_dropout):
        super().__init__()
        self.dropout = nn.Dropout(0.5)
        self.keep_dropout = keep_dropout
        self.modes, self.order = [], []

    def _keep(self):
        self.eval()
        if self.keep_dropout:
            self.dropout.train()

    def on_validation_model_eval(self):
        self.order.append("on_validation_model_eval")
        self._keep()

    def on_test_model_eval(self):
        self.order.append("on_test_model_eval")
        self._keep()

    def on_predict_model_eval(self):
        self.order.append("on_predict_model_eval")
        self._keep()

    def on_validation_start(self):
        self.order.append("on_validation_start")

    def on_validation_end(self):
        self.order.append("on_validation_end")

    def validation_step(self, batch, batch_idx):
        self.modes.append(self.dropout.training)
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self.modes.append(self.dropout.training)
        return super().test_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self.layer(self.dropout(batch[0]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keep_dropout", [True, False])
def test_the_mode_hooks_decide_the_evaluation_mode_and_so_the_predictions(tmp_path, keep_dropout):
    torch.manual_seed(0)
    model = MonteCarloDropout(keep_dropout)
    trainer = _trainer(tmp_path)
    first, second = (torch.cat(trainer.predict(model, _loader(4))) for _ in range(2))
    assert torch.equal(first, second) is not keep_dropout  # dropout on: two passes differ
    trainer.validate(model, _loader(2))
    trainer.test(model, _loader(2))
    assert model.modes == [keep_dropout, keep_dropout]
    assert model.order == ["on_predict_model_eval", "on_predict_model_eval", "on_validation_model_eval",
                           "on_validation_start", "on_validation_end", "on_test_model_eval"]
    assert model.training and model.dropout.training  # every submodule's mode put back after each stage


class TrainHookOverridden(Linear):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Dropout(0.1)
        self.frozen.eval()  # the user's choice: kept by the default, lost by an override that calls train()
        self.order = []

    def on_validation_end(self):
        self.order.append("on_validation_end")

    def on_validation_model_train(self):
        self.order.append("on_validation_model_train")
        super().on_validation_model_train()


@pytest.mark.timeout(60)
def test_on_validation_model_train_replaces_the_restored_modes_after_on_validation_end(tmp_path):
    model = TrainHookOverridden()
    _trainer(tmp_path).validate(model, _loader(2))
    assert model.order == ["on_validation_end", "on_validation_model_train"]
    assert model.frozen.training  # its train(): Lightning's default hook; without the override it stays in eval mode
    plain = Linear()
    plain.frozen = nn.Dropout(0.1).eval()
    _trainer(tmp_path).validate(plain, _loader(2))
    assert not plain.frozen.training and plain.layer.training


class ZeroGradBeforeValidation(Linear):
    def __init__(self):
        super().__init__()
        self.zeroed = 0

    def on_validation_model_zero_grad(self):
        self.zeroed += 1
        super().on_validation_model_zero_grad()


@pytest.mark.timeout(60)
def test_on_validation_model_zero_grad_runs_before_each_validation_of_fit(tmp_path):
    model = ZeroGradBeforeValidation()
    trainer = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=1)
    trainer.fit(model, _loader(4), _loader(2))
    assert model.zeroed == len(trainer.validated_at) == 2  # not in the sanity check, as Lightning


# -- the guard against hooks trainscale never calls ----------------------------------------------------------------------
class WithSchedulerHook(Linear):
    def lr_scheduler_step(self, scheduler, metric):  # no scheduler: never called
        raise AssertionError("never called")


def _one_hook_uncalled(monkeypatch):
    """The guard as it would be if trainscale did not call ``lr_scheduler_step``."""
    monkeypatch.setattr("trainscale.lightning.module.CALLED_HOOKS", frozenset(LIGHTNING_HOOKS) - {"lr_scheduler_step"})


def test_every_lightning_hook_is_called_and_the_guard_names_one_that_would_not_be(monkeypatch):
    assert set(CALLED_HOOKS) == set(LIGHTNING_HOOKS)
    assert uncalled_hooks(WithSchedulerHook()) == []
    _one_hook_uncalled(monkeypatch)
    assert uncalled_hooks(WithSchedulerHook()) == ["lr_scheduler_step"]
    assert uncalled_hooks(Transferring()) == []
    plain = nn.Linear(1, 1)
    plain.lr_scheduler_step = lambda *args: None
    assert uncalled_hooks(plain) == []  # a plain module's methods are not Lightning's hooks


@pytest.mark.timeout(60)
def test_a_module_overriding_a_hook_trainscale_never_calls_is_warned_once_per_stage(tmp_path, monkeypatch):
    with warnings.catch_warnings():  # every hook is called: no warning
        warnings.filterwarnings("error", message=".*which Lightning calls and trainscale never does")
        _trainer(tmp_path, max_steps=1).fit(WithSchedulerHook(), _loader(4))
    _one_hook_uncalled(monkeypatch)
    trainer = _trainer(tmp_path, max_steps=1)
    with pytest.warns(UserWarning, match="overrides `lr_scheduler_step`, which Lightning calls") as caught:
        trainer.fit(WithSchedulerHook(), _loader(4))
    assert sum("lr_scheduler_step" in str(w.message) for w in caught) == 1
    with pytest.warns(UserWarning, match="`lr_scheduler_step`"):
        trainer.predict(WithSchedulerHook(), _loader(2))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*which Lightning calls and trainscale never does")
        _trainer(tmp_path, max_steps=1).fit(Transferring(), _loader(4))
