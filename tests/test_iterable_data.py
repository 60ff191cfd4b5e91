"""Iterable data (epochs end when the iterator does), a validation loader that has no length, a module without
``validation_step``, and ``validate``/``test``/``predict`` without a model after ``fit``."""

import os
import random
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from tests.helpers import run_distributed
from trainscale.lightning.module import TrainingModule
from trainscale.loop.trainer import Trainer


class RandomLength(IterableDataset):
    """A generator of a different, random number of samples every epoch (no ``__len__``); ``lengths`` records them."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.lengths = []

    def __iter__(self):
        n = self.rng.randint(5, 11)
        self.lengths.append(n)
        for i in range(n):
            yield torch.full((2,), float(i)), torch.tensor(i % 2)


class Stream(IterableDataset):
    """An endless stream of this rank's samples (no ``__len__``): rank r of W yields r, r + W, r + 2W, ..."""

    shards_by_rank = True

    def __iter__(self):
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        i = rank
        while True:
            yield torch.full((2,), float(i)), torch.tensor(i % 2)
            i += world


class Seen(TrainingModule):
    """Records the first feature of every training sample it sees."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.extend(int(v) for v in x[:, 0].tolist())
        return nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(tmp_path, **kw):
    return Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, **kw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_epoch_of_a_random_length_generator_ends_when_its_iterator_does(tmp_path, accumulate):
    data = RandomLength(seed=accumulate)
    model = Seen()
    trainer = _trainer(tmp_path, max_epochs=3, accumulate_grad_batches=accumulate)
    trainer.fit(model, DataLoader(data, batch_size=2))
    batches = [-(-n // 2) for n in data.lengths]  # batches of 2, the last one short
    assert len(data.lengths) == 3 and model.seen == [i for n in data.lengths for i in range(n)]
    assert trainer.global_step == sum(-(-b // accumulate) for b in batches)  # a last short step is taken too
    assert not any(r.get("partial") for r in trainer.history)  # each epoch ran to its end


@pytest.mark.timeout(60)
def test_an_endless_iterable_trains_by_max_steps_or_limit_train_batches(tmp_path):
    by_steps = _trainer(tmp_path, max_epochs=5, max_steps=7)
    by_steps.fit(Seen(), DataLoader(Stream(), batch_size=2))
    assert by_steps.global_step == 7
    model = Seen()
    by_limit = _trainer(tmp_path, max_epochs=2, limit_train_batches=3)
    by_limit.fit(model, DataLoader(Stream(), batch_size=2))
    assert by_limit.global_step == 6 and model.seen == list(range(6)) * 2  # each epoch starts the iterator anew
    with pytest.raises(ValueError, match="pass a number of batches"):
        _trainer(tmp_path, limit_train_batches=0.5).fit(Seen(), DataLoader(Stream(), batch_size=2))


class Eight(IterableDataset):
    """Eight samples, without ``__len__``: the epoch's length is known only when its iterator ends."""

    def __iter__(self):
        for i in range(8):
            yield torch.full((2,), float(i)), torch.tensor(i % 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data", [Eight(), TensorDataset(torch.zeros(8, 2), torch.zeros(8, dtype=torch.long))],
                         ids=["iterable", "map-style"])
def test_a_step_save_on_the_last_step_of_an_iterables_epoch_folds_into_the_epoch_end_save(tmp_path, data):
    """As for a map-style set: the step save due on the epoch's last step is the epoch-end save, written once."""
    from trainscale.callbacks import ModelCheckpoint
    from trainscale.checkpointing.run_dirs import checkpoint_name

    trainer = _trainer(tmp_path, max_epochs=1, enable_model_summary=False,
                       callbacks=[ModelCheckpoint.trainer_default(1, every_n_train_steps=2, keep_last=None)])
    trainer.fit(Seen(), DataLoader(data, batch_size=2))  # 4 steps: step saves at 2 and 4, the epoch ends at 4
    assert trainer.checkpoints.summary()["saves"] == 2
    assert sorted(p.name for p in (trainer.run_dir / "checkpoints").glob("*.ckpt")) == \
        [checkpoint_name(0, 2), checkpoint_name(0, 4)]


def stream_body(rank: int, root: str) -> list:
    trainer = Trainer(accelerator="cpu", devices="auto", strategy="ddp", max_epochs=1, limit_train_batches=3,
                      enable_progress_bar=False, default_root_dir=root, timeout=60)
    model = Seen()
    trainer.fit(model, DataLoader(Stream(), batch_size=2))
    trainer.runtime.teardown()
    return [trainer.global_step, model.seen]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_under_ddp_each_rank_reads_its_own_shard_of_an_iterable(tmp_path):
    (steps0, seen0), (steps1, seen1) = run_distributed(stream_body, str(tmp_path), timeout=50)
    assert steps0 == steps1 == 3
    assert seen0 == [0, 2, 4, 6, 8, 10] and seen1 == [1, 3, 5, 7, 9, 11]


class Validated(Seen):
    def validation_step(self, batch, batch_idx):
        self.log("val_mean_x", batch[0][:, 0].mean())


@pytest.mark.timeout(60)
def test_a_validation_loader_without_a_length_is_validated(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1, limit_train_batches=2)
    val = DataLoader(RandomLength(seed=0), batch_size=100)  # one batch of 5..11 samples: 0, 1, ...
    trainer.fit(Validated(), DataLoader(Stream(), batch_size=2), val)
    n = val.dataset.lengths[-1]  # the epoch end's pass (the sanity check, num_sanity_val_steps=2, read one before)
    assert len(val.dataset.lengths) == 2
    assert trainer.history[0]["val_mean_x"] == pytest.approx((n - 1) / 2)


@pytest.mark.timeout(60)
def test_a_module_without_validation_step_skips_validation_with_a_warning(tmp_path):
    loader = DataLoader(TensorDataset(torch.randn(4, 2), torch.zeros(4, dtype=torch.long)), batch_size=2)
    trainer = _trainer(tmp_path, max_epochs=1)
    with pytest.warns(UserWarning, match="You passed in a `val_dataloader` but have no `validation_step`. Skipping val loop"):
        trainer.fit(Seen(), loader, loader)
    assert not any(k.startswith("val_") for k in trainer.history[0])
    with pytest.raises(ValueError, match="defines training_step but no validation_step"):
        trainer.validate(Seen(), loader)


class Predicting(Validated):
    def test_step(self, batch, batch_idx):
        self.log("test_out", self.layer(batch[0]).sum())

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])


@pytest.mark.timeout(60)
def test_test_and_predict_without_a_model_use_the_fitted_one(tmp_path):
    loader = DataLoader(TensorDataset(torch.randn(6, 2), torch.zeros(6, dtype=torch.long)), batch_size=2)
    with pytest.raises(ValueError, match="needs an earlier fit"):
        _trainer(tmp_path).test(dataloaders=loader)
    model = Predicting()
    trainer = _trainer(tmp_path, max_epochs=2)
    trainer.fit(model, loader)
    with pytest.warns(UserWarning, match="The best model of the previous `fit` call will be used"):
        tested = trainer.test(dataloaders=loader)
    with pytest.warns(UserWarning, match="The best model of the previous `fit` call will be used"):
        predicted = trainer.predict(dataloaders=loader)
    # the newest checkpoint (no monitor) holds the weights the fit ended with
    assert tested == trainer.test(model, loader)
    torch.testing.assert_close(predicted, trainer.predict(model, loader))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trainer.validate(dataloaders=loader, ckpt_path="last")[0]  # a given ckpt_path: no warning
