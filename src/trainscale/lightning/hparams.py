"""Lightning's ``save_hyperparameters``/``hparams``, for :class:`~trainscale.lightning.module.TrainingModule` and
:class:`~trainscale.lightning.data_sources.DataModule`: the arguments of ``__init__``, kept for the loggers."""

from __future__ import annotations

import copy
import inspect
import pickle
import warnings
from argparse import Namespace
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn


class AttributeDict(dict):
    """A dict whose keys read and write as attributes too (``hparams.lr``), as Lightning's ``AttributeDict``.

    Raises:
        AttributeError: reading a key it does not hold.
    """

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as err:
            raise AttributeError(f"no hyperparameter {key!r}; saved: {', '.join(self) or 'none'}") from err

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


class HyperparametersMixin:
    """``self.save_hyperparameters()`` in ``__init__`` keeps its arguments in ``self.hparams``; the Trainer
    passes them to every logger's ``log_hyperparams`` with its own flags (the module's names win)."""

    CHECKPOINT_HYPER_PARAMS_KEY = "hyper_parameters"  # Lightning's: the checkpoint key that holds them

    @property
    def hparams_initial(self) -> AttributeDict:
        """A copy of the hyperparameters as :meth:`save_hyperparameters` saved them (Lightning's read-only
        ``hparams_initial``: later changes to :attr:`hparams` do not show here; empty before a save)."""
        return AttributeDict(copy.deepcopy(self.__dict__.get("_hparams_initial", {})))

    @property
    def hparams(self) -> AttributeDict:
        """The saved hyperparameters (empty before :meth:`save_hyperparameters`)."""
        if "_hparams" not in self.__dict__:
            self.__dict__["_hparams"] = AttributeDict()
        return self.__dict__["_hparams"]

    def save_hyperparameters(self, *names: Any, ignore: str | Iterable[str] | None = None) -> None:
        """Keep the arguments of the calling ``__init__`` in :attr:`hparams`: all of them (``**kwargs`` spread),
        only ``names``, or all but ``ignore``; their values as they are at the call. Method: the caller's frame
        (``inspect.getargvalues``), as Lightning's ``save_hyperparameters``; ``self`` is never kept. One dict or
        ``argparse.Namespace`` instead of names (``self.save_hyperparameters(config)``) becomes :attr:`hparams`
        itself, its keys the hyperparameters, as in Lightning.

        As Lightning, a ``UserWarning`` names each hyperparameter that is an ``nn.Module`` (its weights are in the
        checkpoint already, as the module's; leave it out with ``ignore=[...]``).

        Raises:
            ValueError: a name in ``names`` that is not an argument of the caller; a single argument that is
                neither a name, a dict nor a ``Namespace``.
        """
        if len(names) == 1 and not isinstance(names[0], str):
            config = vars(names[0]) if isinstance(names[0], Namespace) else names[0]
            if not isinstance(config, dict):
                raise ValueError(f"save_hyperparameters({type(config).__name__}): pass argument names, one dict or "
                                 "one argparse.Namespace")
            self.__dict__["_hparams"] = AttributeDict(config)
            self.__dict__["_hparams_initial"] = copy.deepcopy(dict(config))
            _warn_modules(self.hparams)
            return
        found = _caller_arguments(inspect.currentframe().f_back)
        missing = [name for name in names if name not in found]
        if missing:
            raise ValueError(f"save_hyperparameters({', '.join(map(repr, names))}): {', '.join(missing)} not among "
                             f"the arguments of the caller ({', '.join(found) or 'none'})")
        ignored = {ignore} if isinstance(ignore, str) else set(ignore or ())
        self.hparams.update({k: v for k, v in found.items() if (not names or k in names) and k not in ignored})
        self.__dict__["_hparams_initial"] = copy.deepcopy(dict(self.hparams))
        _warn_modules(self.hparams)


def _warn_modules(hparams: Mapping) -> None:
    for name, value in hparams.items():
        if isinstance(value, nn.Module):  # Lightning's words (utilities/parsing.py, save_hyperparameters)
            warnings.warn(f"Attribute {name!r} is an instance of `nn.Module` and is already saved during "
                          f"checkpointing. It is recommended to ignore them using "
                          f"`self.save_hyperparameters(ignore=[{name!r}])`.", UserWarning, stacklevel=4)


def drop_unpicklable(hparams: Any, warn: bool = True) -> None:
    """Remove from ``hparams`` (in place) the values ``pickle`` cannot write (a lambda, an open file), with a
    ``UserWarning`` naming each when ``warn``, as Lightning does when ``fit`` starts (``clean_namespace``): its
    checkpoints and loggers could not keep them."""
    if not isinstance(hparams, dict):
        return
    for name in [k for k, v in hparams.items() if not _picklable(v)]:
        if warn:
            warnings.warn(f"Attribute '{name}' removed from hparams because it cannot be pickled. You can suppress "
                          f"this warning by setting `self.save_hyperparameters(ignore=['{name}'])`.", UserWarning,
                          stacklevel=4)
        del hparams[name]


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except (pickle.PickleError, AttributeError, RuntimeError, TypeError):  # Lightning's is_picklable
        return False
    return True


def merged_hparams(model: Any, datamodule: Any) -> dict[str, Any]:
    """The hyperparameters of ``model`` and of ``datamodule`` (``save_hyperparameters()`` on each; either may have
    none, or be None) in one dict, as Lightning logs them (``loggers/utilities.py``, ``_log_hyperparams``).

    Raises:
        RuntimeError: a name that both hold with different values (a different type, another tensor object, or
            unequal), naming them.
    """
    mine, theirs = (dict(saved) if isinstance(saved := getattr(obj, "hparams", None), Mapping) else {}
                    for obj in (model, datamodule))  # a plain nn.Module has none
    clashing = sorted(k for k in mine.keys() & theirs.keys() if _differ(mine[k], theirs[k]))
    if clashing:
        raise RuntimeError(f"Error while merging hparams: the keys {clashing} are present in both the "
                           f"{type(model).__name__}'s and the {type(datamodule).__name__}'s hparams but have different "
                           "values; give them one value, or another name in one of the two")
    return {**mine, **theirs}


def _differ(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return True
    if isinstance(a, torch.Tensor):
        return a is not b
    try:
        return bool(a != b)
    except (TypeError, ValueError, RuntimeError):  # no plain truth value (an array's comparison): the same object?
        return a is not b


def _caller_arguments(frame: Any) -> dict[str, Any]:
    """The named arguments of the function running in ``frame`` (``**kwargs`` spread), ``self`` left out."""
    try:
        args, _, varkw, values = inspect.getargvalues(frame)
    finally:
        del frame  # a frame kept in a local would keep the caller's locals alive
    found = {name: values[name] for name in args if name != "self"}
    found.update(values[varkw] if varkw else {})
    return found
