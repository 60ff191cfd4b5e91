"""DistributedDataParallel: one process per device, a full replica each, gradients all-reduced.

DDP overlaps the bucketed gradient all-reduce with backward (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB;
https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html).
The process group is created by the Runtime before this strategy wraps anything.
"""

from __future__ import annotations

from typing import Any, Callable

from trainscale.runtime.strategies.base import SYNC, ParallelStrategy
from trainscale.runtime.strategies.dcp_checkpoint import load_whole
from trainscale.runtime.strategies.node_read import NodeReader
from trainscale.runtime.world import World


# Lightning's names of ddp with ``find_unused_parameters`` set (its ``DDPStrategy.register_strategies``): each name
# → (the ddp name it extends, the option's value). The resolver maps a name to that ddp name (its start method:
# connector.START_METHOD_NAMES); :meth:`DDPStrategy.options_from` sets the option.
FIND_UNUSED_NAMES = {f"{name}_find_unused_parameters_{str(value).lower()}": (name, value)
                     for name in ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook") for value in (False, True)}


class DDPStrategy(ParallelStrategy):
    """Wrap the module in ``DistributedDataParallel``.

    Args:
        device, world, precision, lightning: as for :class:`~trainscale.runtime.strategies.base.Strategy`
            (``Trainer(strategy=DDPStrategy(find_unused_parameters=True))`` takes Lightning's ``timeout``,
            ``start_method`` and ``process_group_backend`` too: docs/strategies.md).
        find_unused_parameters: set when some parameters get no gradient in a step (slower).
        static_graph: set when the graph is the same every step (enables DDP optimizations).
        gradient_as_bucket_view: gradients alias the all-reduce buckets (saves one copy of the grads).
        bucket_cap_mb: all-reduce bucket size in MiB (DDP's default 25).
        ddp_comm_hook: a DDP communication hook ``hook(state, bucket) -> Future`` (e.g.
            ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``),
            registered with ``DistributedDataParallel.register_comm_hook`` (Lightning's option name).
        ddp_comm_state: the hook's ``state`` (None: the default process group).
    """

    name = "ddp"
    needs_process_group = True  # DDP refuses to run without a process group, even in one process (one GPU)
    supports_sync_batchnorm = True
    gradient_sync = "step"  # a manual optimizer averages the gradients in its step()

    def __init__(self, device: Any = None, world: World | None = None, precision: Any = None,
                 find_unused_parameters: bool = False, static_graph: bool = False,
                 gradient_as_bucket_view: bool = False, bucket_cap_mb: float | None = None, ddp_comm_hook: Any = None,
                 ddp_comm_state: Any = None, **lightning: Any) -> None:
        super().__init__(device, world, precision, **lightning)
        self.comm_hook, self.comm_state = ddp_comm_hook, ddp_comm_state
        self._node_reader = NodeReader(world)  # a checkpoint file is read once per node
        self._timing: tuple[Callable, Callable] | None = None  # (clock, record) once telemetry asks
        self.ddp_kwargs = dict(find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                               gradient_as_bucket_view=gradient_as_bucket_view)
        if bucket_cap_mb is not None:
            self.ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb

    @classmethod
    def options_from(cls, options, config, flags) -> dict:
        """The user's ``strategy_options``, with ``find_unused_parameters`` from a name of :data:`FIND_UNUSED_NAMES`
        (``strategy="ddp_find_unused_parameters_true"``).

        Raises:
            ValueError: ``strategy_options`` give ``find_unused_parameters`` another value than the name does."""
        options = dict(options or {})
        spelled = FIND_UNUSED_NAMES.get(flags.strategy)
        if spelled is not None and options.setdefault("find_unused_parameters", spelled[1]) != spelled[1]:
            raise ValueError(f"strategy={flags.strategy!r} sets find_unused_parameters={spelled[1]}, but "
                             f"strategy_options={{'find_unused_parameters': {options['find_unused_parameters']!r}}}; "
                             "drop one of the two")
        return options

    def setup_module(self, module):
        from torch.nn.parallel import DistributedDataParallel

        module = module.to(self.device)
        # On CPU, DDP takes no device_ids (FACTS: "Pass no device_ids to DDP on CPU").
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        if self.comm_hook is not None:  # DDP takes one hook: ours calls the user's and can time it
            wrapped.register_comm_hook(self.comm_state, self._call_user_hook)
        return wrapped

    def _call_user_hook(self, state, bucket):
        if self._timing is None:
            return self.comm_hook(state, bucket)
        return _timed(self.comm_hook, state, bucket, *self._timing)

    def unwrap(self, module):
        from torch.nn.parallel import DistributedDataParallel

        return module.module if isinstance(module, DistributedDataParallel) else module

    def no_backward_sync(self, module, enabled: bool):
        """``DistributedDataParallel.no_sync``: gradients accumulate locally, no all-reduce."""
        if not enabled:
            return SYNC
        if not hasattr(module, "no_sync"):
            raise TypeError("no_backward_sync needs the module returned by Runtime.setup (a DDP wrapper)")
        return module.no_sync()

    def time_allreduce(self, module, clock: Callable[[], Any], record: Callable[[Any, Any], None]) -> bool:
        """Time each bucket's gradient all-reduce (telemetry calls it at world size > 1).

        Without ``ddp_comm_hook``, registers a DDP communication hook that does exactly DDP's default
        all-reduce (PyTorch's ``default_hooks.allreduce_hook``: divide by the world size, then
        all-reduce SUM); with one, times the user's hook. ``record(start, end)`` gets ``clock()`` read
        when DDP hands the bucket over (its gradients are ready; DDP hands buckets over in order, so the
        last hand-over is the end of gradient computation) and when the hook's future completes (in a
        ``Future.then`` callback, so the wait for slower ranks is included). Buckets overlap each other
        and backward: ``trainscale.telemetry.overlap`` turns a step's readings into communication and
        exposed time. Call once, before the first backward.
        https://pytorch.org/docs/stable/ddp_comm_hooks.html

        Returns:
            False when a hook was registered on ``module`` outside trainscale (DDP takes only one):
            the all-reduce is then not timed.
        """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if self.comm_hook is not None:
            self._timing = (clock, record)
            return True
        try:
            module.register_comm_hook(None, lambda state, bucket: _timed(allreduce_hook, state, bucket, clock, record))
        except RuntimeError:  # "register_comm_hook ... can only be called once"
            return False
        return True

    def load_checkpoint(self, path, state: dict, verify: bool = True, before_restore=None, strict: bool = True) -> dict:
        """A checkpoint file is read once per node and shared with the node's ranks (``node_read``); a DCP
        directory is read by every rank, its shards into whole tensors. ``before_restore``, ``strict``: as
        ``Strategy``'s."""
        return load_whole(path, state, self.world.rank, self.name, self.unwrap, verify, self._node_reader.read,
                          before_restore, strict)


def _timed(hook: Callable, state: Any, bucket: Any, clock: Callable, record: Callable):
    """Run a DDP comm hook and ``record(start, end)`` when its future completes."""
    start = clock()

    def done(fut):
        record(start, clock())
        return fut.value()

    return hook(state, bucket).then(done)
