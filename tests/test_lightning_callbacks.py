"""Lightning's callbacks that ports import from ``lightning.pytorch.callbacks``, run in one process on small
``TensorDataset`` loaders: what each callback is given and what it does to the run."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainscale.callbacks import BasePredictionWriter
from trainscale.lightning.module import TrainingModule
from trainscale.loop.trainer import Trainer


class Tiny(TrainingModule):
    """A linear model whose ``predict_step`` returns its output and the batch index."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def predict_step(self, batch, batch_idx):
        return {"y": self.layer(batch[0]), "batch_idx": batch_idx}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader(n=10, batch_size=4):
    x = torch.arange(2.0 * n).reshape(n, 2)
    return DataLoader(TensorDataset(x, torch.zeros(n)), batch_size=batch_size)


def _trainer(tmp_path, **kw):
    kw.setdefault("enable_model_summary", False)
    return Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, **kw)


class Recorder(BasePredictionWriter):
    def __init__(self, write_interval):
        super().__init__(write_interval)
        self.batches, self.epochs = [], []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((prediction["batch_idx"], batch_indices, batch[0].shape[0], batch_idx, dataloader_idx))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.epochs.append((predictions, batch_indices))


@pytest.mark.parametrize("interval", ["batch", "epoch", "batch_and_epoch"])
def test_prediction_writer_is_called_at_its_interval(tmp_path, interval):
    writer = Recorder(interval)
    model = Tiny()
    returned = _trainer(tmp_path, callbacks=[writer]).predict(model, _loader())
    on_batch, on_epoch = interval != "epoch", interval != "batch"
    assert writer.batches == ([(0, None, 4, 0, 0), (1, None, 4, 1, 0), (2, None, 2, 2, 0)] if on_batch else [])
    assert len(writer.epochs) == int(on_epoch)
    if on_epoch:
        predictions, indices = writer.epochs[0]
        assert [p["batch_idx"] for p in predictions] == [0, 1, 2]
        assert indices == [[None, None, None]]
        with torch.no_grad():
            expected = model.layer(torch.arange(20.0).reshape(10, 2))
        torch.testing.assert_close(torch.cat([p["y"] for p in predictions]), expected)
        torch.testing.assert_close(torch.cat([p["y"] for p in returned]), expected)


def test_prediction_writer_refuses_an_unknown_interval():
    with pytest.raises(ValueError, match="`write_interval` should be one of"):
        BasePredictionWriter("step")


def test_prediction_writer_without_its_method_raises_not_implemented(tmp_path):
    with pytest.raises(NotImplementedError):
        _trainer(tmp_path, callbacks=[BasePredictionWriter("epoch")]).predict(Tiny(), _loader())
