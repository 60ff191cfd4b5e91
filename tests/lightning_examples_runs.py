"""Run Lightning's examples ported to trainscale (examples/lightning/) in turn, on a few batches, and save their
final numbers: ``python tests/lightning_examples_runs.py OUT_DIR DEVICES NAME...`` (NAME: see ``RUNS``).

With DEVICES=2 the first Trainer relaunches this script under torchrun (2 ddp processes) and every example runs on
both; each is given half the one-process per-device batch size where the example takes one, so that the global
batch is the same as with DEVICES=1. Rank zero writes ``OUT_DIR/<name>.pt``: a dict of floats and tensors.
tests/test_lightning_examples.py compares a one-process run (in its own process) with a two-process one, whose
ranks tests/helpers.py ``run_distributed`` forks with torchrun's variables (:func:`on_each_rank`).
"""

from __future__ import annotations

import importlib
import sys
from argparse import Namespace
from pathlib import Path

import torch

from trainscale import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: examples.lightning


class PredictionsKept(Trainer):
    """The Trainer, keeping what ``predict`` returned: Lightning's examples print its first batch and return nothing."""

    predictions: list | None = None

    def predict(self, *args, **kwargs):
        self.predictions = super().predict(*args, **kwargs)
        return self.predictions


def cli_main(example, args: list[str]):
    """Run ``example.cli_main()`` (Lightning's, which builds a ``LightningCLI`` and returns nothing) as
    ``python example.py ARGS`` would: returns the ``LightningCLI`` it built, its Trainer a :class:`PredictionsKept`.

    The arguments go to the CLI's ``args``, not to ``sys.argv``: a Trainer on several devices started without a
    launcher runs ``sys.argv`` again under torchrun, which must stay this script's command line. The example's
    ``LightningCLI`` is replaced by a subclass for the call and restored after."""
    built, lightning_cli = [], example.LightningCLI

    class Recorded(lightning_cli):
        def __init__(self, *cli_args, **kwargs):
            built.append(self)
            super().__init__(*cli_args, trainer_class=PredictionsKept, args=args, **kwargs)

    example.LightningCLI = Recorded
    try:
        example.cli_main()
    finally:
        example.LightningCLI = lightning_cli
    return built[0]


def trainer_flags(root: Path, **flags) -> list[str]:
    """``--trainer.NAME=VALUE`` arguments: ``flags``, in ``root``, without progress bar or logger."""
    flags = {"default_root_dir": root, "enable_progress_bar": "false", "logger": "false", **flags}
    return [f"--trainer.{name}={value}" for name, value in flags.items()]


def backbone(root: Path, devices: int) -> dict:
    from examples.lightning import backbone_image_classifier as ex

    cli = cli_main(ex, [f"--data.batch_size={32 // devices}", *trainer_flags(
        root, devices=devices, max_epochs=2, limit_train_batches=8, limit_val_batches=2, limit_test_batches=4,
        limit_predict_batches=4)])
    trainer = cli.trainer
    return {"train_loss": trainer.history[-1]["train_loss"], "valid_loss": trainer.history[-1]["valid_loss_epoch"],
            "test_loss": trainer.callback_metrics["test_loss"], "predictions": torch.cat(trainer.predictions)}


def intro(root: Path, devices: int) -> dict:
    torch.manual_seed(0)  # the guide builds its encoder and decoder when the module is imported
    ex = importlib.reload(importlib.import_module("examples.lightning.lightning_in_15_minutes"))
    trainer, checkpoint, embeddings = ex.main(batch_size=4 // devices, devices=devices, default_root_dir=root,
                                              limit_train_batches=20, enable_progress_bar=False, logger=False)
    return {"train_loss": trainer.history[-1]["train_loss"], "checkpoint": Path(checkpoint).name,
            "encoder": torch.cat([p.detach().flatten() for p in ex.encoder.parameters()])}


def gan(root: Path, devices: int) -> dict:
    from examples.lightning import generative_adversarial_net as ex

    trainer = ex.main(Namespace(lr=0.0002, b1=0.5, b2=0.999, latent_dim=100), devices=devices, default_root_dir=root,
                      max_epochs=1, limit_train_batches=2, enable_progress_bar=False, log_every_n_steps=2)
    return {"step": trainer.global_step, "d_loss": trainer.callback_metrics["d_loss"],
            "g_loss": trainer.callback_metrics["g_loss"]}


def qnet(root: Path, devices: int) -> dict:
    from examples.lightning import reinforce_learn_Qnet as ex

    args = Namespace(env="CartPole-v1", replay_size=1000, warm_start_steps=1000, gamma=0.99, eps_start=1.0,
                     eps_end=0.01, eps_last_frame=1000, sync_rate=10, lr=1e-2, episode_length=200,
                     batch_size=16 // devices)
    # target_net gets no gradient: under ddp as under Lightning's (its strategy="ddp_find_unused_parameters_true")
    unused = {"strategy_options": {"find_unused_parameters": True}} if devices > 1 else {}
    trainer = ex.main(args, devices=devices, default_root_dir=root, max_epochs=1, enable_progress_bar=False,
                      logger=False, **unused)
    return {"step": trainer.global_step, "train_loss": trainer.history[-1]["train_loss"]}


def ppo(root: Path, devices: int) -> dict:
    from examples.lightning import reinforce_learn_ppo as ex

    args = Namespace(env="CartPole-v0", gamma=0.99, lam=0.95, lr_actor=3e-4, lr_critic=1e-3, max_episode_len=1000,
                     batch_size=64 // devices, steps_per_epoch=128 // devices, nb_optim_iters=4, clip_ratio=0.2)
    trainer = ex.main(args, devices=devices, default_root_dir=root, max_epochs=1, enable_progress_bar=False,
                      logger=False)
    return {"step": trainer.global_step, **{k: trainer.history[-1][k] for k in
                                             ("loss_actor", "loss_critic", "avg_ep_reward")}}


def transformer(root: Path, devices: int) -> dict:
    from examples.lightning import transformer as ex

    generator = torch.Generator().manual_seed(0)  # 4,100 blocks of 35 words: over the example's 4,000 held out
    words = [f"w{i}" for i in torch.randint(0, 50, (4100 * 35,), generator=generator).tolist()]
    (root / "text").mkdir(parents=True, exist_ok=True)
    (root / "text" / "wikitext-2.txt").write_text("\n".join(" ".join(words[i:i + 10]) for i in range(0, len(words), 10)))
    trainer = ex.main(root / "text", devices=devices, default_root_dir=root, max_epochs=1, limit_train_batches=2,
                      limit_val_batches=1, limit_test_batches=1, enable_progress_bar=False, logger=False)
    return {"train_loss": trainer.history[-1]["train_loss"], "val_loss": trainer.history[-1]["val_loss"],
            "test_loss": trainer.callback_metrics["test_loss"]}


RUNS = {"backbone": backbone, "intro": intro, "gan": gan, "qnet": qnet, "ppo": ppo, "transformer": transformer}


def main(out_dir: Path, devices: int, names: list[str]) -> None:
    for name in names:
        result = RUNS[name](out_dir / name, devices)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            torch.save(result, out_dir / f"{name}.pt")


def on_each_rank(rank: int, out_dir: str, names: list[str]) -> dict:
    """One of 2 ranks (``run_distributed(on_each_rank, out_dir, names)``): ``{name: numbers}`` of each example."""
    return {name: RUNS[name](Path(out_dir) / name, 2) for name in names}


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
