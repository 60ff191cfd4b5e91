"""Reference models. They know nothing of distribution."""

from trainscale.models.convnet import ConvNet
from trainscale.models.mlp import MLP

__all__ = ["ConvNet", "MLP"]
