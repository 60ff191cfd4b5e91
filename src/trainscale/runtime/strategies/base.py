"""The :class:`Strategy` base: what the Runtime, the Trainer and telemetry ask of a strategy, with the defaults
of a strategy whose processes each hold a whole replica of the model (Lightning Fabric's ``strategies/strategy.py``
shape). Each implementation overrides only where it differs; every question the code asks about a strategy is a
member here, so no caller compares a strategy's name (tests/test_strategy_protocol.py).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager

from trainscale.runtime import checkpoint_io
from trainscale.runtime.strategies.dcp_checkpoint import load_whole

if TYPE_CHECKING:  # the resolver's value, read by the class methods below
    from trainscale.runtime.connector import RunConfig
    from trainscale.runtime.flags import RuntimeFlags
    from trainscale.runtime.precision import Precision
    from trainscale.runtime.world import World

# What ``no_backward_sync`` returns when there is nothing to skip: one stateless, reentrant instance
# for every micro-batch (no object built per step).
SYNC = contextlib.nullcontext()


def clip_grad_norm(module: Any, max_norm: float, norm_type: float = 2.0) -> Any:
    """``torch.nn.utils.clip_grad_norm_`` over the parameters of ``module`` that have a gradient: the
    ``clip_gradients_norm`` of strategies whose gradients are whole tensors (all-reduced, or one process).
    With DTensor gradients (fsdp) torch reduces the per-shard norms across the mesh itself."""
    import torch

    params = [p for p in module.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)


class Strategy:
    """How a model is replicated or sharded across processes. Subclasses set the class attributes that differ and
    override the methods that differ; the defaults are those of one whole replica per process whose checkpoint is
    one file written by rank zero.

    Args:
        device: the device this rank owns (``torch.device``).
        world: this process's ``World``.
        precision: the run's ``Precision`` (built once, by the Runtime); None for a strategy built on its own
            (e.g. by ``trainscale.plan``), which then runs "32-true".
        lightning: Lightning's keywords of the strategy (``timeout``, ``start_method``, ...), taken only by a strategy
            built without ``device`` and ``world`` for ``Trainer(strategy=...)``, which maps or refuses each
            (``connector.strategy_object_flags``, docs/lightning.md).

    Built with neither ``device`` nor ``world`` (``DDPStrategy(find_unused_parameters=True)``, Lightning's way), a
    strategy only describes one: ``Trainer(strategy=obj)`` and ``Runtime(strategy=obj)`` build their own instance of
    its class, bound to the run's device and world, from its name and :attr:`given_options`, exactly as from
    ``strategy=name, strategy_options={...}``.

    Attributes:
        name: the strategy's flag ("single", "ddp", "fsdp", "dp", "model_parallel", "pp"; "hsdp" and "tp" are
            layouts of "model_parallel").
        sharded_checkpoints: False: a checkpoint is one file written by rank zero; True: a directory of each rank's
            shards (DCP), which may also be written in the background. Both are named ``*.ckpt``, as Lightning's.
        forward_communicates: True when forward runs collectives (fsdp all-gathers parameters), so evaluation must
            call the wrapped module equally often on every rank, and a batch-size trial syncs its ranks.
        materialises_meta: True when ``setup_module`` accepts a model built on the meta device (it shards, then
            allocates and initialises only this rank's shards: ``runtime/meta_init.py``).
        pipelined: True when forward and backward run together in a pipeline schedule: a loop calls
            ``Runtime.forward_backward`` instead of calling the module and then ``backward``; the ranks hold
            different parameters, so the GradScaler agrees on inf/NaN across all of them.
        drives_all_devices: True when one process drives every device of the job (``nn.DataParallel``): the job
            has one process, and MFU divides by ``devices``.
        uses_mesh: True when the ranks are laid out on one named DeviceMesh from the ``parallel`` flag (which,
            with ``tp_plan`` and ``parallelize``, is refused under the other strategies).
        needs_process_group: True when a process group is needed even in a job of one process (DDP refuses to
            run without one; so does a device mesh).
        applies_compile: True when the strategy compiles parts of the model itself (the pipeline's blocks), so the
            Runtime leaves the module it is given uncompiled.
        supports_sync_batchnorm: True when ``sync_batchnorm=True`` is meaningful (replicas whose batch statistics
            ``SyncBatchNorm`` can all-reduce).
        manual_optimization_refusal: None, or what makes manual optimization impossible (a ``training_step`` that
            calls backward itself), for the error message.
        gradient_sync: when a manual optimizer's gradients are synchronised: "step" (averaged in its ``step()``,
            ddp), "backward" (reduce-scattered by FSDP in backward) or "none" (nothing to synchronise).
        given_options: the keyword arguments the strategy was built with.
        model: what :meth:`setup_module` returned for the model the Runtime set up last (``Runtime.setup``: the
            ``DistributedDataParallel`` wrapper under ddp), None before; Lightning's ``strategy.model``.

    Lightning's public strategy surface (``trainer.strategy``): ``root_device``, ``is_global_zero``, ``world_size``,
    ``global_rank``, ``local_rank``, ``model``, ``lightning_module``, ``connect``, and the collectives ``barrier``,
    ``broadcast``, ``reduce``, ``all_gather`` over every rank (``torch.distributed``; each returns its input, or
    does nothing, without a process group, as Lightning's).
    """

    name: ClassVar[str] = ""
    sharded_checkpoints: ClassVar[bool] = False
    forward_communicates: ClassVar[bool] = False
    materialises_meta: ClassVar[bool] = False  # a model on the meta device is refused by Runtime.setup
    pipelined: ClassVar[bool] = False
    drives_all_devices: ClassVar[bool] = False
    uses_mesh: ClassVar[bool] = False
    needs_process_group: ClassVar[bool] = False
    applies_compile: ClassVar[bool] = False
    supports_sync_batchnorm: ClassVar[bool] = False
    manual_optimization_refusal: ClassVar[str | None] = None
    gradient_sync: str = "none"
    model: Any = None
    given_options: dict

    def __new__(cls, *args: Any, **options: Any) -> Any:
        self = super().__new__(cls)
        # the keywords it was built with: one built without ``device`` and ``world`` (Lightning's
        # ``Trainer(strategy=DDPStrategy(find_unused_parameters=True))``) stands for its name and these, from which
        # the Runtime builds its own (connector.strategy_object_flags)
        self.given_options = options
        return self

    def __init__(self, device: Any = None, world: World | None = None, precision: Precision | None = None,
                 **lightning: Any) -> None:
        if lightning and world is not None:  # Lightning's keywords describe a strategy the Runtime will build
            raise TypeError(f"{type(self).__name__}() got unexpected keyword argument(s) {', '.join(lightning)}")
        self.device = device
        self.world = world
        self.precision = precision
        self._lightning_module: Any = None  # connect()

    # -- Lightning's strategy surface (trainer.strategy) ---------------------------------------
    root_device = property(lambda self: self.device, doc="The device this rank computes on (Lightning's name).")
    is_global_zero = property(lambda self: self.world.rank == 0, doc="True on rank 0.")
    world_size = property(lambda self: self.world.world_size, doc="Processes in the job.")
    global_rank = property(lambda self: self.world.rank, doc="This process's rank in the job.")
    local_rank = property(lambda self: self.world.local_rank, doc="This process's rank on its node.")

    @property
    def lightning_module(self) -> Any:
        """The user's module: the one :meth:`connect` was given (the Trainer's fit or evaluation), else the module
        inside :attr:`model`; None before either."""
        if self._lightning_module is not None:
            return self._lightning_module
        return None if self.model is None else self.unwrap(self.model)

    def connect(self, module: Any) -> None:
        """Make ``module`` the :attr:`lightning_module` (Lightning's ``strategy.connect(model)``)."""
        self._lightning_module = module

    def barrier(self, name: str | None = None) -> None:
        """Wait until every rank arrives (``torch.distributed.barrier``; on NCCL on this rank's GPU); without a
        process group, nothing to wait for. ``name`` is Lightning's label, unused."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (picklable) on every rank (``broadcast_object_list``); ``obj`` without a process
        group."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``tensor`` all-reduced over the ranks of ``group`` (None: all), in place, and returned, as Lightning's
        ``_sync_ddp``: ``reduce_op`` "mean" (the default; or "avg": the sum divided by the group's size, in place, on
        any backend, an integer tensor keeping the quotient rounded toward zero), "sum", "max", "min", another
        ``torch.distributed.ReduceOp`` name in any case, or a ``ReduceOp``. Anything but a tensor, and any tensor
        without a process group, comes back unchanged."""
        import torch
        import torch.distributed as dist

        if not isinstance(tensor, torch.Tensor) or not (dist.is_available() and dist.is_initialized()):
            return tensor
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if mean:  # a sum, then the division: gloo has no ReduceOp.AVG
            op = dist.ReduceOp.SUM
        else:
            op = getattr(dist.ReduceOp, reduce_op.upper()) if isinstance(reduce_op, str) else reduce_op
        dist.all_reduce(tensor, op=op, group=group)
        if not mean:
            return tensor
        size = dist.get_world_size(group)
        return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every rank's ``tensor`` (the same shape on each), stacked: shape ``(group size, *tensor.shape)``, over
        ``group`` (None: all ranks); ``tensor`` itself without a process group, as Lightning's. With ``sync_grads``
        the gather is differentiable: each rank's ``tensor`` gets the sum over the ranks of the gradients of its
        slice (torch's functional ``all_gather_single``, whose backward is a reduce-scatter; the successor torch
        names for Lightning's ``torch.distributed.nn.functional.all_gather``)."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return tensor
        from torch.distributed._functional_collectives import all_gather_single, wait_tensor

        with contextlib.nullcontext() if sync_grads else torch.no_grad():
            return wait_tensor(all_gather_single(tensor.unsqueeze(0).contiguous(), 0, group or dist.group.WORLD))

    @property
    def precision_name(self) -> str:
        """The run's precision flag ("32-true" without a ``Precision``)."""
        return self.precision.name if self.precision is not None else "32-true"

    # -- what the resolver and the Runtime ask before a strategy exists ---------------------
    @classmethod
    def check_run(cls, *, accelerator: str, devices: int, num_nodes: int, cuda_count: int, compiled: bool) -> None:
        """Raise ``ValueError`` (naming the fix) when this strategy cannot run the job the flags describe; by
        default it can run any."""

    @classmethod
    def check_options(cls, options: dict, flag: str | None = None) -> None:
        """Raise ``ValueError`` for an option (``strategy_options``) the strategy's constructor does not take,
        listing the ones it takes: checked through the class, so no strategy is built just to check them.
        ``flag``: the strategy flag the user gave ("hsdp" for a layout of "model_parallel"), for the message."""
        valid = [name for name, p in inspect.signature(cls).parameters.items()
                 if name not in ("device", "world", "precision") and p.kind is not p.VAR_KEYWORD]
        unknown = [k for k in options if k not in valid]
        if unknown:
            raise ValueError(f"strategy={flag or cls.name!r} does not accept option(s) {', '.join(map(repr, unknown))}; "
                             f"its options are: {', '.join(valid) or 'none'}")

    @classmethod
    def options_from(cls, options: dict | None, config: RunConfig, flags: RuntimeFlags) -> dict:
        """The constructor's options: the user's ``strategy_options``, with what this strategy takes from the other
        flags (``config`` resolved, ``flags`` as given) added; by default the user's alone."""
        return dict(options or {})

    @classmethod
    def check_async_save(cls) -> None:
        """Raise unless this strategy can write checkpoints in the background (``checkpoint_async=True``).

        Raises:
            ValueError: a strategy whose checkpoints are one file written by rank zero (single, ddp, dp).
        """
        if not cls.sharded_checkpoints:
            from trainscale.runtime.strategies import STRATEGY_CLASSES

            sharded = [name for name, c in STRATEGY_CLASSES.items() if c.sharded_checkpoints]
            raise ValueError(f"checkpoint_async=True writes sharded (DCP) checkpoints in the background, but "
                             f"strategy={cls.name!r} writes one file from rank zero; use a sharded strategy "
                             f"({', '.join(map(repr, sharded))}) or checkpoint_async=False")

    # -- model, optimizer, step ---------------------------------------------------------------
    def setup_module(self, module: Any) -> Any:
        """Move ``module`` to the device and wrap it (DDP, FSDP, ...); return the module to call."""
        return module.to(self.device)

    def setup_optimizer(self, optimizer: Any) -> Any:
        """Adapt an optimizer built on the wrapped module's parameters (identity for most)."""
        return optimizer

    def unwrap(self, module: Any) -> Any:
        """The user's module inside the wrapper."""
        return module

    def no_backward_sync(self, module: Any, enabled: bool) -> ContextManager:
        """Skip the gradient all-reduce in backward while ``enabled`` (gradient accumulation); by default there is
        none to skip."""
        return SYNC

    def clip_gradients_norm(self, module: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        """Scale the gradients of ``module`` so that their total ``norm_type``-norm over all ranks' shards is
        at most ``max_norm``; return that norm before clipping (a 0-d tensor, not synced to the host). By default
        the gradients are whole tensors (:func:`clip_grad_norm`)."""
        return clip_grad_norm(module, max_norm, norm_type)

    def time_allreduce(self, module: Any, clock: Callable[[], Any], record: Callable[[Any, Any], None]) -> bool:
        """Have ``record(start, end)`` called with ``clock()`` readings around each gradient all-reduce of
        ``module`` (the wrapped module; call once, before the first backward). Returns False when nothing
        will be timed (no all-reduce of its own, the default, or a communication hook registered outside
        trainscale)."""
        return False

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, path: Any, state: dict, async_group: Any = None) -> Any:
        """Write ``state`` (modules, optimizers, plain values) to ``path`` without corrupting it; by default one
        file from rank zero (``checkpoint_io.save_replicated``). With ``async_group`` (a gloo process group of all
        ranks; sharded strategies only, the others raise :meth:`check_async_save`'s error) return once the state
        is staged and let a thread write it: returns the ``dcp_checkpoint.AsyncSave`` whose ``wait()`` publishes
        it (otherwise None)."""
        if async_group is not None:
            self.check_async_save()  # one file from rank zero: never in the background
        checkpoint_io.save_replicated(path, state, self.world, self.unwrap)

    def load_checkpoint(self, path: Any, state: dict, verify: bool = True,
                        before_restore: Callable[[dict], None] | None = None, strict: bool = True) -> dict:
        """Restore objects of ``state`` in place from ``path``; return the entries not in ``state``. By default a
        file, or a DCP directory of any mesh read into whole tensors (``dcp_checkpoint.load_whole``).
        ``verify``: check the recorded SHA-256 and refuse a checkpoint without one (``checkpoint_io.load_file``).
        ``before_restore(entries)``: called once with the entries as read, before anything is restored from them
        (a file: every entry, the weights as a state dict; a DCP directory: the plain entries, its tensors are
        read in place after it); it may change them, or raise to refuse the checkpoint with nothing changed.
        ``strict``: as a module's ``load_state_dict(strict=...)``, for the modules of ``state``."""
        return load_whole(path, state, self.world.rank, self.name, self.unwrap, verify, before_restore=before_restore,
                          strict=strict)

    def data_world(self, world: World) -> World:
        """The rank and world size (a ``World``) the data loader's sampler must use: ``world`` itself when
        every rank reads different data (the default); the data-parallel ranks when some share their batches
        (tensor parallelism, pipeline stages)."""
        return world

    def teardown(self) -> None:
        """Release what the strategy holds (nothing by default)."""


class ParallelStrategy(Strategy):
    """The base of the strategies that run one process per device (ddp, fsdp, model_parallel, pp): Lightning's
    ``ParallelStrategy``, for ``isinstance(trainer.strategy, ParallelStrategy)``, with its counts; it adds no
    behaviour (each strategy's own is in its file)."""

    num_nodes = property(lambda self: self.world.num_nodes, doc="Machines in the job (Lightning's name).")
    num_processes = property(lambda self: self.world.local_world_size,
                             doc="Processes on this node (Lightning's name).")
