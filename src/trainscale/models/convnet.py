"""The ConvNet of the classic multi-GPU tutorial (two 5×5 conv blocks and a linear head)."""

from __future__ import annotations

import torch
from torch import nn


class ConvNet(nn.Module):
    """Conv2d(1,16,5,p=2)–BatchNorm–ReLU–MaxPool(2), Conv2d(16,32,5,p=2)–BatchNorm–ReLU–MaxPool(2),
    Linear(7·7·32, num_classes).

    Input ``(B, 1, 28, 28)`` float; output logits ``(B, num_classes)``. About 29k parameters.

    Args:
        num_classes: output classes.
        batchnorm: False replaces BatchNorm with identity (per-rank batch statistics make DDP and
            a single process differ, so exact parity tests use ``batchnorm=False``).
    """

    def __init__(self, num_classes: int = 10, batchnorm: bool = True) -> None:
        super().__init__()
        norm = nn.BatchNorm2d if batchnorm else (lambda c: nn.Identity())
        self.layer1 = nn.Sequential(nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2), norm(16), nn.ReLU(),
                                    nn.MaxPool2d(kernel_size=2, stride=2))
        self.layer2 = nn.Sequential(nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2), norm(32), nn.ReLU(),
                                    nn.MaxPool2d(kernel_size=2, stride=2))
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(x))  # (B, 32, 7, 7)
        return self.fc(x.flatten(1))  # (B, num_classes)
