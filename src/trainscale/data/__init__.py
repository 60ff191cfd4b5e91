"""Embedded real data sets. They know nothing of distribution."""

from trainscale.data.mnist import load_mnist5k
from trainscale.data.text import load_text, unigram_entropy

__all__ = ["load_mnist5k", "load_text", "unigram_entropy"]
