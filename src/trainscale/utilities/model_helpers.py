"""Lightning's ``lightning.pytorch.utilities.model_helpers`` name that its example scripts import."""

from __future__ import annotations

from typing import Any


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
