"""Runtime: the low-level API for people who keep their own training loop.

    rt = Runtime(devices=2)                       # relaunches the script under torchrun if needed
    model, optimizer = rt.setup(model, lambda p: torch.optim.AdamW(p, lr=1e-3))
    loader = rt.setup_dataloader(loader)          # DistributedSampler injected
    for epoch in range(epochs):
        rt.set_epoch(loader, epoch)
        for i, batch in enumerate(loader):
            x, y = rt.to_device(batch)
            boundary = (i + 1) % accumulate == 0
            with rt.no_backward_sync(model, enabled=not boundary):
                with rt.autocast():
                    loss = loss_fn(model(x), y)
                rt.backward(loss / accumulate)
            if boundary:
                rt.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
    rt.save("ckpt.pt", {"model": model, "optimizer": optimizer, "epoch": epoch})

Run it with ``python script.py`` (devices=N relaunches it under torchrun) or
``trainscale run -n 2 script.py``. The same code runs at world size 1.
"""

from __future__ import annotations

import atexit
import os
import sys
from datetime import timedelta
from typing import Any, Callable, Iterable, Literal

import torch
import torch.distributed as dist

from trainscale.runtime import devices as _devices
from trainscale.runtime import hangs, launch, rendezvous
from trainscale.runtime.apply import prepare_module
from trainscale.runtime.batch import to_device
from trainscale.runtime.connector import RunConfig, resolve, strategy_object_flags
from trainscale.runtime.flags import (AcceleratorFlag, MatmulPrecisionFlag, PipelineScheduleFlag, PrecisionFlag,
                                      RuntimeFlags, StrategyFlag, names_closest_flag)
from trainscale.runtime.meta_init import on_meta
from trainscale.runtime.precision import Precision, float32_matmul_note, tf32_enabled
from trainscale.runtime.strategies import Strategy, create_strategy
from trainscale.runtime.world import World, launcher_variables
from trainscale.utilities.rank_zero import rank_zero_only

_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _match_launcher(world: World, config: RunConfig, follows_launcher: bool) -> World:
    """The world of this process once the flags are resolved: a per-node launch's ranks (``World.per_node``)
    take ``config.devices``; flags given explicitly must describe the launcher's job.

    Raises:
        ValueError: the flags and the launcher's job disagree, naming the flags to pass.
    """
    if world.per_node is not None:  # a pod's process: the node's ranks now that devices are known
        world = world.node_ranks(config.devices, cpu=config.accelerator == "cpu")
    if follows_launcher or world.launcher == "none":
        return world
    if world.launcher == "slurm":  # the allocation must match devices × num_nodes
        from trainscale.runtime.slurm import check_allocation

        check_allocation(world.world_size, world.local_world_size, world.num_nodes, config.devices, config.num_nodes)
    if world.world_size != config.world_size:
        raise ValueError(f"the launcher's job is {world.num_nodes} node(s) × {world.local_world_size} process(es) = "
                         f"{world.world_size} but devices×num_nodes={config.devices}×{config.num_nodes}="
                         f"{config.world_size}; pass devices={world.local_world_size}, num_nodes={world.num_nodes} "
                         f"(or leave num_nodes out and devices='auto') [launcher: {world.launcher}; variables seen: "
                         f"{launcher_variables(os.environ)}]")
    return world


class Runtime:
    """Devices, processes, strategy and precision for a hand-written loop.

    ``runtime.flags`` holds the flags as given (a :class:`~trainscale.runtime.flags.RuntimeFlags`),
    ``runtime.config`` resolved (a :class:`~trainscale.runtime.connector.RunConfig`); ``runtime.world`` is the
    process world (a frozen :class:`~trainscale.runtime.world.World`), ``runtime.world_size`` and ``runtime.rank`` its.
    """

    @names_closest_flag
    def __init__(self, accelerator: AcceleratorFlag = "auto", devices: int | Literal["auto"] = "auto",
                 strategy: StrategyFlag | Strategy = "auto", num_nodes: int | None = None,
                 precision: PrecisionFlag = "32-true", *,
                 timeout: float = 1800.0, strategy_options: dict | None = None, sync_batchnorm: bool = False,
                 activation_checkpointing: Any = None, compile: bool | dict = False,
                 float32_matmul_precision: MatmulPrecisionFlag | None = None, parallel: dict | None = None,
                 tp_plan: dict | None = None, parallelize: Callable | None = None,
                 pp_schedule: PipelineScheduleFlag | None = None, pp_microbatches: int | None = None,
                 pp_split_points: list | None = None) -> None:
        """The flags, each a field of :class:`~trainscale.runtime.flags.RuntimeFlags` with this type, default
        and description (tests/test_trainer_config.py keeps them equal).

        Args:
            accelerator: "auto", "cpu", "cuda" ("gpu") or "mps".
            devices: processes (CPU) or GPUs per node, or "auto" (all GPUs; under a launcher, the launcher's
                processes per node; else 1).
            strategy: "auto", "single", "ddp", "fsdp", "dp", "model_parallel", "hsdp", "tp", "pp"
                (docs/strategies.md), or "ddp_spawn"/"ddp_notebook"/"ddp_fork": ddp with the processes started from
                this one by spawn/fork/fork; Lightning's "ddp_find_unused_parameters_true"/"_false" (also after
                "ddp_spawn", "ddp_fork", "ddp_notebook"): that ddp with ``find_unused_parameters`` True/False. In
                Python also a strategy object built with options only, Lightning's way
                (``trainscale.strategies.DDPStrategy(find_unused_parameters=True)``): its name and those options.
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
            float32_matmul_precision: None (leave PyTorch's setting), or "highest", "high" (TF32 on Ampere and
                newer) or "medium", applied with ``torch.set_float32_matmul_precision``.
            parallel: the device mesh under "model_parallel" (required), "hsdp", "tp" or "pp":
                ``{"pp": P, "dp_replicate": R, "dp_shard": S, "tp": T}``, P·R·S·T = world size.
            tp_plan: ``{submodule name: ColwiseParallel() | RowwiseParallel() | ...}`` for your model; default:
                the built-in plan of ``trainscale.models.GPT``.
            parallelize: ``fn(model, mesh) -> model`` applying your own tensor parallelism instead.
            pp_schedule: "gpipe" or "1f1b" (default) under pipeline stages.
            pp_microbatches: micro-batches each batch is cut into (default 4·P).
            pp_split_points: the submodule names where stages 2..P begin (default: the built-in split of
                ``trainscale.models.GPT``).

        Raises:
            TypeError: a misspelt flag (naming the closest one; type checkers refuse it too).
            ValueError: bad or conflicting flags (raised on every rank, before any process group exists).
        """
        # a strategy object (Lightning's DDPStrategy(...)) stands for a name and options: the flags from here on
        self.flags, backend = strategy_object_flags(RuntimeFlags(
            accelerator, devices, strategy, num_nodes, precision, timeout=timeout, strategy_options=strategy_options,
            sync_batchnorm=sync_batchnorm, activation_checkpointing=activation_checkpointing, compile=compile,
            float32_matmul_precision=float32_matmul_precision, parallel=parallel, tp_plan=tp_plan,
            parallelize=parallelize, pp_schedule=pp_schedule, pp_microbatches=pp_microbatches,
            pp_split_points=pp_split_points))
        f = self.flags
        devices, num_nodes = f.devices, f.num_nodes
        world = World.from_env()
        follows_launcher = devices == "auto" and world.launcher != "none"  # nodes may differ in processes
        if follows_launcher:  # a pod that left its process count to the job: "auto" devices, the launcher's nodes
            devices = "auto" if world.per_node == "auto" else world.local_world_size
        if num_nodes is None:  # not given: the launcher's nodes (the same script runs under any launcher)
            num_nodes = world.num_nodes if world.launcher != "none" else 1
        visible = _devices.cuda_device_count()
        self.config: RunConfig = resolve(cuda_count=_devices.node_cuda_count(visible, world.local_world_size,
                                                                             world.launcher),
                                         has_mps=_devices.mps_available(),
                                         **{**vars(f), "devices": devices, "num_nodes": num_nodes})
        self.world = world = _match_launcher(world, self.config, follows_launcher)
        self.world_size, self.rank = world.world_size, world.rank  # of the frozen World, read at every step
        if isinstance(f.timeout, bool) or not isinstance(f.timeout, (int, float)) or not 0 < f.timeout < 1e9:
            raise ValueError(f"timeout={f.timeout!r} must be a positive, finite number of seconds (e.g. 1800)")
        if f.strategy_options is not None and not isinstance(f.strategy_options, dict):
            raise ValueError(f"strategy_options={f.strategy_options!r} must be a dict of the strategy's keyword "
                             "options (e.g. {'find_unused_parameters': True}) or None")
        self.timeout = f.timeout
        strategy_class = self.config.strategy_class
        self.strategy_options = strategy_class.options_from(f.strategy_options, self.config, f)
        if backend is not None and backend != self._backend:  # Lightning's process_group_backend: not ours to choose
            raise ValueError(f"process_group_backend={backend!r}, but with accelerator={self.config.accelerator!r} "
                             f"the backend is {self._backend!r} (trainscale's follows the accelerator: nccl on CUDA, "
                             "gloo on CPU); drop process_group_backend, or change the accelerator")
        cuda = self.config.accelerator == "cuda"
        self.device = _devices.device_for(self.config.accelerator, _devices.cuda_index(
            world.local_rank, world.local_world_size, visible, world.launcher) if cuda else world.local_rank)
        # built once per run and handed to the strategy; pipeline stages hold different parameters: their
        # GradScaler agrees on inf/NaN across all ranks
        self.precision = Precision(self.config.precision, self.device.type, across_ranks=strategy_class.pipelined)
        self._set_matmul_precision()
        self._non_blocking = self.device.type == "cuda"  # to_device's copies: asynchronous from pinned memory
        self.strategy = None
        self.monitor_group = None
        self._checkpoint_group = None  # the gloo group of background checkpoint writes (Runtime.save)
        self._pending_save = None
        self._launched = False
        if self.spawns:  # the job runs in children; check the strategy's options here, before spawning
            strategy_class.check_options(self.strategy_options, self.config.strategy)

    def _set_matmul_precision(self) -> None:
        """Apply ``float32_matmul_precision``, or say once what "32-true" leaves on the table (Lightning's note).

        In the parent of a "ddp_spawn"/"ddp_notebook" job nothing is asked of the GPU: rank 0's child says the
        note, and ``get_device_capability`` would initialise CUDA here, which a fork ("ddp_notebook") cannot
        survive (``trainscale.runtime.spawn`` refuses to fork then)."""
        if self.config.float32_matmul_precision is not None:
            torch.set_float32_matmul_precision(self.config.float32_matmul_precision)
            return
        if self.spawns or self.device.type != "cuda" or self.config.precision != "32-true":
            return
        note = float32_matmul_note(self.config.precision, self.device.type,
                                   torch.cuda.get_device_capability(self.device), tf32_enabled()[0])
        if note is not None:
            self.print(note)

    @property
    def spawns(self) -> bool:
        """True in the parent process of a "ddp_spawn"/"ddp_notebook" job: the ranks will be child processes
        started from this one (``self.config.start_method``: "spawn" or "fork"), not this process."""
        return (self.config.start_method is not None and self.world.launcher == "none"
                and self.config.world_size > 1)

    # -- processes ---------------------------------------------------------------------------
    def launch(self, function: Callable | None = None, *args: Any, **kwargs: Any) -> Any:
        """Make sure this process is one rank of a started job; idempotent.

        Outside a launcher with world size > 1, the running script is re-executed under
        torchrun (this call then never returns in the original process). Under a launcher, the
        process group is created with the backend of the accelerator (nccl/gloo).

        With ``function``: run ``function(runtime, *args, **kwargs)`` on every rank and return its value.
        Under "ddp_spawn"/"ddp_notebook" (notebooks, functions) the ranks are child processes started
        from this one by ``trainscale.runtime.spawn`` (spawn: ``function`` and ``args`` pickled with
        cloudpickle; fork: inherited), each with its own Runtime built from this one's flags; rank 0's
        return value comes back here.

        Raises:
            RuntimeError: "ddp_spawn"/"ddp_notebook" in the parent process without ``function``; under
                "ddp_notebook", CUDA initialised before the fork; a child that died while starting.
            ValueError: ``function`` or ``args`` cannot be pickled (under "ddp_spawn").
        """
        if function is not None:
            if self.spawns:
                from trainscale.runtime import spawn

                return spawn.run(_run_spawned, {"runtime_flags": dict(vars(self.flags)), "function": function,
                                                "args": args, "kwargs": kwargs},
                                 self.config.world_size, self.config.start_method)
            self.launch()
            return function(self, *args, **kwargs)
        if self._launched:
            return self
        if self.spawns:
            raise RuntimeError(f"strategy={self.flags.strategy!r} runs the job in child processes started "
                               "from this one: put the training code in a function fn(runtime, ...) and call "
                               "runtime.launch(fn, ...), or use Trainer.fit")
        if self.world.per_node is not None:  # a pod's process starts the pod's ranks (does not return)
            launch.start_node_ranks(self.world)
        if self.config.world_size > 1 and self.world.launcher == "none":
            launch.relaunch_current_script(self.config.devices, self.config.num_nodes)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._start_process_groups()
        rank_zero_only.rank = self.world.rank  # this process's rank in the job it joined, as Lightning's strategies set it
        self.strategy = create_strategy(self.config.strategy, device=self.device, world=self.world,
                                        precision=self.precision, **self.strategy_options)
        self._launched = True
        return self

    def _start_process_groups(self) -> None:
        """The default process group, unless one exists, and the gloo monitor group where it serves
        (:func:`trainscale.runtime.hangs.wants_monitor_group`)."""
        # ddp on one process (e.g. one GPU) still needs a process group: DDP refuses to run without one; so does
        # model_parallel's device mesh (init_device_mesh would start one from env://, unset outside a launcher).
        needs_group = self.world.world_size > 1 or self.config.strategy_class.needs_process_group
        if needs_group and not dist.is_initialized():
            self._init_process_group()
        if (self.monitor_group is None and dist.is_initialized()
                and hangs.wants_monitor_group(str(dist.get_backend()), self.world.world_size)):
            self.monitor_group = hangs.new_monitor_group()

    def _init_process_group(self) -> None:
        """``init_process_group`` with the accelerator's backend and ``timeout``. Before an NCCL group,
        PyTorch's own timeout diagnosis (flight recorder, dump on timeout) is switched on where the
        user has not chosen otherwise (:func:`trainscale.runtime.hangs.nccl_debug_env`)."""
        backend = self._backend
        if "nccl" in backend:
            os.environ.update(hangs.nccl_debug_env(os.environ))
        # torchrun exports MASTER_ADDR/PORT (env://: its workers may share the agent's store); the other
        # launchers' address is the World's (srun, MPI and jsrun export none); a lone process without a
        # launcher takes a free local port.
        world, init_method, store = self.world, None, None
        if world.launcher == "ray":  # Ray Train makes the process group before the train function runs
            raise RuntimeError(f"Ray's variables are set ({world.detected_from}) but no process group exists: Ray "
                               "Train creates it before train_loop_per_worker runs; start this code from a "
                               "TorchTrainer's train_loop_per_worker, or unset RANK/WORLD_SIZE to run it alone")
        if world.launcher == "none":
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        elif world.launcher not in ("torchrun", "env") and world.world_size > 1:
            # srun, mpirun, jsrun and pods start every rank themselves: meet on rank zero's store first, so that a
            # missing rank is named while the others wait instead of silence until `timeout`
            if world.local_rank == 0:
                print(f"trainscale: rank {world.rank} of {world.world_size} ({world.launcher}: "
                      f"{world.detected_from}) waiting at the rendezvous {world.master_addr}:{world.master_port} for "
                      f"the other processes (timeout {self.timeout:.0f} s)", file=sys.stderr, flush=True)
            store = rendezvous.join(world, self.timeout, lambda line: print(line, file=sys.stderr, flush=True))
        elif world.launcher not in ("torchrun", "env"):
            init_method = f"tcp://{world.master_addr}:{world.master_port}"
        # On CUDA the group is bound to this rank's GPU (`device_id`): NCCL connects at once, and every device mesh
        # then splits its sub-groups from it, one `split_group` per mesh dimension, where an unbound group makes each
        # rank call `new_group` for every sub-group of the mesh (O(world size); torch's DeviceMesh._init_process_groups)
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=self.timeout), init_method=init_method,
                                store=store, rank=world.rank, world_size=world.world_size,
                                device_id=self.device if self.device.type == "cuda" else None)
        atexit.register(_destroy_process_group)

    @property
    def _backend(self) -> str:
        """The process group's backend: the accelerator's ("nccl" on CUDA, "gloo" on CPU), with gloo beside nccl for
        fsdp's ``cpu_offload`` (its CPU gradients)."""
        offload = self.strategy_options.get("cpu_offload") is True
        return _devices.backend_for(self.config.accelerator, cpu_collectives=offload)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different data: the world size, or under tensor parallelism ``dp_replicate ·
        dp_shard`` (the ``tp`` ranks of a group read the same batches). The global batch and throughput
        count samples over these ranks only."""
        return self.config.parallel.dp_size if self.config.parallel is not None else self.world_size

    @property
    def is_rank_zero(self) -> bool:
        return self.world.rank == 0

    # -- model, optimizer, data --------------------------------------------------------------
    def setup(self, module: torch.nn.Module, optimizer: Any = None) -> tuple[torch.nn.Module, Any]:
        """Move and wrap ``module`` for the strategy; build or adapt the optimizer.

        Args:
            module: a plain ``nn.Module``. Precision cast, SyncBatchNorm, activation checkpointing and
                compile are applied to it in that order, then the strategy wraps it
                (``trainscale.runtime.apply``). Under "fsdp" it may be built on the meta device
                (``with torch.device("meta"): model = GPT(...)``): each rank then allocates and
                initialises only its shards (``trainscale.runtime.meta_init``).
            optimizer: ``None``, an optimizer already built on ``module.parameters()`` (fine for
                single/ddp), or a factory ``params -> Optimizer`` (required by sharded strategies,
                which must build the optimizer after wrapping).

        Returns:
            ``(wrapped_module, optimizer_or_None)``.

        Raises:
            TypeError: ``module`` is no ``nn.Module``; ``optimizer`` is neither an optimizer nor a factory.
            ValueError: a meta-device model under a strategy that cannot materialise it, or one
                that could not be initialised.
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"setup takes the model as a torch.nn.Module, got {type(module).__name__}; pass the "
                            "model itself, e.g. rt.setup(model, optimizer)")
        self.launch()
        c = self.config
        if not self.strategy.materialises_meta and on_meta(module):
            raise ValueError(f"the model is on the meta device (no memory), which strategy={c.strategy!r} cannot "
                             "materialise; use strategy='fsdp' or 'model_parallel' (they shard, then initialise each rank's "
                             "shards with init_weights()/reset_parameters()), or build the model on a real device")
        module = prepare_module(module, precision=self.precision, sync_batchnorm=c.sync_batchnorm,
                                activation_checkpointing=c.activation_checkpointing,
                                compile=None if self.strategy.applies_compile else c.compile)  # pp: its blocks
        wrapped = self.strategy.model = self.strategy.setup_module(module)  # Lightning's strategy.model
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer or a factory params -> Optimizer, "
                                f"got {type(optimizer).__name__}")
            optimizer = optimizer(wrapped.parameters())
        if optimizer is not None:
            optimizer = self.strategy.setup_optimizer(optimizer)
        return wrapped, optimizer

    def dataloader_kwargs(self) -> dict[str, Any]:
        """Recommended ``DataLoader`` arguments for this rank when samples need CPU work (decoding,
        augmentation): ``DataLoader(dataset, batch_size=64, **rt.dataloader_kwargs())``.

        ``num_workers``: this process's share of the CPUs it may run on (``os.sched_getaffinity``),
        ``cpus // local_world_size``, minus one for the training process itself (0 when that leaves
        none); ``persistent_workers``: True with workers (they survive between epochs instead of
        being restarted); ``pin_memory``: True on CUDA (asynchronous host-to-device copies). For data
        already held in memory as tensors 0 workers is faster (worker processes add copies between
        processes), so trainscale never changes a loader's workers itself (docs/performance.md).
        https://pytorch.org/docs/stable/data.html#multi-process-data-loading
        """
        self.launch()
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = max(0, cpus // max(1, self.world.local_world_size) - 1)
        return {"num_workers": workers, "persistent_workers": workers > 0, "pin_memory": self.device.type == "cuda"}

    def setup_dataloader(self, loader: torch.utils.data.DataLoader, *, shuffle: bool | None = None,
                         seed: int = 0, even: bool = True,
                         pin_memory: bool | None = None) -> torch.utils.data.DataLoader:
        """Return ``loader`` rebuilt with a sampler that gives this rank its share of the data (under
        model parallelism, its data-parallel group's share: the ``tp`` ranks of a group read the same batches).

        Args:
            loader: a DataLoader built with ``batch_size`` (per device) and a sequential or random sampler; or over
                an ``IterableDataset``, which every rank then reads whole, rank r keeping batches r, r + W, ...
                (``iterable_shard``; training drops each epoch's last round of fewer than W), unless the data set
                sets ``shards_by_rank = True`` (it yields only its rank's share itself).
            shuffle: shuffle each epoch; default: whether ``loader`` shuffled.
            seed: shuffling seed, the same on every rank; epoch ``e`` uses ``seed + e``.
            even: True (training): ``DistributedSampler`` pads by repeating samples so every rank
                runs the same number of steps. False (evaluation): no padding, each sample on one
                rank only, ranks may differ by one sample.
            pin_memory: batches in page-locked host memory, so that ``to_device``'s ``non_blocking``
                copy to a CUDA device is asynchronous (https://pytorch.org/docs/stable/data.html#memory-pinning).
                None: on for CUDA, else ``loader``'s own setting. A loader that needs no new sampler (one with
                a distributed sampler, an ``IterableDataset`` at world size 1 or with ``shards_by_rank``) is
                returned as given unless it must be pinned: then a pinning copy of it
                (``sampling.with_pinned_memory``; never for a DataLoader subclass); ``loader`` is never changed.

        Raises:
            ValueError: under world size > 1, a loader with a custom ``batch_sampler`` or sampler, or (``even=True``)
                whose ranks have
                different numbers of batches (``sampling.check_equal_lengths``; on every rank).
        """
        from trainscale.runtime.sampling import check_equal_lengths, distribute_dataloader, with_pinned_memory

        self.launch()
        world = self.strategy.data_world(self.world)  # tensor-parallel ranks share their batches
        out = distribute_dataloader(loader, world, shuffle=shuffle, seed=seed, even=even)
        if even:  # training: ranks with different numbers of steps would mismatch collectives mid-epoch
            check_equal_lengths(out, self.world, self.device)
        if pin_memory is None:
            pin_memory = loader.pin_memory or self.device.type == "cuda"
        if out is not loader:  # ours to configure; the iterator reads it when an epoch starts
            out.pin_memory = pin_memory
        elif pin_memory:  # the user's loader as given: a copy that pins, the user's object left alone
            out = with_pinned_memory(loader)
        return out

    @staticmethod
    def set_epoch(loader: torch.utils.data.DataLoader, epoch: int) -> None:
        """Reshuffle for ``epoch``: ``set_epoch(epoch)`` on the loader's sampler and its batch sampler's sampler where
        they have one (``sampling.set_sampler_epoch``)."""
        from trainscale.runtime.sampling import set_sampler_epoch

        set_sampler_epoch(loader, epoch)

    def to_device(self, batch: Any) -> Any:
        """Move the tensors of a nested batch to this rank's device (and dtype for "bf16-true", "64-true")."""
        batch = to_device(batch, self.device, self._non_blocking)
        return self.precision.convert_input(batch) if self.precision.casts_input else batch

    def prefetch(self, batches: Iterable) -> Iterable:
        """On CUDA: ``batches`` moved to the device by :meth:`to_device`, each batch's copy issued on a
        side stream while the previous batch trains (``trainscale.runtime.prefetch``); calling
        :meth:`to_device` on what it yields again is then a no-op. On other devices ``batches`` itself,
        unchanged (nothing to overlap; no generator frame per batch).

        ``for batch in rt.prefetch(loader): batch = rt.to_device(batch); ...``
        """
        if self.device.type != "cuda":
            return batches
        from trainscale.runtime.prefetch import prefetch_to_cuda

        return prefetch_to_cuda(batches, self.to_device, self.device)

    def init_module(self):
        """Context manager to build the model in: under "64-true" float64 is the default dtype, so its parameters
        are made in float64 (as Fabric's ``init_module``); under the other precisions nothing changes.
        ``with rt.init_module(): model = Net()``; ``setup`` casts the model in any case."""
        return self.precision.module_init_context()

    # -- the step ----------------------------------------------------------------------------
    def autocast(self):
        """Context manager for forward and loss under the precision's autocast (under "64-true": float64 as the
        default dtype)."""
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled under "16-mixed"."""
        self.precision.backward(loss)

    def forward_backward(self, module: torch.nn.Module, batch: Any, loss_fn: Callable, loss_divisor: int = 1,
                         sync: bool = True) -> torch.Tensor:
        """Under pipeline stages (``strategy.pipelined``: "pp") the step's forward and backward in one
        schedule step, where a plain loop calls ``module(x)``, ``loss_fn`` and :meth:`backward`:

            loss = rt.forward_backward(model, (x, y), loss_fn)   # then clip_gradients, step, zero_grad

        Args:
            module: what :meth:`setup` returned; batch: ``(inputs, targets)`` on the device, the same
                batch on every stage (:meth:`setup_dataloader` sees to it).
            loss_fn: ``loss_fn(outputs, targets)``, a mean over the samples, called on the last stage
                for each micro-batch.
            loss_divisor: the gradients are those of the loss divided by it (gradient accumulation).
            sync: False before the last micro-batch of an accumulated step (weights shared by two
                stages get their gradients summed only on the last).

        Returns:
            The batch's mean loss (0-d, detached, not divided; under "16-mixed" scaled inside the schedule
            step, returned unscaled), the same on every rank.

        Raises:
            RuntimeError: the strategy is not pipelined (call the module, then :meth:`backward`).
        """
        if not self.strategy.pipelined:
            raise RuntimeError(f"forward_backward runs a pipeline schedule, but strategy={self.config.strategy!r}; "
                               "call the module and then runtime.backward(loss)")
        return module.forward_backward(batch, loss_fn, loss_divisor, sync, scale=self.precision.scale)

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool = True):
        """Context manager: while ``enabled``, backward skips the gradient all-reduce
        (accumulate locally; sync on the boundary micro-batch). A no-op at world size 1."""
        return self.strategy.no_backward_sync(module, enabled)

    def clip_gradients(self, module: torch.nn.Module, optimizer: Any, max_norm: float | None = None,
                       clip_val: float | None = None, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip gradients by total norm (``max_norm``) or by value (``clip_val``), after unscaling.

        Under "16-mixed" the gradients are unscaled first (once per step, however often this is called).
        Under ddp the gradients are already all-reduced, so the norm is the global one.

        Returns:
            The total gradient norm before clipping (a 0-d tensor, not synced to the host), or None
            when clipping by value. Method: ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``.

        Raises:
            ValueError: both or neither of ``max_norm``/``clip_val``, or a value <= 0.
        """
        if (max_norm is None) == (clip_val is None):
            raise ValueError("pass exactly one of max_norm or clip_val")
        if not (max_norm if max_norm is not None else clip_val) > 0:
            raise ValueError(f"max_norm={max_norm!r} / clip_val={clip_val!r} must be > 0")
        self.precision.unscale_gradients(optimizer)
        if max_norm is not None:  # the strategy's: sharded (DTensor) gradients under fsdp
            return self.strategy.clip_gradients_norm(module, max_norm, norm_type)
        torch.nn.utils.clip_grad_value_([p for p in module.parameters() if p.grad is not None], clip_val)
        return None

    def step(self, optimizer: Any) -> None:
        """``optimizer.step()`` through the precision (GradScaler step and update under "16-mixed")."""
        self.precision.optimizer_step(optimizer)

    # -- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over every rank of the job, in place, and return it.

        A collective: every rank must call it, with a tensor of the same shape on its own device
        (``self.device``). At world size 1 the tensor is returned unchanged.

        Args:
            tensor: the value to reduce; it is overwritten with the result.
            op: "sum" (the default, as ``torch.distributed.all_reduce``), "mean" (the sum divided by the
                world size, in place: the tensor must be floating point), "max" or "min". Lightning Fabric's
                ``all_reduce`` defaults to "mean": pass ``op="mean"`` where a Fabric loop relied on that.

        Raises:
            ValueError: an ``op`` other than these four.
        """
        if op not in _REDUCE_OPS:
            raise ValueError(f"unknown op={op!r}; choose one of {', '.join(map(repr, _REDUCE_OPS))}")
        if self.world_size > 1:
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, _REDUCE_OPS[op]))
            if op == "mean":
                tensor /= self.world_size
        return tensor

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank arrives."""
        if self.world_size > 1:
            dist.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank zero only."""
        if self.is_rank_zero:
            print(*args, **kwargs, flush=True)

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, state: dict, asynchronous: bool = False) -> Any:
        """Save ``state`` (modules, optimizers, schedulers and plain values) to ``path`` atomically.

        The precision's state (GradScaler) is added under the key "precision". All ranks must call it. A
        background save still in flight is published first (:meth:`wait_for_save`).

        ``asynchronous=True`` (sharded strategies: fsdp, model_parallel, hsdp, tp) returns once the state is
        copied to host memory: a thread writes the copy (torch's ``dcp.async_save``, its collectives on a gloo
        group of its own, made at the first such save with this Runtime's ``timeout``) into a temporary
        directory that becomes ``path`` only when the returned ``AsyncSave``'s ``wait()`` (or the next save,
        :meth:`wait_for_save`, :meth:`teardown`) finds the write ended, on rank zero; ``AsyncSave.write_s``
        is then the seconds the write took.

        Returns:
            None, or the ``trainscale.runtime.strategies.dcp_checkpoint.AsyncSave`` of an asynchronous save.

        Raises:
            ValueError: ``asynchronous=True`` under a strategy that writes one file (single, ddp, dp).
            trainscale.runtime.checkpoint_io.CheckpointError: this write, or the one in flight, failed.
        """
        self.launch()
        if asynchronous:
            self.strategy.check_async_save()
        self.wait_for_save()
        state = {**state, "precision": self.precision.state_dict()}
        if asynchronous:
            if self._checkpoint_group is None:  # collectives of the background write never meet training's
                self._checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
            self._pending_save = self.strategy.save_checkpoint(path, state, self._checkpoint_group)
            return self._pending_save
        self.strategy.save_checkpoint(path, state)
        self.barrier()
        return None

    def wait_for_save(self) -> None:
        """Block until the background save in flight (if any) has been written, and publish it.

        Raises:
            trainscale.runtime.checkpoint_io.CheckpointError: its write failed (nothing is published).
        """
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.wait()

    def load(self, path: str | os.PathLike, state: dict | None = None, verify: bool = True,
             before_restore: Callable[[dict], None] | None = None, strict: bool = True) -> dict:
        """Restore the stateful objects of ``state`` in place from ``path``.

        ``verify=True`` (the default) checks the SHA-256 recorded beside the checkpoint when it was
        written and refuses one without it; ``verify=False`` loads it unchecked (a file you trust
        that was written by other means). ``before_restore(entries)`` is called once with the checkpoint's
        entries as read, before anything is restored from them, and may change them: a file's every entry (a
        module's weights as its state dict), a sharded (DCP) directory's plain entries (its tensors are read in
        place after it; Lightning's ``on_load_checkpoint`` sees the same entries). An error it raises (the same on
        every rank, which all read them) refuses the checkpoint with nothing changed. ``strict=False`` (a module's
        ``load_state_dict(strict=False)``) restores the modules' weights that the checkpoint holds, keeps the others
        as they are and ignores the checkpoint's weights no module has.

        Returns:
            The checkpoint's other entries (e.g. epoch counters).

        Raises:
            FileNotFoundError: ``path`` does not exist (checked on every rank before any collective).
            trainscale.runtime.checkpoint_io.CheckpointError: a corrupted, unverifiable (no checksum
                file, ``verify=True``) or mismatched checkpoint.
        """
        self.launch()
        rest = self.strategy.load_checkpoint(path, dict(state or {}), verify=verify, before_restore=before_restore,
                                             strict=strict)
        self.precision.load_state_dict(rest.pop("precision", {}))
        return rest

    def teardown(self) -> None:
        """Publish a background save in flight (:meth:`wait_for_save`), then destroy the process group (if this
        Runtime made one)."""
        self.wait_for_save()
        self._checkpoint_group = None
        if self.strategy is not None:
            self.strategy.teardown()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.monitor_group = None
        self._launched = False


def _run_spawned(runtime_flags: dict, function: Callable, args: tuple, kwargs: dict) -> Any:
    """A "ddp_spawn"/"ddp_notebook" child of ``Runtime.launch(function, *args, **kwargs)``: this rank's Runtime,
    then the function."""
    runtime = Runtime(**runtime_flags)
    runtime.launch()
    try:
        return runtime.launch(function, *args, **kwargs)
    finally:
        runtime.teardown()
