"""A script in Lightning's LightningCLI style: your module and data module, their options from their
``__init__`` signatures, the Trainer's from its flags, all from the command line or a YAML file.

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml --trainer.devices 1 --model.lr 0.05
    python examples/lightning_cli.py fit --print_config      # every option and its value, as YAML
    python examples/lightning_cli.py fit --help

The YAML asks for 2 CPU processes: the Trainer starts the script again under torchrun, and every rank parses
the same command line.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainscale import DataModule, TrainingModule
from trainscale.cli import LightningCLI


class Regression(TrainingModule):
    """A small MLP fitted to the sum of its inputs."""

    def __init__(self, hidden: int = 16, lr: float = 0.1) -> None:
        """
        Args:
            hidden: hidden units.
            lr: the SGD learning rate.
        """
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_mse", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Points(DataModule):
    """Random points in 4 dimensions (a fixed seed), their sum as the target."""

    def __init__(self, samples: int = 256, batch_size: int = 16) -> None:
        """
        Args:
            samples: points in the data set.
            batch_size: points per batch on each device.
        """
        super().__init__()
        self.samples, self.batch_size = samples, batch_size

    def setup(self, stage: str | None = None) -> None:
        x = torch.randn(self.samples, 4, generator=torch.Generator().manual_seed(0))
        self.points = TensorDataset(x, x.sum(dim=1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self.points, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.points, batch_size=self.batch_size)


if __name__ == "__main__":
    cli = LightningCLI(Regression, Points)
