"""Lightning's ``lightning.pytorch.utilities.parsing`` names: whether a value can be pickled."""

from __future__ import annotations

import pickle
from typing import Any


def pickled(value: Any) -> bytes | None:
    """``pickle.dumps(value)``, or None when ``pickle`` cannot write it (a lambda, an open file; the errors
    Lightning's ``is_picklable`` catches)."""
    try:
        return pickle.dumps(value)
    except (pickle.PickleError, AttributeError, RuntimeError, TypeError):
        return None


def is_picklable(obj: object) -> bool:
    """Whether ``pickle.dumps(obj)`` succeeds, as Lightning's ``is_picklable`` (hyperparameters that are not are
    left out of checkpoints' ``hyper_parameters``)."""
    return pickled(obj) is not None
