"""The Runtime's flags as the user gives them, declared once: a dataclass whose fields' types, defaults and
descriptions the ``Runtime`` and ``Trainer`` signatures repeat (tests/test_trainer_config.py keeps them equal) and
from which the command lines are generated (``trainscale.cli.flags``, ``trainscale.cli.LightningCLI``).

Imports no torch, so ``trainscale demo --help`` stays light.
"""

from __future__ import annotations

import difflib
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any, Callable


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
            or "ddp_spawn"/"ddp_notebook": ddp with the processes started from this one by spawn/fork.
        num_nodes: machines in the job; None (not given): the launcher's count of nodes (pods, SLURM nodes,
            torchrun's agents), 1 without a launcher.
        precision: "32-true", "16-mixed", "bf16-mixed" or "bf16-true".
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

    accelerator: str = "auto"
    devices: int | str = "auto"
    strategy: str = "auto"
    num_nodes: int | None = None
    precision: str = "32-true"
    _: KW_ONLY
    timeout: float = 1800.0
    strategy_options: dict | None = None
    sync_batchnorm: bool = False
    activation_checkpointing: Any = None
    compile: bool | dict = False
    float32_matmul_precision: str | None = None
    parallel: dict | None = None
    tp_plan: dict | None = None
    parallelize: Callable | None = None
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    pp_split_points: list | None = None


RUNTIME_FLAG_NAMES = tuple(f.name for f in fields(RuntimeFlags))


def make_flags(cls: type, owner: str, args: tuple = (), kwargs: dict | None = None) -> Any:
    """``cls(*args, **kwargs)`` for a flags dataclass, with an unknown or misspelt flag named as ``owner``'s
    (``TypeError: Trainer() got an unexpected flag 'max_epoch'; did you mean 'max_epochs'?``).

    Raises:
        TypeError: an unknown flag, or too many positional arguments.
    """
    kwargs = kwargs or {}
    check_flag_names(owner, kwargs, [f.name for f in fields(cls)])
    try:
        return cls(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"{owner}(): {err}".replace(f"{cls.__name__}.__init__() ", "")) from None


def check_flag_names(owner: str, names, known) -> None:
    """Raise ``TypeError`` for the first of ``names`` not in ``known``, naming the closest known flag."""
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            raise TypeError(f"{owner}() got an unexpected flag {name!r}"
                            + (f"; did you mean {close[0]!r}?" if close else f"; its flags are: {', '.join(known)}"))
