"""The Runtime's flags as the user gives them, declared once: a dataclass whose fields' types, defaults and
descriptions the ``Runtime`` and ``Trainer`` signatures repeat (tests/test_trainer_config.py keeps them equal) and
from which the command lines are generated (``trainscale.cli.flags``, ``trainscale.cli.LightningCLI``).

Each flag's own rule is declared on its field (:func:`flag`: a least value or a check of its own; the kind of value,
and the choices of a ``Literal``, from the field's type) and applied by one function, :func:`check_flags`; rules
across flags are code in the resolvers (``resolve``, ``resolve_trainer_config``). Imports no torch, so
``trainscale demo --help`` stays light.

A flag with a closed set of values is typed ``Literal[...]``: a type checker refuses ``precision="bf16_mixed"`` in
your editor or CI, the command line lists the choices, and the resolvers check the same set (``typing.get_args``;
users without a type checker still get the error that names the choices).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import re
import types
import typing
from dataclasses import KW_ONLY, dataclass, field, fields
from datetime import timedelta
from typing import Any, Callable, Literal, ParamSpec, Union, get_args, get_origin

_Params = ParamSpec("_Params")

AcceleratorFlag = Literal["auto", "cpu", "cuda", "gpu", "mps"]
# "ddp_spawn", "ddp_notebook", "ddp_fork": ddp with its processes started by torch.multiprocessing (connector.py);
# "<ddp name>_find_unused_parameters_<true|false>": Lightning's names of ddp with that option (strategies/ddp.py)
StrategyFlag = Literal["auto", "single", "ddp", "fsdp", "dp", "model_parallel", "hsdp", "tp", "pp", "ddp_spawn",
                       "ddp_notebook", "ddp_fork", "ddp_find_unused_parameters_false",
                       "ddp_find_unused_parameters_true", "ddp_spawn_find_unused_parameters_false",
                       "ddp_spawn_find_unused_parameters_true", "ddp_fork_find_unused_parameters_false",
                       "ddp_fork_find_unused_parameters_true", "ddp_notebook_find_unused_parameters_false",
                       "ddp_notebook_find_unused_parameters_true"]
PrecisionFlag = Literal["32-true", "16-mixed", "bf16-mixed", "bf16-true", "64-true"]
MatmulPrecisionFlag = Literal["highest", "high", "medium"]  # torch.set_float32_matmul_precision's values
PipelineScheduleFlag = Literal["gpipe", "1f1b"]  # torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B


@dataclass(frozen=True)
class RuntimeFlags:
    """The flags of :class:`~trainscale.runtime.runtime.Runtime` as the user gave them;
    :func:`~trainscale.runtime.connector.resolve` turns them into a ``RunConfig``. ``Runtime.__init__`` and
    ``Trainer.__init__`` name each of them in their signatures, with these types, defaults and descriptions
    (tests/test_trainer_config.py keeps them equal); the command lines take their options from here.

    Attributes:
        accelerator: "auto", "cpu", "cuda" ("gpu") or "mps".
        devices: processes (CPU) or GPUs per node, or "auto" (all GPUs; under a launcher, the launcher's
            processes per node; else 1).
        strategy: "auto", "single", "ddp", "fsdp", "dp", "model_parallel", "hsdp", "tp", "pp" (docs/strategies.md),
            or "ddp_spawn"/"ddp_notebook"/"ddp_fork": ddp with the processes started from this one by spawn/fork/fork;
            Lightning's "ddp_find_unused_parameters_true"/"_false" (also after "ddp_spawn", "ddp_fork",
            "ddp_notebook"): that ddp with ``find_unused_parameters`` True/False. In Python also a strategy object built
            with options only, Lightning's way (``trainscale.strategies.DDPStrategy(find_unused_parameters=True)``):
            its name and those options.
        num_nodes: machines in the job; None (not given): the launcher's count of nodes (pods, SLURM nodes,
            torchrun's agents), 1 without a launcher.
        precision: "32-true", "16-mixed", "bf16-mixed", "bf16-true" or "64-true" (float64 parameters, inputs and
            default dtype; also Lightning's 64 and "64").
        timeout: seconds a collective may wait before it fails (``init_process_group``'s timeout).
        strategy_options: keyword options of the strategy (ddp: ``find_unused_parameters``, ``static_graph``,
            ``gradient_as_bucket_view``, ``bucket_cap_mb``, ``ddp_comm_hook``; dp: ``device_ids``; fsdp:
            ``auto_wrap_policy``, ``reshard_after_forward``, ``cpu_offload``; tp: ``sequence_parallel``).
        sync_batchnorm: convert BatchNorm layers to ``SyncBatchNorm`` (ddp, CUDA only).
        activation_checkpointing: ``nn.Module`` classes, or class names (``{"LlamaDecoderLayer"}``), whose
            instances recompute their forward in backward (``torch.utils.checkpoint``, non-reentrant): less
            activation memory, about one more forward.
        compile: ``torch.compile`` the module before the strategy wraps it; True, or a dict of its arguments.
        float32_matmul_precision: None (leave PyTorch's setting), or "highest", "high" (TF32 on Ampere and newer)
            or "medium", applied with ``torch.set_float32_matmul_precision``.
        parallel: the device mesh under "model_parallel" (required), "hsdp", "tp" or "pp":
            ``{"pp": P, "dp_replicate": R, "dp_shard": S, "tp": T}``, P·R·S·T = world size.
        tp_plan: ``{submodule name: ColwiseParallel() | RowwiseParallel() | ...}`` for your model; default: the
            built-in plan of ``trainscale.models.GPT``.
        parallelize: ``fn(model, mesh) -> model`` applying your own tensor parallelism instead.
        pp_schedule: "gpipe" or "1f1b" (default) under pipeline stages.
        pp_microbatches: micro-batches each batch is cut into (default 4·P).
        pp_split_points: the submodule names where stages 2..P begin (default: the built-in split of
            ``trainscale.models.GPT``).
    """

    accelerator: AcceleratorFlag = "auto"
    devices: int | Literal["auto"] = "auto"
    strategy: StrategyFlag = "auto"
    num_nodes: int | None = None
    precision: PrecisionFlag = "32-true"
    _: KW_ONLY
    timeout: float = 1800.0
    strategy_options: dict | None = None
    sync_batchnorm: bool = False
    activation_checkpointing: Any = None
    compile: bool | dict = False
    float32_matmul_precision: MatmulPrecisionFlag | None = None
    parallel: dict | None = None
    tp_plan: dict | None = None
    parallelize: Callable | None = None
    pp_schedule: PipelineScheduleFlag | None = None
    pp_microbatches: int | None = None
    pp_split_points: list | None = None


def make_flags(cls: type, owner: str, args: tuple = (), kwargs: dict | None = None) -> Any:
    """``cls(*args, **kwargs)`` for a flags dataclass, with an unknown or misspelt flag named as ``owner``'s
    (``TypeError: Trainer.__init__() got an unexpected keyword argument 'max_epoch'; did you mean 'max_epochs'?``).

    Raises:
        TypeError: an unknown flag, or too many positional arguments.
    """
    kwargs = kwargs or {}
    check_flag_names(owner, kwargs, [f.name for f in fields(cls)])
    try:
        return cls(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"{owner}(): {err}".replace(f"{cls.__name__}.__init__() ", "")) from None


def names_closest_flag(init: Callable[_Params, None]) -> Callable[_Params, None]:
    """Decorate a constructor so that a misspelt keyword raises ``TypeError`` naming the closest of its parameters
    (``Trainer.__init__() got an unexpected keyword argument 'max_epoch'; did you mean 'max_epochs'?``: Python's
    words, as Lightning's Trainer raises them, with the hint Python would not give).

    The signature stays what ``__init__`` declares: ``inspect.signature`` follows ``__wrapped__``, and type checkers
    read it through the ``ParamSpec`` (mypy then refuses the misspelt keyword too: ``Unexpected keyword argument
    "max_epoch" for "Trainer"; did you mean "max_epochs"?``).
    """
    owner = init.__qualname__.split(".")[0]
    known = [name for name in inspect.signature(init).parameters if name != "self"]

    @functools.wraps(init)
    def checked(*args: _Params.args, **kwargs: _Params.kwargs) -> None:
        check_flag_names(owner, kwargs, known)
        init(*args, **kwargs)

    return checked


def defaults_from_env_vars(init: Callable[_Params, None]) -> Callable[_Params, None]:
    """Decorate the Trainer's constructor so that a flag not given takes its value from the environment variable
    ``PL_TRAINER_<FLAG>`` when that is set and not empty, as Lightning's ``_defaults_from_env_vars``
    (``PL_TRAINER_MAX_STEPS=7``, ``PL_TRAINER_LOGGER=False``, ``PL_TRAINER_DEVICES=2``): the text is read as a
    Python literal (``ast.literal_eval``: numbers, True/False/None, strings in quotes, lists, dicts), kept as a
    string when it is not one (``PL_TRAINER_ACCELERATOR=cpu``). A flag given in the call wins over the variable;
    the value is then checked as the flag's value is. The signature stays ``init``'s (``__wrapped__``)."""
    import ast
    import os

    prefix = "PL_" + init.__qualname__.split(".")[0].upper() + "_"
    known = [name for name in inspect.signature(init).parameters if name != "self"]

    @functools.wraps(init)
    def with_env_defaults(*args: _Params.args, **kwargs: _Params.kwargs) -> None:
        for name in known:
            text = os.environ.get(prefix + name.upper())
            if name not in kwargs and text:
                try:
                    kwargs[name] = ast.literal_eval(text)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    kwargs[name] = text
        init(*args, **kwargs)

    return with_env_defaults


def check_flag_names(owner: str, names, known) -> None:
    """Raise ``TypeError`` for the first of ``names`` not in ``known``, in Python's words for an unknown keyword,
    naming the closest known flag."""
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {name!r}"
                            + (f"; did you mean {close[0]!r}?" if close else f"; its flags are: {', '.join(known)}"))


def flag(default: Any, *, low: float | None = None, check: Callable[[str, Any], None] | None = None,
         hint: str = "") -> Any:
    """A flag's dataclass field: its default and the rule :func:`check_flags` applies to its value.

    Args:
        default: the flag's default.
        low: the least value of an int or number flag (which of the two, and whether None is allowed, the field's
            type says; a bool flag, or one typed ``Literal[...]`` (its choices), needs no rule but ``flag(default)``).
        check: ``check(name, value)`` raising ``ValueError``: a rule of its own.
        hint: words added to the error message.
    """
    return field(default=default, metadata={"rule": {"low": low, "check": check, "hint": hint}})


def check_flags(flags: Any) -> None:
    """Check each field of the flags dataclass ``flags`` that has a rule (:func:`flag`) against its type and rule.

    Raises:
        ValueError: the first value that breaks its rule, naming the flag, the value and what it accepts.
    """
    types = typing.get_type_hints(type(flags))
    for f in fields(flags):
        if "rule" in f.metadata:
            _check_value(f.name, getattr(flags, f.name), types[f.name], **f.metadata["rule"])


def union_members(annotation: Any) -> tuple:
    """``(int, str)`` for ``int | str``; ``(annotation,)`` for a type that is no union (``Literal["a", "b"]``)."""
    return get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)


def choices_of(annotation: Any) -> tuple | None:
    """The values a flag typed with ``Literal[...]`` accepts, None first, then True and False where its type
    holds them (``bool | Literal["warn"] | None``); None for a flag of an open type (``int``, ``str``)."""
    members = union_members(annotation)
    literals = [value for member in members if get_origin(member) is Literal for value in get_args(member)]
    if not literals:
        return None
    none = (None,) if type(None) in members else ()
    bools = (True, False) if bool in members else ()
    return (*none, *bools, *literals)


def _check_value(name: str, value: Any, annotation: Any, low, check, hint) -> None:
    kinds = union_members(annotation)
    optional = type(None) in kinds
    choices = choices_of(annotation)
    if check is not None:
        check(name, value)
    elif choices is not None:
        if value not in choices:
            names = [repr(c) for c in choices]
            raise ValueError(f"{name}={value!r}; choose {', '.join(names[:-1])} or {names[-1]}")
    elif optional and value is None:
        return
    elif bool in kinds:
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be True or False")
    elif float in kinds:
        check_number(name, value, low, optional=optional, hint=hint)
    elif int in kinds:
        check_int(name, value, low, optional=optional, hint=hint)


def check_int(name: str, value: Any, low: int, optional: bool = False, hint: str = "") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= ``low`` (or None, when ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}" + (" or None" if optional and not hint else "")
                         + hint)


def check_number(name: str, value: Any, low: float, optional: bool = False, hint: str = "") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite number >= ``low`` (or None: ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        raise ValueError(f"{name}={value!r} must be a finite number >= {low}" + (" or None" if optional else "")
                         + hint)


def parse_duration(name: str, value) -> timedelta | None:
    """A duration flag (``max_time``, a time-based ``val_check_interval``; the ``Timer`` callback's ``duration``)
    as a ``timedelta``, from Lightning's spellings: "DD:HH:MM:SS", a ``timedelta``, or a dict of ``timedelta``
    keyword arguments such as ``{"hours": 1, "minutes": 30}``; the string's four parts are any whole numbers
    ("0:0:90:0" is 90 minutes), as Lightning reads them. ``name`` is the flag the errors name.

    Raises:
        ValueError: another type, a string of another format, a dict ``timedelta`` refuses, a negative duration.
    """
    if value is None:
        return None
    if isinstance(value, str):
        match = re.fullmatch(r"(\d+):(\d+):(\d+):(\d+)", value.strip())  # any ints, as Lightning's split
        if match is None:
            raise ValueError(f"{name}={value!r} must be 'DD:HH:MM:SS' (days, hours, minutes, seconds), e.g. "
                             "'00:12:00:00' for 12 hours")
        days, hours, minutes, seconds = map(int, match.groups())
        value = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif isinstance(value, dict):
        try:
            value = timedelta(**value)
        except TypeError as err:
            raise ValueError(f"{name}={value!r}: {err}; pass timedelta's keywords, e.g. {{'hours': 2}}") from None
    if not isinstance(value, timedelta) or value < timedelta(0):
        raise ValueError(f"{name}={value!r} must be 'DD:HH:MM:SS', a datetime.timedelta or a dict of its keywords, "
                         "not negative, or None")
    return value


class FlagTypeError(TypeError, ValueError):
    """A flag of the wrong type where Lightning raises ``TypeError`` (``gradient_clip_val=(1, 2)``); also a
    ``ValueError``, as trainscale's other flag errors, so that either ``except`` catches it."""
