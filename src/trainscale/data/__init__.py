"""Embedded real data sets. They know nothing of distribution."""

from trainscale.data.mnist import load_mnist5k

__all__ = ["load_mnist5k"]
