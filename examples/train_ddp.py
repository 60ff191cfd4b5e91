"""Train the ConvNet on MNIST-5k with the Trainer.

    python examples/train_ddp.py --devices 2          # relaunches itself under torchrun
    trainscale run -n 2 examples/train_ddp.py         # the same, started by torchrun directly
"""

import argparse

import torch
from torch.utils.data import DataLoader

from trainscale import Trainer
from trainscale.data import load_mnist5k
from trainscale.models import ConvNet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", default="auto", type=lambda v: v if v == "auto" else int(v))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", default="runs/example")
    args = parser.parse_args()

    trainer = Trainer(devices=args.devices, max_epochs=args.epochs, default_root_dir=args.out)
    train_set, val_set = load_mnist5k()
    summary = trainer.fit(ConvNet(), DataLoader(train_set, batch_size=args.batch_size, shuffle=True),
                          DataLoader(val_set, batch_size=256),
                          optimizer=lambda params: torch.optim.AdamW(params, lr=2e-3))
    trainer.runtime.print(f"world_size={summary['world_size']} val_accuracy={summary['val_accuracy']:.4f}")


if __name__ == "__main__":
    main()
