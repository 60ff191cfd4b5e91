"""Lightning's ``save_hyperparameters``/``hparams``, for :class:`~trainscale.lightning.module.TrainingModule` and
:class:`~trainscale.lightning.data_sources.DataModule`: the arguments of ``__init__``, kept for the loggers."""

from __future__ import annotations

import copy
import inspect
from argparse import Namespace
from collections.abc import Iterable
from typing import Any


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
            return
        found = _caller_arguments(inspect.currentframe().f_back)
        missing = [name for name in names if name not in found]
        if missing:
            raise ValueError(f"save_hyperparameters({', '.join(map(repr, names))}): {', '.join(missing)} not among "
                             f"the arguments of the caller ({', '.join(found) or 'none'})")
        ignored = {ignore} if isinstance(ignore, str) else set(ignore or ())
        self.hparams.update({k: v for k, v in found.items() if (not names or k in names) and k not in ignored})
        self.__dict__["_hparams_initial"] = copy.deepcopy(dict(self.hparams))


def _caller_arguments(frame: Any) -> dict[str, Any]:
    """The named arguments of the function running in ``frame`` (``**kwargs`` spread), ``self`` left out."""
    try:
        args, _, varkw, values = inspect.getargvalues(frame)
    finally:
        del frame  # a frame kept in a local would keep the caller's locals alive
    found = {name: values[name] for name in args if name != "self"}
    found.update(values[varkw] if varkw else {})
    return found
