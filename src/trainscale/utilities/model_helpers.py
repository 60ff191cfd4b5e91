"""Lightning's ``lightning.pytorch.utilities.model_helpers`` names: ``is_overridden`` and ``get_torchvision_model``."""

from __future__ import annotations

import functools
from typing import Any
from unittest import mock

# The classes ``is_overridden`` compares with when no ``parent`` is given (Lightning's LightningModule,
# LightningDataModule and Callback), found by name in the instance's classes: this lowest layer imports none of them.
_PARENTS = (("trainscale.lightning.module", "TrainingModule"), ("trainscale.lightning.data_sources", "DataModule"),
            ("trainscale.callbacks.base", "Callback"))


def is_overridden(method_name: str, instance: object | None = None, parent: type | None = None) -> bool:
    """Whether ``instance`` has its own ``method_name``, not ``parent``'s, as Lightning's ``is_overridden``
    (``lightning_utilities.core.overrides``): the code of the two functions is compared, after unwrapping
    ``functools.wraps`` (``__wrapped__``), ``functools.partial`` and ``unittest.mock.Mock(wraps=...)``. A method set
    to None on the instance or its class (``model.on_validation_epoch_end = None``) is not overridden.

    Args:
        method_name: the method's name (``"training_step"``, ``"on_train_epoch_end"``, ...).
        instance: the object; None gives False.
        parent: the class that defines the default; None: the ``TrainingModule``, ``DataModule`` or ``Callback``
            that ``instance`` derives from.

    Raises:
        ValueError: no ``parent`` and ``instance`` is none of those three; ``parent`` has no ``method_name`` (a hook
            trainscale's base class does not define).
    """
    if instance is None:
        return False
    parent = parent or _default_parent(instance)
    own = getattr(instance, method_name, None)
    own = getattr(own, "__wrapped__", own)
    own = own._mock_wraps if isinstance(own, mock.Mock) else own.func if isinstance(own, functools.partial) else own
    if own is None:
        return False
    default = getattr(parent, method_name, None)
    if default is None:
        raise ValueError(f"is_overridden({method_name!r}): {parent.__name__} defines no {method_name}, so there is "
                         "nothing to override; pass parent=, the class whose method is compared")
    default = getattr(default, "__wrapped__", default)
    return own.__code__ != default.__code__


def _default_parent(instance: object) -> type:
    for module, name in _PARENTS:
        for cls in type(instance).__mro__:
            if cls.__module__ == module and cls.__qualname__ == name:
                return cls
    raise ValueError(f"is_overridden(..., {type(instance).__name__} instance) needs parent=, the class whose method "
                     "is compared (without it the instance must be a TrainingModule, DataModule or Callback)")


def get_torchvision_model(model_name: str, **kwargs: Any) -> Any:
    """The torchvision model ``model_name`` (``"resnet18"``, ...) built with ``kwargs`` (``weights=...``,
    ``num_classes=...``), through ``torchvision.models.get_model`` (torchvision 0.14+), as Lightning's
    ``get_torchvision_model``.

    Raises:
        ModuleNotFoundError: torchvision is not installed (``pip install torchvision``, the build that matches your
            torch).
        ValueError: torchvision knows no model of that name (torchvision's message).
    """
    try:
        from torchvision import models
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(f"get_torchvision_model({model_name!r}) needs torchvision: pip install torchvision "
                                  "(the build that matches your torch)") from err
    return models.get_model(model_name, **kwargs)
