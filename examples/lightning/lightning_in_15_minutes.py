"""Lightning's "Lightning in 15 minutes" guide (docs/source-pytorch/starter/introduction.rst, steps 2 to 5), ported
to trainscale (docs/lightning.md, "What to change"): its code blocks in order, with the imports changed
(``import lightning as L`` -> ``import trainscale as L``, whose module class is ``L.TrainingModule``) and MNIST from
torchvision replaced by the MNIST-5k images trainscale ships (``trainscale.data.load_mnist5k``, no download).

Step 5 loads the checkpoint by the path Lightning gives it, ``./lightning_logs/version_0/checkpoints/
epoch=0-step=100.ckpt``; trainscale writes the same name in its own run directory,
``./runs/version_0/checkpoints/epoch=0-step=100.ckpt``, so the port takes the path from
``trainer.checkpoint_callback.best_model_path``. Each change is marked ``# was:``.

    python examples/lightning/lightning_in_15_minutes.py
    python examples/lightning/lightning_in_15_minutes.py --devices 2     # trainscale: 2 processes (ddp)
"""

import sys

import torch

# ---- 2: Define a LightningModule ----
import os  # noqa: F401  (the guide's imports)
from torch import optim, nn, utils, Tensor  # noqa: F401

# was: from torchvision.datasets import MNIST; from torchvision.transforms import ToTensor
from trainscale.data import load_mnist5k
import trainscale as L  # was: import lightning as L

# define any number of nn.Modules (or use your current ones)
encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))


# define the LightningModule
class LitAutoEncoder(L.TrainingModule):  # was: L.LightningModule
    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def training_step(self, batch, batch_idx):
        # training_step defines the train loop.
        # it is independent of forward
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = nn.functional.mse_loss(x_hat, x)
        # Logging to TensorBoard (if installed) by default
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = optim.Adam(self.parameters(), lr=1e-3)
        return optimizer


def main(batch_size=1, **trainer_flags):  # trainscale: the guide's module-level steps 3 to 5, in a function
    # init the autoencoder
    autoencoder = LitAutoEncoder(encoder, decoder)

    # ---- 3: Define a dataset ----
    # setup data
    dataset, _ = load_mnist5k()  # was: MNIST(os.getcwd(), download=True, transform=ToTensor())
    train_loader = utils.data.DataLoader(dataset, batch_size=batch_size)  # trainscale: batch_size (default 1)

    # ---- 4: Train the model ----
    # train the model (hint: here are some helpful Trainer arguments for rapid idea iteration)
    trainer = L.Trainer(**{"limit_train_batches": 100, "max_epochs": 1, **trainer_flags})
    trainer.fit(model=autoencoder, train_dataloaders=train_loader)

    # ---- 5: Use the model ----
    # load checkpoint
    # was: checkpoint = "./lightning_logs/version_0/checkpoints/epoch=0-step=100.ckpt"
    checkpoint = trainer.checkpoint_callback.best_model_path
    autoencoder = LitAutoEncoder.load_from_checkpoint(checkpoint, encoder=encoder, decoder=decoder)

    # choose your trained nn.Module
    encoder_ = autoencoder.encoder  # was: encoder = autoencoder.encoder (inside a function: a new local name)
    encoder_.eval()

    # embed 4 fake images!
    fake_image_batch = torch.rand(4, 28 * 28, device=autoencoder.device)
    embeddings = encoder_(fake_image_batch)
    print("⚡" * 20, "\nPredictions (4 image embeddings):\n", embeddings, "\n", "⚡" * 20)
    return trainer, checkpoint, embeddings  # trainscale: for tests/test_lightning_examples.py


if __name__ == "__main__":
    main(devices=int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 1)
