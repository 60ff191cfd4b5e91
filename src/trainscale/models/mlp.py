"""A small multilayer perceptron (784-128-10 by default) for overhead measurements and tests."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Flatten → Linear(in, hidden) → ReLU → Linear(hidden, out).

    Input ``(B, ...)`` with ``prod(...) == in_features``; output logits ``(B, out_features)``.
    """

    def __init__(self, in_features: int = 784, hidden: int = 128, out_features: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
