"""The built-in workload of ``trainscale check``: the demo's ConvNet on MNIST-5k, without BatchNorm.

Without BatchNorm because per-rank batch statistics are exactly what the check flags (the 2-process run
normalises over each rank's half of the batch, the 1-device run over all of it), and torch's
``SyncBatchNorm`` needs CUDA. ``trainscale check --entry trainscale.jobs.workload:mnist_convnet`` checks the demo's own model,
BatchNorm included: it fails, naming that cause (docs/check.md).

AdamW at lr 2e-3 tuned at batch 32, scaled by the square-root rule (Malladi et al. 2022) when the global
batch differs: ``trainscale check --lr-scaling sqrt`` passes on it, ``--lr-scaling linear`` does not.
"""

from __future__ import annotations

BASE_BATCH_SIZE = 32


def convnet() -> dict:
    """The workload dict (bench's contract, :mod:`trainscale.jobs.workload`)."""
    import torch

    from trainscale.data import load_mnist5k
    from trainscale.models import ConvNet

    train, val = load_mnist5k()
    return {"model": ConvNet(batchnorm=False), "train": train, "val": val,
            "optimizer": lambda params: torch.optim.AdamW(params, lr=2e-3),
            "trainer": {"lr_scaling": "sqrt", "base_batch_size": BASE_BATCH_SIZE}}
