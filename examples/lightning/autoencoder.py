"""Lightning's examples/pytorch/basics/autoencoder.py, ported to trainscale (docs/lightning.md, "What to change"):
the imports changed, MNIST from torchvision replaced by the MNIST-5k images trainscale ships
(``trainscale.data.load_mnist5k``, no download), and ``LightningCLI`` replaced by its few lines of Trainer calls.

    python examples/lightning/autoencoder.py                  # 10 epochs on 4,000 images
    python examples/lightning/autoencoder.py --devices 2      # 2 processes (ddp on CPUs)
"""

import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

from trainscale import DataModule as LightningDataModule  # was: from lightning.pytorch import LightningDataModule,
from trainscale import Trainer, seed_everything  #            LightningModule, Trainer, callbacks, cli_lightning_logo
from trainscale import TrainingModule as LightningModule
from trainscale import callbacks
from trainscale.data import load_mnist5k  # was: from lightning.pytorch.demos.mnist_datamodule import MNIST
from trainscale.utilities import rank_zero_only  # was: from lightning.pytorch.utilities import rank_zero_only

try:  # was: from lightning.pytorch.utilities.imports import _TORCHVISION_AVAILABLE
    import torchvision
    from torchvision.utils import save_image

    _TORCHVISION_AVAILABLE = True
except ImportError:
    _TORCHVISION_AVAILABLE = False


class ImageSampler(callbacks.Callback):
    def __init__(
        self,
        num_samples: int = 3,
        nrow: int = 8,
        padding: int = 2,
        normalize: bool = True,
        value_range: Optional[tuple[int, int]] = None,
        scale_each: bool = False,
        pad_value: int = 0,
    ) -> None:
        if not _TORCHVISION_AVAILABLE:  # pragma: no cover
            raise ModuleNotFoundError("You want to use `torchvision` which is not installed yet.")

        super().__init__()
        self.num_samples = num_samples
        self.nrow = nrow
        self.padding = padding
        self.normalize = normalize
        self.value_range = value_range
        self.scale_each = scale_each
        self.pad_value = pad_value

    def _to_grid(self, images):
        return torchvision.utils.make_grid(
            tensor=images,
            nrow=self.nrow,
            padding=self.padding,
            normalize=self.normalize,
            value_range=self.value_range,
            scale_each=self.scale_each,
            pad_value=self.pad_value,
        )

    @rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not _TORCHVISION_AVAILABLE:
            return

        images, _ = next(iter(DataLoader(trainer.datamodule.mnist_val, batch_size=self.num_samples)))
        images_flattened = images.view(images.size(0), -1)

        # generate images
        with torch.no_grad():
            pl_module.eval()
            images_generated = pl_module(images_flattened.to(pl_module.device))
            pl_module.train()

        if trainer.current_epoch == 0:
            save_image(self._to_grid(images), f"grid_ori_{trainer.current_epoch}.png")
        save_image(self._to_grid(images_generated.reshape(images.shape)), f"grid_generated_{trainer.current_epoch}.png")


class LitAutoEncoder(LightningModule):
    def __init__(self, hidden_dim: int = 64, learning_rate=10e-3):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 28 * 28))

    def forward(self, x):
        z = self.encoder(x)
        return self.decoder(z)

    def training_step(self, batch, batch_idx):
        return self._common_step(batch, batch_idx, "train")

    def validation_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "test")

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        x = self._prepare_batch(batch)
        return self(x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    def _prepare_batch(self, batch):
        x, _ = batch
        return x.view(x.size(0), -1)

    def _common_step(self, batch, batch_idx, stage: str):
        x = self._prepare_batch(batch)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss


class MyDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 32):
        super().__init__()
        # was: MNIST(DATASETS_PATH, train=True, download=True, ...) split 55,000 / 5,000, and the MNIST test set
        dataset, self.mnist_test = load_mnist5k()
        self.mnist_train, self.mnist_val = Subset(dataset, range(3500)), Subset(dataset, range(3500, 4000))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)


def cli_main(devices=1, **trainer_flags):
    # was: LightningCLI(LitAutoEncoder, MyDataModule, seed_everything_default=1234, run=False,
    #                   trainer_defaults={"callbacks": ImageSampler(), "max_epochs": 10}, ...)
    seed_everything(1234)
    model, datamodule = LitAutoEncoder(), MyDataModule()
    callbacks_ = [ImageSampler()] if _TORCHVISION_AVAILABLE else []
    trainer = Trainer(callbacks=callbacks_, devices=devices, **{"max_epochs": 10, **trainer_flags})
    trainer.fit(model, datamodule=datamodule)
    trainer.test(ckpt_path="best", datamodule=datamodule)
    predictions = trainer.predict(ckpt_path="best", datamodule=datamodule)
    print(predictions[0])
    return trainer, predictions


if __name__ == "__main__":
    cli_main(devices=int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 1)
