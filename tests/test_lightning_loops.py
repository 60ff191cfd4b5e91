"""Lightning's training, evaluation and prediction loops as a ported module meets them: what the loops tell the
samplers, what a step may return, and the errors where Lightning refuses a step's output or an ``optimizer_step``."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Sampler, TensorDataset

from trainscale.lightning.module import TrainingModule
from trainscale.loop.trainer import Trainer


class Linear(TrainingModule):
    """y = w x on two features, trained with SGD; the loss is the mean squared output."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.layer(batch[0]).pow(2).mean())

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.layer(batch[0]).pow(2).mean())

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _data(n=8):
    x = torch.linspace(-1, 1, 2 * n).reshape(n, 2)
    return TensorDataset(x, torch.zeros(n))


def _loader(n=8, batch_size=2):
    return DataLoader(_data(n), batch_size=batch_size)


def _trainer(tmp_path, **kw):
    kw.setdefault("enable_model_summary", False)
    return Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, **kw)


# -- the epoch each sampler is told ---------------------------------------------------------------------------------
class EpochSeeded(Sampler[int]):
    """A sampler whose order depends on the epoch it is told (a bucketing or distributed sampler's pattern), noting
    each ``set_epoch``."""

    def __init__(self, n: int):
        self.n, self.epoch, self.told = n, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.told.append(epoch)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist())

    def __len__(self):
        return self.n


def _sampled(n=8, batch_sampler=False):
    """A loader over ``EpochSeeded``, given as its ``sampler`` or inside a ``BatchSampler``; and the sampler."""
    sampler = EpochSeeded(n)
    if batch_sampler:
        return DataLoader(_data(n), batch_sampler=BatchSampler(sampler, batch_size=2, drop_last=False)), sampler
    return DataLoader(_data(n), batch_size=2, sampler=sampler), sampler


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch_sampler", [False, True])
def test_each_evaluation_tells_its_loaders_sampler_the_epoch(tmp_path, batch_sampler):
    train, train_sampler = _sampled()
    val, val_sampler = _sampled(batch_sampler=batch_sampler)
    trainer = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=1, limit_val_batches=1)
    trainer.fit(Linear(), train, val)
    assert train_sampler.told == [0, 1]  # one per epoch, so the order changes from epoch to epoch
    assert val_sampler.told == [0, 0, 1]  # the sanity check's, then each epoch's validation: the running epoch
    for method in ("validate", "test", "predict"):  # outside fit: the epochs done
        loader, sampler = _sampled(batch_sampler=batch_sampler)
        getattr(trainer, method)(dataloaders=loader)
        assert sampler.told == [2], method


# -- optimizer_step must run its closure ----------------------------------------------------------------------------
class StepsWithoutClosure(Linear):
    """An ``optimizer_step`` that steps the optimizer without the closure (so without the hooks and clipping it
    runs), as a port might write it."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step()


class SkipsEverything(Linear):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", [StepsWithoutClosure, SkipsEverything])
def test_an_optimizer_step_that_never_runs_its_closure_is_lightnings_error(tmp_path, module):
    trainer = _trainer(tmp_path, max_steps=1, gradient_clip_val=1.0)
    with pytest.raises(ValueError, match=r"The closure hasn't been executed. HINT: did you call `optimizer_closure\(\)`"):
        trainer.fit(module(), _loader())


# -- what a training_step may return --------------------------------------------------------------------------------
class TwoLosses(Linear):
    """Manual optimization returning a dict of named losses and no ``"loss"`` (a GAN's generator and discriminator
    losses), and noting each ``on_train_batch_end``'s ``outputs``."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.outputs: list = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.layer(batch[0]).pow(2).mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return {"g_loss": loss.detach(), "note": "kept as returned"}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.outputs.append(outputs)


@pytest.mark.timeout(60)
def test_a_manual_training_step_may_return_a_dict_without_a_loss(tmp_path):
    model = TwoLosses()
    trainer = _trainer(tmp_path, max_steps=2)
    trainer.fit(model, _loader())
    assert trainer.global_step == 2
    assert [sorted(o) for o in model.outputs] == [["g_loss", "note"]] * 2  # the dict, as Lightning's ManualResult
    assert model.outputs[0]["note"] == "kept as returned"
    assert all("train_loss" not in r for r in trainer.history)  # no loss returned: none recorded


class Returns(Linear):
    def __init__(self, output, manual=False):
        super().__init__()
        self.output, self.automatic_optimization = output, not manual

    def training_step(self, batch, batch_idx):
        return self.output


@pytest.mark.parametrize(("output", "manual", "words"), [
    (5.0, False, "In automatic optimization, `training_step` must return a Tensor, a dict, or None"),
    ({"a": torch.tensor(5.0)}, False, "when `training_step` returns a dict, the 'loss' key needs to be present"),
    (5, True, "In manual optimization, `training_step` must either return a Tensor or have no return"),
])
def test_a_training_step_output_the_loop_cannot_use_is_refused_in_lightnings_words(tmp_path, output, manual, words):
    trainer = _trainer(tmp_path, max_steps=1)
    with pytest.raises(ValueError, match=re.escape(words)) as caught:
        trainer.fit(Returns(output, manual), _loader())
    assert isinstance(caught.value, TypeError)  # a wrong type, as trainscale raised it before


# -- what an evaluation step may return -----------------------------------------------------------------------------
class ReturnsAnything(Linear):
    """A ``validation_step`` returning what Lightning lets it return: predictions, strings, lists; noting each
    ``on_validation_batch_end``'s ``outputs``."""

    def __init__(self):
        super().__init__()
        self.outputs: list = []

    def validation_step(self, batch, batch_idx):
        preds = self.layer(batch[0])
        if batch_idx == 0:
            return {"preds": preds, "name": "first", "mse": preds.pow(2).mean(), "count": 2}
        return ["a list", 2, preds]

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.outputs.append(outputs)


@pytest.mark.timeout(60)
def test_an_evaluation_step_may_return_values_that_are_not_numbers(tmp_path):
    model = ReturnsAnything()
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model, _loader(), _loader(4))
    assert model.outputs[0]["name"] == "first" and model.outputs[0]["preds"].shape == (2, 1)  # as returned
    assert model.outputs[1][0] == "a list"
    record = trainer.history[-1]
    assert "val_mse" in record and "val_count" in record  # the numbers among them are averaged into the records
    assert not any(key.startswith(("val_preds", "val_name")) for key in record)
    assert trainer.validate(model, _loader(4)) == [{}]  # nothing logged: Lightning's result, no error


# -- Lightning's dataloader_iter steps ------------------------------------------------------------------------------
class FetchesItsOwn(Linear):
    def training_step(self, dataloader_iter):
        batch = next(dataloader_iter)
        return self.layer(batch[0]).pow(2).mean()


class PredictsFromIterator(Linear):
    def predict_step(self, dataloader_iter):
        return self.layer(next(dataloader_iter)[0])


@pytest.mark.parametrize(("module", "method", "step"), [(FetchesItsOwn, "fit", "training_step"),
                                                         (PredictsFromIterator, "predict", "predict_step")])
def test_a_step_taking_dataloader_iter_is_refused_naming_the_form_to_use(tmp_path, module, method, step):
    trainer = _trainer(tmp_path, max_steps=1)
    words = rf"{module.__name__}\.{step} takes `dataloader_iter`.*define {step}\(self, batch, batch_idx\)"
    with pytest.raises(ValueError, match=words):
        getattr(trainer, method)(module(), _loader())


# -- a batch of None -------------------------------------------------------------------------------------------------
def _none_every_other(samples):
    """A collate_fn that makes every other batch None (the first one included), as a filtering collate might."""
    _none_every_other.calls += 1
    return None if _none_every_other.calls % 2 else torch.utils.data.default_collate(samples)


@pytest.mark.timeout(60)
def test_a_none_batch_is_refused_naming_where_to_leave_it_out(tmp_path):
    _none_every_other.calls = 0
    loader = DataLoader(_data(), batch_size=2, collate_fn=_none_every_other)
    with pytest.raises(ValueError, match=r"the loader yielded None for a batch.*\"train_dataloader yielded None\".*"
                                         r"collate_fn"):
        _trainer(tmp_path, max_steps=2).fit(Linear(), loader)


# -- on_train_batch_start returning -1 ------------------------------------------------------------------------------
class EndsEpochsEarly(Linear):
    """Returns -1 from ``on_train_batch_start`` at batch 2 of each epoch, noting which batches trained, which got
    ``on_train_batch_end``, each validation, and ``is_last_batch`` at each epoch's end; a "step" and an "epoch"
    scheduler count their steps."""

    def __init__(self):
        super().__init__()
        self.trained, self.ended, self.validations, self.last_batch = [], [], 0, []

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 2 else None

    def training_step(self, batch, batch_idx):
        self.trained.append((self.current_epoch, batch_idx))
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ended.append((self.current_epoch, batch_idx))

    def on_validation_epoch_end(self):
        self.validations += 1

    def on_train_epoch_end(self):
        self.last_batch.append(self.trainer.is_last_batch)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        per_step = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.5 ** n)
        per_epoch = torch.optim.lr_scheduler.MultiplicativeLR(opt, lambda n: 0.1)
        return [opt], [{"scheduler": per_step, "interval": "step"}, {"scheduler": per_epoch, "interval": "epoch"}]


@pytest.mark.timeout(60)
def test_on_train_batch_start_returning_minus_one_ends_the_epoch_there(tmp_path):
    model = EndsEpochsEarly()
    trainer = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, limit_val_batches=1)
    trainer.fit(model, _loader(8), _loader(4))  # 4 batches an epoch
    assert model.trained == model.ended == [(0, 0), (0, 1), (1, 0), (1, 1)]  # the batches from 2 on skipped
    assert trainer.global_step == 4
    assert model.last_batch == [True, True]
    assert model.validations == 0  # Lightning validates after a batch that trained only
    # Lightning's schedulers at the skipped batch: the "step" one (3 steps an epoch: 2 trained and the skipped
    # batch's) and the "epoch" one, each epoch
    per_step, per_epoch = (config.scheduler for config in trainer.lr_scheduler_configs)
    assert (per_step.last_epoch, per_epoch.last_epoch) == (6, 2)
