"""``trainscale demo``: a real workload trained across processes with the Trainer.

``--workload convnet`` (default): the tutorial ConvNet on real MNIST digits. ``--workload lm``: the
reference GPT on byte-level Shakespeare, reporting validation loss, perplexity and tokens/s.
"""

from __future__ import annotations

import argparse
import math

# Per-workload defaults of the flags left unset on the command line.
DEFAULTS = {
    "convnet": {"batch_size": 64, "lr": 5e-3, "epochs": 5, "out": "runs/demo"},
    "lm": {"batch_size": 16, "lr": 3e-3, "epochs": 1, "out": "runs/demo-lm"},
}


def run_demo(args: argparse.Namespace) -> dict:
    """Train and print per-epoch metrics; return the run summary.

    With ``--devices N > 1`` this process is re-executed under torchrun by the Trainer.

    Raises:
        ValueError: an unknown ``--workload`` or a bad flag (from the Trainer).
    """
    workload = getattr(args, "workload", "convnet")
    if workload not in DEFAULTS:
        raise ValueError(f"unknown --workload {workload!r}; choose one of {', '.join(DEFAULTS)}")
    for key, value in DEFAULTS[workload].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return _run_lm(args) if workload == "lm" else _run_convnet(args)


def _trainer(args: argparse.Namespace, **extra):
    from trainscale.runtime.devices import cuda_device_count
    from trainscale.loop.trainer import Trainer

    devices = args.devices
    if devices is None:
        devices = cuda_device_count() if args.accelerator in ("auto", "cuda", "gpu") and cuda_device_count() else 2
    return Trainer(accelerator=args.accelerator, devices=devices, strategy=args.strategy,
                   precision=args.precision, max_epochs=args.epochs, seed=args.seed, default_root_dir=args.out,
                   enable_progress_bar=not args.no_progress_bar, log_every_n_steps=10, **extra)


def _one_cycle(lr: float, total_steps: int):
    """An AdamW factory with a one-cycle schedule (Smith & Topping 2019, "Super-Convergence"),
    stepped per optimizer step."""
    import torch

    def optimizer(params):
        opt = torch.optim.AdamW(params, lr=lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return optimizer


def _run_convnet(args: argparse.Namespace) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from trainscale.data import load_mnist5k
    from trainscale.models import ConvNet

    trainer = _trainer(args)
    torch.manual_seed(args.seed)
    train_set, val_set = load_mnist5k()
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=256)
    steps_per_epoch = math.ceil(math.ceil(len(train_set) / trainer.runtime.data_parallel_size) / args.batch_size)
    summary = trainer.fit(ConvNet(), train_loader, val_loader,
                          optimizer=_one_cycle(args.lr, args.epochs * steps_per_epoch))
    trainer.runtime.print(f"run directory: {summary['run_dir']}")
    trainer.runtime.print(f"final validation accuracy: {summary['val_accuracy']:.4f} "
                          f"(world size {summary['world_size']}, {summary['strategy']})")
    return summary


def _run_lm(args: argparse.Namespace) -> dict:
    """The reference GPT (``--model`` preset) on byte-level Shakespeare for ``--steps`` optimizer steps."""
    import dataclasses

    import torch
    from torch.utils.data import DataLoader

    from trainscale.data import load_text, unigram_entropy
    from trainscale.models import GPT, PRESETS, lm_loss

    if args.model not in PRESETS:
        raise ValueError(f"unknown --model {args.model!r}; choose one of {', '.join(PRESETS)}")
    config = dataclasses.replace(PRESETS[args.model], vocab_size=256)
    context = args.context_length or config.context_length
    config = dataclasses.replace(config, context_length=context)
    trainer = _trainer(args, max_steps=args.steps)
    torch.manual_seed(args.seed)
    train_set, val_set = load_text(context_length=context)
    model = GPT(config)
    parameters = model.num_parameters()  # before fit: under pp the model is cut to this rank's stage
    summary = trainer.fit(model, DataLoader(train_set, batch_size=args.batch_size, shuffle=True),
                          DataLoader(val_set, batch_size=64), loss_fn=lm_loss,
                          optimizer=_one_cycle(args.lr, args.steps))
    # samples_per_s counts each sample once (over the data-parallel ranks); each holds `context` tokens
    summary["tokens_per_s"] = summary["samples_per_s"] * context
    summary["val_perplexity"] = math.exp(summary["val_loss"])
    summary["unigram_entropy"] = unigram_entropy(train_set.tokens)
    rt = trainer.runtime
    rt.print(f"run directory: {summary['run_dir']}")
    rt.print(f"GPT {args.model} ({parameters:,} parameters), {summary['steps']} steps, "
             f"world size {summary['world_size']}, {summary['strategy']}")
    rt.print(f"final validation loss: {summary['val_loss']:.4f} nats/byte, perplexity {summary['val_perplexity']:.2f} "
             f"(unigram entropy of the training text: {summary['unigram_entropy']:.4f}); "
             f"{summary['tokens_per_s']:,.0f} tokens/s in training")
    return summary
