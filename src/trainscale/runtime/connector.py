"""User flags become one resolved configuration, here and only here.

Pure logic: the machine's facts (CUDA device count, MPS) are arguments, so every rule is
unit-tested without hardware. Unknown or conflicting values raise ``ValueError`` naming the
valid choices or the flag to change, before any process or process group exists.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, get_args

from trainscale.runtime import hf
from trainscale.runtime.devices import ACCELERATORS, detect_accelerator
from trainscale.runtime.flags import MatmulPrecisionFlag, RuntimeFlags, make_flags
from trainscale.runtime.precision import PRECISIONS
from trainscale.runtime.strategies import STRATEGIES, STRATEGY_CLASSES, Strategy
from trainscale.runtime.strategies.ddp import FIND_UNUSED_NAMES, DDPStrategy
from trainscale.runtime.strategies.parallel_dims import PP_SCHEDULES, ParallelDims, resolve_parallel

# Names that mean "ddp, with the processes started by torch.multiprocessing from this process" (Lightning's
# names): the start method is how the processes come to be, not another strategy. Without one, a job of
# several processes is started by torchrun (a script relaunched under it, or `trainscale run`) or srun.
START_METHOD_NAMES = {"ddp_spawn": "spawn", "ddp_notebook": "fork", "ddp_fork": "fork"}


MATMUL_PRECISIONS = (None, *get_args(MatmulPrecisionFlag))

# Keywords of Lightning's strategy classes (its DDPStrategy, FSDPStrategy, ModelParallelStrategy,
# SingleDeviceStrategy) that trainscale takes as a flag, or does not offer: each → what to do instead.
_FLAG_INSTEAD = "are the Trainer's flags here: pass Trainer({}=...)"
LIGHTNING_REFUSED = {
    "accelerator": "pass the accelerator flag: Trainer(accelerator=...)",
    "parallel_devices": "pass the devices and accelerator flags: Trainer(accelerator=..., devices=N); choose the GPUs "
                        "with CUDA_VISIBLE_DEVICES",
    "device": "pass the accelerator flag: Trainer(accelerator=..., devices=1); choose the GPU with "
              "CUDA_VISIBLE_DEVICES",
    "precision_plugin": "pass the precision flag: Trainer(precision=...)",
    "precision": "pass the precision flag: Trainer(precision=...)",
    "mixed_precision": "pass the precision flag: Trainer(precision='bf16-mixed'); FSDP's MixedPrecisionPolicy follows "
                       "it",
    "cluster_environment": "unsupported: trainscale reads the launcher's variables itself (torchrun, SLURM, MPI, LSF, "
                           "Kubernetes)",
    "checkpoint_io": "unsupported: the strategy writes the checkpoints (Trainer(checkpoint_async=True) writes sharded "
                     "ones in the background)",
    "ddp_comm_wrapper": "unsupported: wrap your hook yourself and pass the result as ddp_comm_hook",
    "model_averaging_period": "unsupported (post-local SGD model averaging)",
    "device_mesh": "pass strategy='hsdp', or strategy='model_parallel' with parallel={'dp_replicate': R, "
                   "'dp_shard': S}",
    "data_parallel_size": "pass the mesh as a flag: Trainer(parallel={'dp_shard': D, 'tp': T})",
    "tensor_parallel_size": "pass the mesh as a flag: Trainer(parallel={'dp_shard': D, 'tp': T})",
    "save_distributed_checkpoint": "unsupported: the checkpoints of model_parallel are sharded (DCP directories), "
                                   "which load on another mesh",
    **{name: f"pass it as the flag: Trainer({name}=...)" for name in ("parallel", "tp_plan", "parallelize")},
}
# Lightning's plugin kinds (the base class of each plugin object) → what trainscale does in their place
_PLUGIN_INSTEAD = {"Precision": LIGHTNING_REFUSED["precision_plugin"],
                   "CheckpointIO": LIGHTNING_REFUSED["checkpoint_io"],
                   "ClusterEnvironment": LIGHTNING_REFUSED["cluster_environment"],
                   "LayerSync": "pass the sync_batchnorm flag: Trainer(sync_batchnorm=True) (torch's SyncBatchNorm)"}


def check_plugins(plugins: Any) -> None:
    """Lightning's ``Trainer(plugins=...)``: None, or an empty list or tuple, is taken (no plugin); trainscale sets
    precision, the cluster environment, checkpoint writing and layer sync from its flags, in one place.

    Raises:
        ValueError: a plugin (an object, or a name), naming what to pass instead by the Lightning class it derives
            from (``Precision``, ``CheckpointIO``, ``ClusterEnvironment``, ``LayerSync``).
    """
    for plugin in [] if plugins is None else plugins if isinstance(plugins, (list, tuple)) else [plugins]:
        kinds = [_PLUGIN_INSTEAD[cls.__name__] for cls in type(plugin).__mro__ if cls.__name__ in _PLUGIN_INSTEAD]
        instead = kinds[0] if kinds else ("Lightning's plugins are Precision, CheckpointIO, ClusterEnvironment and "
                                          "LayerSync objects, each a flag here (precision, sync_batchnorm) or unneeded")
        raise ValueError(f"plugins={plugins!r}: trainscale takes no plugins; {instead}")


# Lightning's FSDPStrategy(sharding_strategy=...) → trainscale's fsdp options (FSDP2 has no NO_SHARD or HYBRID_SHARD
# mode: those are ddp and hsdp here)
SHARDING_STRATEGIES: dict[str, dict | str] = {
    "FULL_SHARD": {"reshard_after_forward": True}, "SHARD_GRAD_OP": {"reshard_after_forward": False},
    "NO_SHARD": "pass strategy='ddp' (no sharding)",
    "HYBRID_SHARD": "pass strategy='hsdp' (shard within a node, replicate across nodes)"}
# Lightning's DDPStrategy(start_method=...) → the suffix of trainscale's name ("ddp_spawn", "ddp_fork")
START_METHOD_SUFFIXES = {"popen": "", "spawn": "_spawn", "fork": "_fork"}


def strategy_object_flags(flags: RuntimeFlags) -> tuple[RuntimeFlags, str | None]:
    """``flags`` whose ``strategy`` is a strategy object built without device and world (Lightning's way:
    ``Trainer(strategy=DDPStrategy(find_unused_parameters=True))``) as the flags it stands for, and the
    ``process_group_backend`` it asks for (None: not given; the Runtime checks it). Flags whose strategy is a name
    come back as they are.

    The object's class gives the name ("ddp" for ``DDPStrategy``, with Lightning's ``start_method`` "spawn"/"fork":
    "ddp_spawn"/"ddp_fork"), the keywords it was built with give ``strategy_options``; Lightning's ``timeout`` (a
    ``timedelta``) becomes the ``timeout`` flag in seconds, FSDP's ``activation_checkpointing_policy`` (or
    ``activation_checkpointing``) the ``activation_checkpointing`` flag, and ``sharding_strategy`` "FULL_SHARD" /
    "SHARD_GRAD_OP" ``reshard_after_forward`` True / False.

    Raises:
        ValueError: a strategy bound to a run (another Trainer's ``trainer.strategy``); a strategy object and
            ``strategy_options`` both; a flag given both ways; a keyword of :data:`LIGHTNING_REFUSED` (naming what to
            do instead) or another the strategy does not take (listing those it takes).
    """
    strategy = flags.strategy
    if not isinstance(strategy, Strategy):
        return flags, None
    cls = type(strategy)
    if strategy.world is not None or strategy.device is not None:
        raise ValueError(f"strategy={cls.__name__}(...) was built for a run (with a device or world): pass one built "
                         f"with options only, e.g. {cls.__name__}(), or strategy={cls.name!r}")
    if flags.strategy_options is not None:
        raise ValueError(f"strategy={cls.__name__}(...) carries the strategy's options: pass them to it, not in "
                         f"strategy_options={flags.strategy_options!r} too")
    options = dict(strategy.given_options)
    refused = [f"{cls.__name__}({key}=...): {LIGHTNING_REFUSED[key]}" for key in options if key in LIGHTNING_REFUSED]
    if refused:
        raise ValueError("; ".join(refused))
    name, updates, backend = _lightning_keywords(cls, options)
    defaults = RuntimeFlags()
    for flag in updates:
        if getattr(flags, flag) != getattr(defaults, flag):
            raise ValueError(f"{flag} is given twice: as {flag}={getattr(flags, flag)!r} and by strategy="
                             f"{cls.__name__}(...); drop one")
    cls.check_options(options, cls.name)
    return dataclasses.replace(flags, strategy=name, strategy_options=options or None, **updates), backend


def _lightning_keywords(cls: type[Strategy], options: dict) -> tuple[str, dict, str | None]:
    """Take Lightning's keywords out of ``options`` (in place): ``(strategy name, {flag: value},
    process_group_backend)``, the flags being ``timeout`` and ``activation_checkpointing`` where given."""
    method = options.pop("start_method", "popen")
    if method not in START_METHOD_SUFFIXES or (method != "popen" and not issubclass(cls, DDPStrategy)):
        raise ValueError(f"{cls.__name__}(start_method={method!r}): choose 'popen' (the default: the script is "
                         "started again under torchrun), 'spawn' or 'fork' (strategy='ddp_spawn', 'ddp_fork'), for "
                         "DDPStrategy only")
    updates: dict[str, Any] = {}
    timeout = options.pop("timeout", None)  # None: Lightning's too is then the default (30 minutes)
    if timeout is not None:
        if not isinstance(timeout, timedelta):
            raise ValueError(f"{cls.__name__}(timeout={timeout!r}) must be a datetime.timedelta (Lightning's type), or "
                             "pass the flag in seconds: Trainer(timeout=1800)")
        updates["timeout"] = timeout.total_seconds()
    policies = [options.pop(key) for key in ("activation_checkpointing", "activation_checkpointing_policy")
                if key in options]
    if len(policies) == 2:
        raise ValueError(f"{cls.__name__}: pass activation_checkpointing_policy or activation_checkpointing, not both")
    if policies:
        updates["activation_checkpointing"] = policies[0]
    if "sharding_strategy" in options:
        sharding = options.pop("sharding_strategy")
        mapped = SHARDING_STRATEGIES.get(sharding.name if isinstance(sharding, enum.Enum) else sharding)  # torch's
        if not isinstance(mapped, dict):
            raise ValueError(f"{cls.__name__}(sharding_strategy={sharding!r}): "
                             + (mapped or "choose 'FULL_SHARD' or 'SHARD_GRAD_OP'"))
        options.update(mapped)
    if options.pop("state_dict_type", "sharded") != "sharded":
        raise ValueError(f"{cls.__name__}(state_dict_type='full'): the checkpoints of fsdp are sharded (DCP "
                         "directories); drop state_dict_type, and export whole weights with "
                         "trainer.strategy.save_full_state_dict(path, model)")
    return cls.name + START_METHOD_SUFFIXES[method], updates, options.pop("process_group_backend", None)


@dataclass(frozen=True)
class RunConfig:
    """Resolved flags.

    Attributes:
        accelerator: "cpu", "cuda" or "mps".
        devices: processes (or GPUs) per node.
        num_nodes: number of machines.
        strategy: a key of ``STRATEGIES`` other than "auto" ("ddp" for "ddp_spawn"/"ddp_notebook").
        precision: a key of ``PRECISIONS``.
        start_method: how this process starts the ranks: "spawn" ("ddp_spawn"), "fork" ("ddp_notebook",
            "ddp_fork"), or None (the ranks are started by a launcher: torchrun, srun).
        sync_batchnorm: convert BatchNorm layers to ``SyncBatchNorm`` (ddp on CUDA).
        activation_checkpointing: module classes, then class names, whose forward is recomputed in backward.
        compile: ``None`` (eager) or the keyword arguments of ``torch.compile`` (``{}`` for defaults).
        float32_matmul_precision: None (PyTorch's setting, left as it is) or "highest", "high", "medium".
        parallel: the mesh sizes under "model_parallel"/"hsdp"/"tp"/"pp"; None under other strategies.
        pp_schedule, pp_microbatches: under "pp" (pipeline stages): "gpipe" or "1f1b", and the micro-batches
            each batch is cut into; None under other strategies.
    """

    accelerator: str
    devices: int
    num_nodes: int
    strategy: str
    precision: str
    start_method: str | None = None
    sync_batchnorm: bool = False
    activation_checkpointing: tuple = ()
    compile: dict | None = None
    float32_matmul_precision: str | None = None
    parallel: ParallelDims | None = None
    pp_schedule: str | None = None
    pp_microbatches: int | None = None

    @property
    def strategy_class(self) -> type[Strategy]:
        """The class of :attr:`strategy` (``trainscale.runtime.strategies.STRATEGY_CLASSES``): what the Runtime, the
        Trainer and the checkpoints ask of the strategy before it exists."""
        return STRATEGY_CLASSES[self.strategy]

    @property
    def world_size(self) -> int:
        """Processes in the job: ``dp`` drives all its GPUs from one process."""
        return 1 if self.strategy_class.drives_all_devices else self.devices * self.num_nodes

    @property
    def devices_per_process(self) -> int:
        """Devices each process drives: all ``devices`` under ``dp``, else 1 (what MFU divides by)."""
        return self.devices if self.strategy_class.drives_all_devices else 1


def _choices(names) -> str:
    return ", ".join(repr(n) for n in names)


def resolve(*args: Any, cuda_count: int = 0, has_mps: bool = False, **flags: Any) -> RunConfig:
    """Turn user flags (:class:`RuntimeFlags`: ``args`` and ``flags`` as the Runtime takes them) into a
    :class:`RunConfig`; ``timeout`` and ``strategy_options`` are checked by the Runtime.

    Rules: "gpu" is an alias of "cuda"; ``devices="auto"`` is every CUDA device (one process on cpu/mps); strategy
    "auto" is "single" for one device in total, else "ddp"; "ddp_spawn"/"ddp_notebook"/"ddp_fork" are "ddp" with a
    start method; Lightning's "ddp_find_unused_parameters_true" (and ``_false``, and of the three start-method names) is
    that ddp name (``DDPStrategy.options_from`` sets the option); ``sync_batchnorm`` only under ddp on CUDA (torch's SyncBatchNorm refuses CPU tensors);
    ``parallel``/``tp_plan``/``parallelize`` only under the model-parallel strategies, and the ``pp_*`` flags only with
    pipeline stages (pp > 1), which make the strategy "pp" (``parallel_dims.resolve_parallel``).

    Args:
        cuda_count, has_mps: the machine's facts (see ``trainscale.runtime.devices``).

    Raises:
        ValueError: an unknown name (the message lists the valid ones), a non-positive count,
            more CUDA devices than exist, or a strategy that cannot run the requested world.
        TypeError: an unknown flag.
    """
    f = make_flags(RuntimeFlags, "Runtime", args, flags)
    accelerator = _resolve_accelerator(f.accelerator, cuda_count, has_mps)
    devices, num_nodes, precision, sync_batchnorm = f.devices, f.num_nodes, f.precision, f.sync_batchnorm
    num_nodes = 1 if num_nodes is None else num_nodes  # no launcher's count given (Runtime passes the launcher's)
    float32_matmul_precision = f.float32_matmul_precision
    devices = _resolve_devices(devices, accelerator, cuda_count)
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r} must be an int >= 1")
    compile_kwargs = _resolve_compile(f.compile)
    strategy, start_method = _resolve_strategy(f.strategy, accelerator, devices, num_nodes, cuda_count,
                                               compile_kwargs is not None)
    precision = _unified_precision(precision)
    if precision == "64-true" and accelerator == "mps":  # Lightning runs its 64-true tests with RunIf(mps=False)
        raise ValueError("precision='64-true' needs float64 tensors, which MPS does not have; pass accelerator='cpu' "
                         "(or 'cuda'), or precision='32-true'")
    _check_sync_batchnorm(sync_batchnorm, strategy, accelerator)
    if float32_matmul_precision not in MATMUL_PRECISIONS:
        raise ValueError(f"unknown float32_matmul_precision={float32_matmul_precision!r}; choose one of "
                         f"{_choices(MATMUL_PRECISIONS)} (torch.set_float32_matmul_precision's values)")
    dims = _resolve_model_parallel(strategy, f.parallel, f.tp_plan, f.parallelize, devices, num_nodes)
    schedule, microbatches = _resolve_pipeline(dims, f.pp_schedule, f.pp_microbatches, f.pp_split_points)
    return RunConfig(accelerator, devices, num_nodes, "pp" if schedule else strategy, precision, start_method,
                     sync_batchnorm, _resolve_checkpointing(f.activation_checkpointing), compile_kwargs,
                     float32_matmul_precision, dims, schedule, microbatches)


def _resolve_accelerator(accelerator: Any, cuda_count: int, has_mps: bool) -> str:
    """An accelerator flag → "cpu", "cuda" or "mps", checked against the machine (see :func:`resolve`)."""
    if not isinstance(accelerator, str) or accelerator.lower() not in ACCELERATORS:
        raise ValueError(f"unknown accelerator={accelerator!r}; choose one of {_choices(ACCELERATORS)}")
    accelerator = {"gpu": "cuda"}.get(accelerator.lower(), accelerator.lower())
    if accelerator == "auto":
        accelerator = detect_accelerator(cuda_count, has_mps)
    if accelerator == "cuda" and cuda_count == 0:
        raise ValueError("accelerator='cuda' was asked for but no CUDA device is visible; "
                         "pass accelerator='cpu' (devices=N then means N processes)")
    if accelerator == "mps" and not has_mps:
        raise ValueError("accelerator='mps' was asked for but MPS is not available; pass accelerator='cpu'")
    return accelerator


def _resolve_devices(devices: Any, accelerator: str, cuda_count: int) -> int:
    """A devices flag → processes (or GPUs) per node (see :func:`resolve`)."""
    if devices == "auto":
        devices = cuda_count if accelerator == "cuda" else 1
    if isinstance(devices, bool) or not isinstance(devices, int):
        raise ValueError(f"devices={devices!r} must be a positive int or 'auto'")
    if devices < 1:
        raise ValueError(f"devices={devices} must be >= 1 (the number of processes/GPUs per node), or 'auto'")
    if accelerator == "cuda" and devices > cuda_count:
        raise ValueError(f"devices={devices} asks for more CUDA devices than the {cuda_count} visible here; "
                         f"pass devices<={cuda_count} (check CUDA_VISIBLE_DEVICES)")
    if accelerator == "mps" and devices > 1:
        raise ValueError("MPS offers one device; pass devices=1, or accelerator='cpu' for several processes")
    return devices


# Lightning's older spellings (its _PRECISION_INPUT_STR_ALIAS_CONVERSION), taken as Lightning takes them: with its
# warning for 16 and bf16, silently for 32 and 64
PRECISION_ALIASES = {16: "16-mixed", "16": "16-mixed", "bf16": "bf16-mixed", 32: "32-true", "32": "32-true",
                     64: "64-true", "64": "64-true"}


def _unified_precision(precision: Any) -> str:
    """``precision`` as one of ``PRECISIONS``: itself, or a Lightning alias converted (``16`` -> ``"16-mixed"``).

    Raises:
        ValueError: any other value."""
    if isinstance(precision, (str, int)) and not isinstance(precision, bool) and precision in PRECISION_ALIASES:
        unified = PRECISION_ALIASES[precision]
        if str(precision)[:2] not in ("32", "64"):
            warnings.warn(f"`precision={precision!r}` is supported for historical reasons but its usage is "
                          f"discouraged. Please set your precision to {unified} instead!", UserWarning, stacklevel=4)
        return unified
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"unknown precision={precision!r}; choose one of {_choices(PRECISIONS)} (Lightning's 16, "
                         "32, 64 and 'bf16' are taken too)")
    return precision


def _check_sync_batchnorm(sync_batchnorm: Any, strategy: str, accelerator: str) -> None:
    if not isinstance(sync_batchnorm, bool):
        raise ValueError(f"sync_batchnorm={sync_batchnorm!r} must be True or False")
    if sync_batchnorm and not STRATEGY_CLASSES[strategy].supports_sync_batchnorm:
        raise ValueError(f"sync_batchnorm=True synchronizes batch statistics across ddp processes, but "
                         f"strategy={strategy!r}; pass strategy='ddp' (or sync_batchnorm=False)")
    if sync_batchnorm and accelerator != "cuda":
        raise ValueError(f"sync_batchnorm=True needs CUDA: torch.nn.SyncBatchNorm refuses {accelerator} tensors "
                         "in training (its forward raises 'expected input tensor to be on GPU'). On CPU pass "
                         "sync_batchnorm=False (each rank normalizes with its own batch statistics), use larger "
                         "per-device batches, or use GroupNorm/LayerNorm, which need no batch statistics")


def _resolve_model_parallel(strategy: str, parallel: Any, tp_plan: Any, parallelize: Any, devices: int,
                            num_nodes: int) -> ParallelDims | None:
    """The mesh sizes under a model-parallel strategy; ``parallel``/``tp_plan``/``parallelize`` refused elsewhere."""
    if not STRATEGY_CLASSES[strategy].uses_mesh:
        given = [name for name, value in (("parallel", parallel), ("tp_plan", tp_plan), ("parallelize", parallelize))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} describe(s) model parallelism, but strategy={strategy!r}; pass "
                             "strategy='model_parallel' (or 'tp' / 'hsdp' / 'pp')")
        return None
    dims = resolve_parallel(strategy, parallel, devices, num_nodes)
    _check_tp_flags(tp_plan, parallelize, dims)
    if dims.dp_replicate > 1 and dims.dp_shard == 1 and dims.pp == 1:
        raise ValueError(f"parallel={dims.as_dict()} replicates without sharding, which trainscale does not compose "
                         "with a mesh; use dp_shard for those ranks (FSDP), or strategy='ddp'")
    return dims


def _resolve_pipeline(dims: ParallelDims | None, schedule: Any, microbatches: Any,
                      split_points: Any) -> tuple[str | None, int | None]:
    """``(schedule, micro-batches)`` with pipeline stages (pp > 1), else ``(None, None)``; the pp flags are
    refused without stages (see :func:`resolve`)."""
    if dims is None or dims.pp == 1:
        given = [n for n, v in (("pp_schedule", schedule), ("pp_microbatches", microbatches),
                                ("pp_split_points", split_points)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} configure(s) pipeline stages, but there are none; pass "
                             "strategy='pp' (or parallel={'pp': N})")
        return None, None
    schedule = "1f1b" if schedule is None else schedule
    microbatches = 4 * dims.pp if microbatches is None else microbatches
    _check_pipeline_flags(schedule, microbatches, split_points, dims.pp)
    return schedule, microbatches


def _check_pipeline_flags(schedule: Any, microbatches: Any, split_points: Any, stages: int) -> None:
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"unknown pp_schedule={schedule!r}; choose one of {_choices(PP_SCHEDULES)}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pp_microbatches={microbatches!r} must be an int >= 1 (micro-batches per batch)")
    if schedule == "1f1b" and microbatches < stages:
        raise ValueError(f"pp_schedule='1f1b' needs at least one micro-batch per stage, but pp_microbatches="
                         f"{microbatches} < pp={stages}; raise pp_microbatches (4·pp keeps the bubble under 20 %)")
    if split_points is not None and (not isinstance(split_points, (list, tuple))
                                     or not all(isinstance(n, str) for n in split_points)):
        raise ValueError(f"pp_split_points={split_points!r} must be a list of submodule names, e.g. ['layers.4']")


def _resolve_strategy(strategy: Any, accelerator: str, devices: int, num_nodes: int, cuda_count: int,
                      compiled: bool) -> tuple[str, str | None]:
    """A strategy flag → ``(strategy, start_method)`` (see :func:`resolve`), checked by its class
    (``Strategy.check_run``: one process for "single", 2+ CUDA GPUs and no compile for "dp"); raises ``ValueError``."""
    names = (*STRATEGIES, *START_METHOD_NAMES, *FIND_UNUSED_NAMES)
    if not isinstance(strategy, str) or strategy not in names:
        raise ValueError(f"unknown strategy={strategy!r}; choose one of {_choices(names)}")
    strategy = FIND_UNUSED_NAMES.get(strategy, (strategy,))[0]  # "ddp_spawn_find_unused_parameters_true": ddp_spawn
    start_method = START_METHOD_NAMES.get(strategy)
    if start_method is not None:
        if num_nodes > 1:
            raise ValueError(f"strategy={strategy!r} starts processes on this machine only, but num_nodes={num_nodes}; "
                             "pass strategy='ddp' and start each node with `trainscale run` or torchrun")
        strategy = "ddp"
    world_size = devices * num_nodes
    if strategy == "auto":
        strategy = "single" if world_size == 1 else "ddp"
    STRATEGY_CLASSES[strategy].check_run(accelerator=accelerator, devices=devices, num_nodes=num_nodes,
                                         cuda_count=cuda_count, compiled=compiled)
    return strategy, start_method


def _resolve_checkpointing(classes: Any) -> tuple:
    """None → (); a Module subclass, or a collection of them and of class names (strings, as Hugging Face's
    ``_no_split_modules`` names a decoder layer) → a tuple of classes, then names."""
    if classes is None:
        return ()
    if isinstance(classes, type):
        classes = (classes,)
    types, names = hf.split_policy(classes, "activation_checkpointing")
    return (*types, *sorted(names))


def _resolve_compile(compile: Any) -> dict | None:
    """False → None; True → {}; a dict is checked against ``torch.compile``'s keyword arguments."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, dict):
        raise ValueError(f"compile={compile!r} must be True, False or a dict of torch.compile arguments")
    import inspect

    import torch

    valid = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    unknown = sorted(set(compile) - set(valid))
    if unknown:
        raise ValueError(f"compile has unknown torch.compile arguments {unknown}; valid ones: {', '.join(valid)}")
    return dict(compile)


def _check_tp_flags(tp_plan: Any, parallelize: Any, dims: ParallelDims) -> None:
    """``tp_plan`` a dict of names to styles (not Hugging Face's strings), only with tp > 1; ``parallelize`` a
    callable; not both."""
    if tp_plan is not None and parallelize is not None:
        raise ValueError("pass tp_plan or parallelize, not both (parallelize replaces the tensor-parallel step)")
    if tp_plan is not None and (not isinstance(tp_plan, dict) or not all(isinstance(k, str) for k in tp_plan)):
        raise ValueError(f"tp_plan={tp_plan!r} must be a dict {{submodule name: ColwiseParallel() | RowwiseParallel() "
                         "| ...}}")
    hf_styles = {k: v for k, v in (tp_plan or {}).items() if isinstance(v, str)}
    if hf_styles:
        raise ValueError(f"tp_plan values must be torch ParallelStyle objects, but {hf_styles} are strings (Hugging "
                         "Face's tp_plan names); write them as torch.distributed.tensor.parallel styles: 'colwise' -> "
                         "ColwiseParallel(), 'rowwise' -> RowwiseParallel(), 'sequence_parallel' -> SequenceParallel(), "
                         "e.g. tp_plan={'layers.*.up': ColwiseParallel(), 'layers.*.down': RowwiseParallel()}")
    if tp_plan is not None and dims.tp < 2:
        raise ValueError(f"tp_plan splits layers over the tp ranks, but parallel={dims.as_dict()} has tp=1; "
                         "add 'tp': N to parallel")
    if parallelize is not None and not callable(parallelize):
        raise ValueError(f"parallelize={parallelize!r} must be a function fn(model, mesh) -> model")
