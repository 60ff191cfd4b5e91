"""Command-line options generated from the flag declarations, by jsonargparse (the library Lightning's LightningCLI
uses), never declared again by hand.

The Trainer's flags are declared once, as fields of :class:`~trainscale.runtime.flags.RuntimeFlags` and
:class:`~trainscale.loop.config.TrainerConfig` (type, default, and a description in the class's "Attributes"
section). jsonargparse reads those fields: an option here has the field's type (``--devices 2`` is the int 2,
``--devices auto`` the string) and its description as help, so ``trainscale demo --help``, a
:class:`~trainscale.cli.lightning_cli.LightningCLI` script's ``--trainer.devices`` and ``help(Trainer)`` say the same
thing. Values are checked where the Trainer checks them (``resolve``, ``resolve_trainer_config``): a bad one is the
Trainer's own one-line error.

jsonargparse is imported only when a command that uses it runs (about 0.27 s here): ``trainscale --help`` does not.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import fields
from typing import Any

from trainscale.loop.config import TrainerConfig
from trainscale.runtime.flags import RuntimeFlags, union_members

# Where the Trainer's flags are declared: the Runtime's, then the loop's (Trainer.__init__'s order).
DECLARATIONS: tuple[type, ...] = (RuntimeFlags, TrainerConfig)


def new_parser(prog: str, description: str):
    """A jsonargparse parser for one ``trainscale`` command (``prog`` as in its usage line)."""
    from jsonargparse import ArgumentParser

    return ArgumentParser(prog=prog, description=description)


def add_trainer_flags(parser, names: list[str] | None = None, nested_key: str | None = None,
                      defaults: dict | None = None) -> None:
    """Add the Trainer flags ``names`` (None: all of them) to a jsonargparse ``parser`` as ``--NAME`` (or
    ``--NESTED_KEY.NAME``), each with its declared type and description; ``defaults`` replaces a declared default.

    Raises:
        ValueError: a name that is no declared flag.
    """
    declared = {f.name for cls in DECLARATIONS for f in fields(cls)}
    unknown = set(names or ()) - declared
    if unknown:
        raise ValueError(f"{sorted(unknown)} are not Trainer flags; declared: {', '.join(sorted(declared))}")
    for cls in DECLARATIONS:
        own = {f.name for f in fields(cls)}
        chosen = own if names is None else own & set(names)
        if chosen:
            parser.add_class_arguments(cls, nested_key, as_group=False, skip=own - chosen, instantiate=False)
    for name, value in (defaults or {}).items():
        parser.set_defaults({f"{nested_key}.{name}" if nested_key else name: value})


def declared_help(name: str) -> str:
    """The description of the Trainer flag ``name``, as jsonargparse reads it from its declaration."""
    from jsonargparse import ArgumentParser

    scratch = ArgumentParser()
    add_trainer_flags(scratch, [name])
    return next(a.help for a in scratch._actions if a.dest == name)


def add_sweep_flag(parser, name: str, what: str, default: list, element: type | None = None) -> None:
    """``--NAME A,B,...``: the values of the Trainer flag ``name`` a command sweeps (one run each), each parsed as
    the declared type (narrowed to ``element`` when given), with ``what`` then the declared description as help."""
    annotation = typing.get_type_hints(_declaring_class(name))[name]
    # a Literal's values are strings that the command checks itself: bench and plan sweep fewer strategies than the
    # Trainer takes, and say which
    members = tuple(str if typing.get_origin(kind) is typing.Literal else kind for kind in union_members(annotation))
    if element is not None:
        if element not in members:
            raise ValueError(f"{name} is declared {annotation}, which has no {element.__name__}")
        members = (element,)
    parser.add_argument(f"--{name.replace('_', '-')}", type=_CommaList(name, members), default=default,
                        help=f"{what}; each one as the Trainer's {name}: {declared_help(name)}")


def _declaring_class(name: str) -> type:
    return next(cls for cls in DECLARATIONS if name in {f.name for f in fields(cls)})


class _CommaList:
    """Parses ``"A,B,..."`` into a list, each value as the first of ``members`` (int, str) it is."""

    def __init__(self, name: str, members: tuple) -> None:
        self.name, self.members = name, members

    def __repr__(self) -> str:  # the "type:" that --help shows
        return "comma-separated " + " | ".join(getattr(k, "__name__", str(k)) for k in self.members)

    def __call__(self, text: str | list) -> list[Any]:
        values = text.split(",") if isinstance(text, str) else map(str, text)  # a list: jsonargparse's check again
        return [self._one(value.strip()) for value in values if value.strip()]

    def _one(self, value: str) -> Any:
        for kind in self.members:
            if kind is int and value.lstrip("-").isdigit():
                return int(value)
            if kind is str:
                return value
        raise argparse.ArgumentTypeError(f"--{self.name} {value!r}: each value must be "
                                         + " or ".join(getattr(k, "__name__", str(k)) for k in self.members))


ints = _CommaList("batch-sizes", (int,))  # --batch-sizes 8,16 (no Trainer flag: the loader's batch size)
