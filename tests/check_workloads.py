"""Workloads for tests/test_check.py, as ``trainscale check --entry tests.check_workloads:<name>`` imports
them: small models on synthetic data (fast), three with a planted scaling bug and two without."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset


def _classes(n: int = 256, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long())


def _mlp(norm: bool = False) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16) if norm else nn.Identity(), nn.ReLU(), nn.Linear(16, 3))


def batchnorm() -> dict:
    """Planted bug (a): BatchNorm without SyncBatchNorm: per-rank batch statistics in training, per-rank
    running statistics in evaluation."""
    return {"model": _mlp(norm=True), "train": _classes(), "val": _classes(64, seed=1),
            "optimizer": lambda p: torch.optim.AdamW(p, lr=1e-2)}


class TokenModel(nn.Module):
    """Token ids (B, T) → logits (B, T, 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def _padded_tokens(n: int = 128, t: int = 8) -> TensorDataset:
    """Sequences whose last positions are padding (target -100), 0 to 6 of them, so ranks get uneven counts."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (n, t), generator=g)
    targets = (ids * 3 + 1) % 16
    for i in range(n):
        pad = int(torch.randint(0, 7, (), generator=g))
        if pad:
            targets[i, t - pad:] = -100
    return TensorDataset(ids, targets)


def per_rank_token_mean(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)  # mean over this rank's tokens


def uneven_tokens() -> dict:
    """Planted bug (b): a token loss averaged per rank over uneven counts of non-padding targets."""
    return {"model": TokenModel(), "train": _padded_tokens(), "loss_fn": per_rank_token_mean,
            "optimizer": lambda p: torch.optim.SGD(p, lr=0.5)}


def unscaled_lr() -> dict:
    """Planted bug (c): SGD's lr, tuned at batch 8 on one device, kept as it is for any global batch."""
    return {"model": _mlp(), "train": _classes(), "val": _classes(64, seed=1),
            "optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}


def scaled_lr() -> dict:
    """(c) fixed: the same, with the Trainer's linear LR scaling from the batch it was tuned at."""
    return {**unscaled_lr(), "trainer": {"lr_scaling": "linear", "base_batch_size": 8}}
