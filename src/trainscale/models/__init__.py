"""Reference models. They know nothing of distribution."""

from trainscale.models.convnet import ConvNet
from trainscale.models.gpt import GPT, PRESETS, GPTConfig, lm_loss
from trainscale.models.mlp import MLP

__all__ = ["ConvNet", "GPT", "GPTConfig", "MLP", "PRESETS", "lm_loss"]
