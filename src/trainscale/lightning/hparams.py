"""Lightning's ``save_hyperparameters``/``hparams``, for :class:`~trainscale.lightning.module.TrainingModule` and
:class:`~trainscale.lightning.data_sources.DataModule`: the arguments of ``__init__``, kept for the loggers."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import warnings
from argparse import Namespace
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from trainscale.utilities.parsing import is_picklable


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


# Lightning's (core/mixins/hparams_mixin.py): a single value given to save_hyperparameters must be a container
_PRIMITIVE_TYPES = (bool, int, float, str)


class HyperparametersMixin:
    """``self.save_hyperparameters()`` in ``__init__`` keeps its arguments in ``self.hparams``; the Trainer
    passes those of the module and of its data module to every logger's ``log_hyperparams`` when ``fit`` starts,
    and saves them in every checkpoint."""

    CHECKPOINT_HYPER_PARAMS_KEY = "hyper_parameters"  # Lightning's: the checkpoint key that holds them
    CHECKPOINT_HYPER_PARAMS_NAME = "hparams_name"  # Lightning's: the __init__ argument one container came in

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

    def save_hyperparameters(self, *args: Any, ignore: str | Iterable[str] | None = None, frame: Any = None,
                             logger: bool = True) -> None:
        """Keep the arguments of ``__init__`` in :attr:`hparams`, as Lightning's ``save_hyperparameters``
        (``utilities/parsing.py``): all of them (``**kwargs`` spread; ``self`` and ``*args`` never), only those
        named in ``args``, or all but ``ignore``, their values as they are at the call. The arguments are those
        of every ``__init__`` of this object on the call stack, outermost last (a subclass's ``__init__`` that
        calls ``super().__init__(...)`` adds its own, and its values win), read from the frames
        (``inspect.getargvalues``); the walk stops at the first frame that is not such an ``__init__``. A
        ``@dataclass`` module keeps its fields that ``__init__`` takes instead. One dict or
        ``argparse.Namespace`` instead of names (``self.save_hyperparameters(config)``) adds its keys, and its
        argument's name is kept for ``load_from_checkpoint`` (``Model(config=...)``); an empty one saves
        nothing. ``ignore`` also removes names an earlier call (a base class's) saved. ``frame``: the frame to
        read instead of the caller's; ``logger=False`` keeps these hyperparameters from the loggers.

        As Lightning, a ``UserWarning`` names each hyperparameter that is an ``nn.Module`` (its weights are in the
        checkpoint already, as the module's; leave it out with ``ignore=[...]``).

        Raises:
            ValueError: a name in ``args`` that is not an argument of ``__init__``; a single value that is a
                bool, int, float or str (Lightning's "Primitives ... are not allowed.") or of another type that
                is not a mapping or a ``Namespace``.
        """
        if len(args) == 1 and not isinstance(args[0], str) and not args[0]:
            return  # an empty container: nothing to keep (Lightning's)
        if frame is None:
            frame = inspect.currentframe().f_back
        try:
            found = _init_arguments(self, frame)
        finally:
            del frame  # a frame kept in a local would keep the caller's locals alive
        ignored = [ignore] if isinstance(ignore, str) else [name for name in ignore or () if isinstance(name, str)]
        saved, self.__dict__["_hparams_name"] = _chosen(args, {k: v for k, v in found.items() if k not in ignored})
        self.hparams.update(saved)
        for name in ignored:  # a subclass's ignore= drops what its base class saved (Lightning's)
            self.hparams.pop(name, None)
        self.__dict__["_log_hyperparams"] = logger
        self.__dict__["_hparams_initial"] = copy.deepcopy(dict(self.hparams))
        _warn_modules(self.hparams)


def _chosen(args: tuple, found: dict[str, Any]) -> tuple[Mapping, str | None]:
    """What ``save_hyperparameters(*args)`` keeps of the ``__init__`` arguments ``found``, and the name Lightning
    records for it (``_hparams_name``): all of them ("kwargs", None when there are none), the keys of the one
    container among ``args`` (the name of the argument it came in, None when it is none of them), or those
    named ("kwargs").

    Raises:
        ValueError: a name that is not among ``found``; a single value that is no container (:func:`_as_mapping`).
    """
    containers = [arg for arg in args if not isinstance(arg, str)]
    if not args:
        return found, "kwargs" if found else None
    if len(containers) == 1:
        return _as_mapping(containers[0]), next((k for k, v in found.items() if _same(v, containers[0])), None)
    missing = [name for name in args if isinstance(name, str) and name not in found]
    if missing:
        raise ValueError(f"save_hyperparameters({', '.join(map(repr, args))}): {', '.join(missing)} not among the "
                         f"arguments of the caller ({', '.join(found) or 'none'})")
    return {k: found[k] for k in args if isinstance(k, str)}, "kwargs"


def _as_mapping(config: Any) -> Mapping:
    """The hyperparameters in one container given to ``save_hyperparameters`` (Lightning's ``_to_hparams_dict``)."""
    if isinstance(config, Namespace):
        return vars(config)
    if isinstance(config, Mapping):
        return config
    if isinstance(config, _PRIMITIVE_TYPES):  # Lightning's words
        raise ValueError(f"Primitives {_PRIMITIVE_TYPES} are not allowed. save_hyperparameters({config!r}): pass "
                         "argument names (strings), one dict or one argparse.Namespace")
    raise ValueError(f"Unsupported config type of {type(config)}. save_hyperparameters(...): pass argument names "
                     "(strings), one dict or one argparse.Namespace")


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` is the container ``b`` (or equal to it): how Lightning finds the argument it came in."""
    return a is b or not _differ(a, b)


def logged_hparams(obj: Any) -> dict[str, Any] | None:
    """What ``obj`` (a module or data module) gives the loggers: its :attr:`~HyperparametersMixin.hparams_initial`
    when ``save_hyperparameters(logger=True)`` (the default) saved some; None otherwise (a plain ``nn.Module``,
    a module that saved none), as Lightning's ``_log_hyperparams`` attribute."""
    return dict(obj.hparams_initial) if getattr(obj, "_log_hyperparams", False) else None


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
    for name in [k for k, v in hparams.items() if not is_picklable(v)]:
        if warn:
            warnings.warn(f"Attribute '{name}' removed from hparams because it cannot be pickled. You can suppress "
                          f"this warning by setting `self.save_hyperparameters(ignore=['{name}'])`.", UserWarning,
                          stacklevel=4)
        del hparams[name]


def merged_hparams(model: Any, datamodule: Any) -> dict[str, Any] | None:
    """What the loggers get when a fit starts, as Lightning's ``_log_hyperparams`` (``loggers/utilities.py``): the
    hyperparameters of ``model`` and of ``datamodule`` as first saved (:func:`logged_hparams`; either may have
    none, or be None) in one dict; None when neither saved any (no ``log_hyperparams`` call).

    Raises:
        RuntimeError: a name that both hold with different values (a different type, another tensor object, or
            unequal), naming them.
    """
    mine, theirs = logged_hparams(model), logged_hparams(datamodule)
    if mine is None or theirs is None:
        return mine if theirs is None else theirs
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


def _init_arguments(obj: Any, frame: Any) -> dict[str, Any]:
    """The arguments ``obj``'s ``__init__`` calls were given, as Lightning's ``collect_init_args``: a dataclass's
    fields that ``__init__`` takes; otherwise, from ``frame`` outwards, each frame of an ``__init__`` running on an
    instance of this mixin adds its named arguments (``**kwargs`` spread; ``self`` and ``*args`` not), outer
    frames winning; frames before the first such ``__init__`` are passed over, and the first other frame after
    it ends the walk. (Lightning also stops at an ``__init__`` that does not call ``super()``; here its
    arguments count too, so a data module without ``super().__init__()`` keeps them.)"""
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    found: dict[str, Any] = {}
    inside = False
    while frame is not None and frame.f_back is not None:
        args, _, varkw, values = inspect.getargvalues(frame)
        if frame.f_code.co_name == "__init__" and args and isinstance(values[args[0]], HyperparametersMixin):
            inside = True
            found.update({name: values[name] for name in args[1:]})  # outwards: an outer __init__'s value wins
            found.update(values[varkw] if varkw else {})
        elif inside:
            break
        frame = frame.f_back
    return found


# where Lightning's older releases kept a module's hyperparameters (its CHECKPOINT_PAST_HPARAMS_KEYS), read first
_PAST_KEYS = ("hparams", "module_arguments")


def checkpoint_init_kwargs(cls: type, entries: Mapping[str, Any], overrides: Mapping[str, Any],
                           weights_only: bool | None, path: Any, prefix: str = "") -> dict[str, Any]:
    """The keyword arguments that rebuild ``cls`` (a module, or with ``prefix="datamodule_"`` a data module) from
    a checkpoint's ``entries``, as Lightning's ``_load_state`` (``core/saving.py``): the saved hyperparameters
    (a module's under Lightning's older keys ``hparams`` and ``module_arguments`` too, then ``hyper_parameters``;
    with ``weights_only=False`` also the values of other types, unpickled from ``hparams_pickled``: only for a
    checkpoint you trust), ``overrides`` replacing them; all of them as one
    argument when they came in one container that ``__init__`` takes by that name (``hparams_name``), the
    ``overrides`` beside it; then only the arguments ``__init__`` takes (all when it takes ``**kwargs``).

    Raises:
        TypeError: a required argument of ``cls.__init__`` that is not among them, named with why it is missing.
    """
    saved = {**_saved_hparams(entries, prefix), **_unpickled(entries, weights_only, prefix), **overrides}
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if entries.get(f"{prefix}hparams_name") in named:
        saved = {entries[f"{prefix}hparams_name"]: saved, **overrides}
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        saved = {k: v for k, v in saved.items() if k in named}
    missing = [p.name for p in params if p.default is p.empty and p.name in named and p.name not in saved]
    if missing:
        raise TypeError(f"{cls.__name__}.load_from_checkpoint({str(path)!r}): __init__ needs {', '.join(missing)}: "
                        f"{_why_missing(missing, entries, prefix)}; pass them: {cls.__name__}.load_from_checkpoint("
                        f"path, {', '.join(f'{name}=...' for name in missing)})")
    return saved


def _saved_hparams(entries: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The plain hyperparameters a checkpoint holds: a module's under Lightning's older keys, then under
    ``hyper_parameters`` (``datamodule_hyper_parameters`` for a data module), the newer winning."""
    saved = {} if prefix else {k: v for key in _PAST_KEYS for k, v in (entries.get(key) or {}).items()}
    return {**saved, **entries.get(f"{prefix}hyper_parameters", {})}


def _unpickled(entries: Mapping[str, Any], weights_only: bool | None, prefix: str) -> dict[str, Any]:
    """The hyperparameters of other types than plain values, unpickled, with ``weights_only=False`` only."""
    if weights_only is not False:
        return {}
    return {k: pickle.loads(b) for k, b in entries.get(f"{prefix}hparams_pickled", {}).items()}


def _why_missing(missing: list[str], entries: Mapping[str, Any], prefix: str) -> str:
    left_out = [name for name in missing if name in (entries.get(f"{prefix}hparams_left_out") or ())]
    pickled = [name for name in left_out if name in (entries.get(f"{prefix}hparams_pickled") or {})]
    if pickled:
        return (f"{', '.join(left_out)} not saved as plain values (read with torch.load(weights_only=True)); "
                f"weights_only=False unpickles {', '.join(pickled)} (only for a checkpoint you trust)")
    if left_out:
        return f"{', '.join(left_out)} not saved (not of a plain type, so left out of the checkpoint)"
    if not entries.get(f"{prefix}hyper_parameters"):
        return "the checkpoint holds no hyperparameters (call self.save_hyperparameters() in __init__)"
    return "not among the saved hyperparameters"
