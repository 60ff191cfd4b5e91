"""Lightning's loop flags with Lightning's semantics: limit_test_batches, limit_predict_batches, min_epochs, min_steps."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainscale.callbacks import EarlyStopping
from trainscale.lightning.module import TrainingModule
from trainscale.loop.config import resolve_trainer_config
from trainscale.loop.trainer import Trainer


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
    out = _trainer(tmp_path, limit_test_batches=2).test(model, _loader())
    assert model.steps["test"] == 2 and out["x"] == pytest.approx(1.5)  # samples 0..3
    predicted = _trainer(tmp_path, limit_predict_batches=0.4).predict(model, _loader())  # 5 batches × 0.4 = 2
    assert model.steps["predict"] == 2 and predicted.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "epochs"), [({}, 2), ({"min_epochs": 4}, 4), ({"min_steps": 13}, 3)])
def test_min_epochs_and_min_steps_hold_back_an_early_stop(tmp_path, flags, epochs):
    # score never improves: EarlyStopping(patience=1) asks to stop after epoch 2 (Lightning's wait_count >= patience);
    # Lightning's _can_stop_early lets it stop only once min_epochs epochs / min_steps steps (5 per epoch) are done
    trainer = _trainer(tmp_path, max_epochs=10, callbacks=[EarlyStopping("score", patience=1)], **flags)
    trainer.fit(Counted(), _loader(), _loader(2))
    assert len(trainer.history) == epochs


def test_the_new_flags_are_validated():
    for flags in ({"limit_test_batches": 0}, {"limit_predict_batches": 1.5}, {"min_epochs": 0}, {"min_steps": -1}):
        with pytest.raises(ValueError, match=next(iter(flags))):
            resolve_trainer_config(**flags)
