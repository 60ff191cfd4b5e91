"""Lightning's examples/pytorch/bug_report/bug_report_model.py, ported to trainscale: only the imports changed
(docs/lightning.md, "What to change"), and ``devices`` is passed through for the 2-process run.

    python examples/lightning/bug_report_model.py
    python examples/lightning/bug_report_model.py --devices 2     # trainscale: 2 processes (ddp on CPUs)
"""

import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

from trainscale import Trainer  # was: from lightning.pytorch import LightningModule, Trainer
from trainscale import TrainingModule as LightningModule


class RandomDataset(Dataset):
    def __init__(self, size, length):
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return self.len


class BoringModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        loss = self(batch).sum()
        self.log("train_loss", loss)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        loss = self(batch).sum()
        self.log("valid_loss", loss)

    def test_step(self, batch, batch_idx):
        loss = self(batch).sum()
        self.log("test_loss", loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


def run(devices=1):
    train_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    val_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    test_data = DataLoader(RandomDataset(32, 64), batch_size=2)

    model = BoringModel()
    trainer = Trainer(
        default_root_dir=os.getcwd(),
        limit_train_batches=1,
        limit_val_batches=1,
        limit_test_batches=1,
        num_sanity_val_steps=0,
        max_epochs=1,
        enable_model_summary=False,
        devices=devices,  # trainscale: for the 2-process run
    )
    trainer.fit(model, train_dataloaders=train_data, val_dataloaders=val_data)
    return trainer.test(model, dataloaders=test_data)


if __name__ == "__main__":
    run(devices=int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 1)
