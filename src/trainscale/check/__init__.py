"""parity: `trainscale check`, is my N-device run learning the same thing as my 1-device run?

    from trainscale.check import check
    result = check(devices=2, strategy="ddp", steps=5)
    print(result.text)

K steps on 1 device and on N processes, compared step by step (loss, gradient norm, learning rate, samples)
and at the end (weights, validation metrics, buffers and eval outputs per rank); a difference beyond the
tolerance is explained by the usual causes (:mod:`~trainscale.check.causes`). Guide: docs/check.md.
Importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names of __all__, for type checkers and the API reference (docs/api.md)
    from trainscale.check.runner import CheckResult, CheckRunError, check

__all__ = ["check", "CheckResult", "CheckRunError"]


def __getattr__(name: str):
    if name in __all__:
        from trainscale.check import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'trainscale.check' has no attribute {name!r}")
