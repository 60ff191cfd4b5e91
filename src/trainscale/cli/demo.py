"""``trainscale demo``: the tutorial ConvNet on real MNIST digits, DDP across processes."""

from __future__ import annotations

import argparse
import math


def run_demo(args: argparse.Namespace) -> dict:
    """Train and print per-epoch metrics; return the run summary.

    With ``--devices N > 1`` this process is re-executed under torchrun by the Trainer.
    """
    import torch
    from torch.utils.data import DataLoader

    from trainscale.data import load_mnist5k
    from trainscale.models import ConvNet
    from trainscale.runtime.devices import cuda_device_count
    from trainscale.train.trainer import Trainer

    devices = args.devices
    if devices is None:
        devices = cuda_device_count() if args.accelerator in ("auto", "cuda", "gpu") and cuda_device_count() else 2
    trainer = Trainer(accelerator=args.accelerator, devices=devices, strategy=args.strategy,
                      precision=args.precision, max_epochs=args.epochs, seed=args.seed, default_root_dir=args.out,
                      enable_progress_bar=not args.no_progress_bar, log_every_n_steps=10)
    torch.manual_seed(args.seed)
    train_set, val_set = load_mnist5k()
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=256)
    # One-cycle schedule (Smith & Topping 2019, "Super-Convergence"), stepped per optimizer step.
    steps_per_epoch = math.ceil(math.ceil(len(train_set) / trainer.runtime.world_size) / args.batch_size)

    def optimizer(params):
        opt = torch.optim.AdamW(params, lr=args.lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    summary = trainer.fit(ConvNet(), train_loader, val_loader, optimizer=optimizer)
    trainer.runtime.print(f"run directory: {summary['run_dir']}")
    trainer.runtime.print(f"final validation accuracy: {summary['val_accuracy']:.4f} "
                          f"(world size {summary['world_size']}, {summary['strategy']})")
    return summary
