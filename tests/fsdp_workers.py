"""Bodies of the FSDP multi-process tests (module level so ``spawn`` can import them).

Several runs share one pair of processes (one process group) to keep the tests fast: each
Trainer/Runtime is built on the group the first one created; the last run tears it down.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.workers import make_model, sgd, tiny_dataset
from trainscale.lightning.module import TrainingModule


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def full_state(model: nn.Module) -> dict:
    """The model's full (unsharded) weights on every rank: DTensor shards are all-gathered."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _fit(root, strategy, *, epochs=2, batch_size=8, n=96, val_n=49, ckpt_path=None, options=None, **extra):
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", strategy=strategy, max_epochs=epochs, seed=0,
                      default_root_dir=root, enable_progress_bar=False, timeout=60, strategy_options=options, **extra)
    model = make_model(0)
    val = DataLoader(tiny_dataset(val_n, seed=1), batch_size=8) if val_n else None
    summary = trainer.fit(model, DataLoader(tiny_dataset(n), batch_size=batch_size, shuffle=True), val,
                          optimizer=sgd, ckpt_path=ckpt_path)
    return trainer, model, summary


# -- parity, communication counts, memory ------------------------------------------------------
class _HookState:
    """DDP comm-hook state: counts the buckets it all-reduces."""

    def __init__(self) -> None:
        self.calls = 0


def _counting_allreduce_hook(state: _HookState, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.calls += 1
    return allreduce_hook(None, bucket)  # the real all-reduce (default process group)


def _count_ddp_allreduces(root, k: int) -> tuple[int, int]:
    """(bucket all-reduces, optimizer steps) of one epoch with ``accumulate_grad_batches=k``:
    88 samples, 44 per rank, 11 micro-batches of 4 (k=4: groups of 4, 4 and a last partial 3)."""
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", strategy="ddp", max_epochs=1, seed=0, default_root_dir=root,
                      enable_progress_bar=False, enable_checkpointing=False, timeout=60,
                      accumulate_grad_batches=k)
    state = _HookState()
    setup = trainer.runtime.strategy.setup_module

    def setup_with_hook(module):
        wrapped = setup(module)
        wrapped.register_comm_hook(state, _counting_allreduce_hook)
        return wrapped

    trainer.runtime.strategy.setup_module = setup_with_hook
    summary = trainer.fit(make_model(0), DataLoader(tiny_dataset(88), batch_size=4, shuffle=True), optimizer=sgd)
    return state.calls, summary["steps"]


@contextlib.contextmanager
def fsdp_collectives():
    """Counts the collectives FSDP2 issues within the block: the calls of ``torch.distributed.all_gather_single``
    (parameters) and ``reduce_scatter_single`` (gradients) made from FSDP2's collectives module
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py); other callers (telemetry's gather) are not
    counted. The wrappers call the real ones, so the count is of communication that happened. Yields
    ``{"all_gather": [...], "reduce_scatter": [...]}``, the input bytes of each call in order."""
    calls = {"all_gather": [], "reduce_scatter": []}
    real = {name: getattr(dist, f"{name}_single") for name in calls}

    def counting(name):
        def collective(output, input, *args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").endswith("._fsdp_collectives"):
                calls[name].append(input.numel() * input.element_size())
            return real[name](output, input, *args, **kwargs)
        return collective

    for name in calls:
        setattr(dist, f"{name}_single", counting(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, f"{name}_single", fn)


def _count_fsdp_reduce_scatters(root, k: int, options=None) -> tuple[int, int, int, float]:
    """(reduce-scatters, bytes reduce-scattered, optimizer steps, train loss) of one epoch under fsdp."""
    from trainscale.loop.trainer import Trainer

    with fsdp_collectives() as calls:
        trainer = Trainer(accelerator="cpu", devices="auto", strategy="fsdp", max_epochs=1, seed=0,
                          default_root_dir=root, enable_progress_bar=False, enable_checkpointing=False, timeout=60,
                          accumulate_grad_batches=k, strategy_options=options)
        summary = trainer.fit(make_model(0), DataLoader(tiny_dataset(88), batch_size=4, shuffle=True),
                              optimizer=sgd)
    return len(calls["reduce_scatter"]), sum(calls["reduce_scatter"]), summary["steps"], summary["train_loss"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class BlocksNet(nn.Module):
    """Two ``Block``s and a head the root holds: 2 units and the root under ``auto_wrap_policy={Block}``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LitBlocksNet(BlocksNet, TrainingModule):
    """The same network whose steps call ``self(x)``, the Lightning pattern."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return sgd(self.parameters())


def _blocks_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def _count_step_collectives(root: str, model: nn.Module, options) -> dict:
    """One epoch of 4 micro-batches per rank (no accumulation) and a validation of 2 batches per rank, with
    FSDP2's collectives counted; then the fitted model called on its own."""
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", strategy="fsdp", max_epochs=1, seed=0, default_root_dir=root,
                      enable_progress_bar=False, enable_checkpointing=False, num_sanity_val_steps=0, timeout=60,
                      strategy_options=options)
    with fsdp_collectives() as calls:
        summary = trainer.fit(model, DataLoader(_blocks_data(32, 0), batch_size=4),
                              DataLoader(_blocks_data(16, 1), batch_size=4),
                              optimizer=None if isinstance(model, TrainingModule) else sgd)
    with torch.no_grad():
        after = model(_blocks_data(4, 2).tensors[0])
    return {"all_gather": calls["all_gather"], "reduce_scatter": calls["reduce_scatter"], "steps": summary["steps"],
            "state": full_state(model), "after_fit": after}


def _state_bytes(strategy: str) -> dict:
    """Bytes this rank holds for parameters and AdamW states after one step (local shards only)."""
    from trainscale.runtime.runtime import Runtime

    rt = Runtime(accelerator="cpu", devices="auto", strategy=strategy, timeout=60)
    model, opt = rt.setup(make_model(0), adamw)
    x, y = rt.to_device(tiny_dataset(8)[:8])
    rt.backward(nn.functional.cross_entropy(model(x), y))
    norm = rt.clip_gradients(model, opt, max_norm=1e6)  # the total norm; no clipping at this max
    rt.step(opt)

    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = sum(nbytes(p) for p in model.parameters())
    optim = sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return {"params": params, "optimizer": optim, "norm": norm, "norm_type": type(norm).__name__}


def parity_counts_memory_body(rank: int, root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out = {}
    clip = {"gradient_clip_val": 0.05}  # small: clipping is active, so a per-shard norm would show
    _, ddp_model, out["ddp_summary"] = _fit(f"{root}/ddp", "ddp", **clip)
    out["ddp_state"] = full_state(ddp_model)
    trainer, fsdp_model, out["fsdp_summary"] = _fit(f"{root}/fsdp", "fsdp", **clip,
                                                    options={"auto_wrap_policy": {nn.Conv2d, nn.Linear}})
    out["fsdp_state"] = full_state(fsdp_model)
    out["fsdp_param_types"] = sorted({type(p).__name__ for p in fsdp_model.parameters()})
    from trainscale.callbacks.model_summary import summarize

    out["summary_params"] = {"ddp": summarize(ddp_model, -1).total_params, "fsdp": summarize(fsdp_model, -1).total_params,
                             "fsdp_local": sum(p.to_local().numel() for p in fsdp_model.parameters())}
    out["fsdp_rank0_export"] = get_model_state_dict(
        fsdp_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    out["ddp_counts"] = {k: _count_ddp_allreduces(f"{root}/cd{k}", k) for k in (4, 1)}
    out["fsdp_counts"] = {k: _count_fsdp_reduce_scatters(f"{root}/cf{k}", k) for k in (4, 1)}
    out["fsdp_counts_3_units"] = _count_fsdp_reduce_scatters(
        f"{root}/cf3", 4, {"auto_wrap_policy": {nn.Conv2d, nn.Linear}, "cpu_offload": True})
    units = {"auto_wrap_policy": {Block}}
    out["step_collectives"] = {name: _count_step_collectives(f"{root}/{name}", model, options) for name, model, options in
                               (("plain", BlocksNet(), None), ("training_step", LitBlocksNet(), None),
                                ("plain_units", BlocksNet(), units), ("training_step_units", LitBlocksNet(), units))}

    out["ddp_bytes"] = _state_bytes("ddp")
    out["fsdp_bytes"] = _state_bytes("fsdp")
    dist.destroy_process_group()
    return out


# -- checkpoints ---------------------------------------------------------------------------
def resume_body(rank: int, root: str) -> dict:
    """Uninterrupted 2 epochs against 1 epoch, then resume from the sharded "last" for the rest;
    plus the full-state-dict export of the uninterrupted run."""
    trainer, model, full = _fit(f"{root}/full", "fsdp", epochs=2, keep_last=1)  # root-only unit, evaluated
    export = f"{root}/export.pt"
    trainer.runtime.strategy.save_full_state_dict(export, model)
    out = {"full": full_state(model), "full_summary": full, "export": export}
    _, _, out["first_summary"] = _fit(f"{root}/stopped", "fsdp", epochs=1, val_n=0)
    _, model, out["resumed_summary"] = _fit(f"{root}/stopped", "fsdp", epochs=2, ckpt_path="last", val_n=0)
    out["resumed"] = full_state(model)

    # the exported file loads back into a freshly sharded model (rank zero reads, broadcasts)
    from trainscale.runtime.runtime import Runtime

    rt = Runtime(accelerator="cpu", devices="auto", strategy="fsdp", timeout=60)
    fresh, _ = rt.setup(make_model(1))
    rt.strategy.load_full_state_dict(export, fresh)
    out["reimported"] = full_state(fresh)
    dist.destroy_process_group()
    return out


def fp16_skip_body(rank: int, inject: bool) -> tuple[bool, float]:
    """16-mixed under fsdp: with an inf in rank 0's gradient shard only, every rank must skip the step
    (torch 2.13's GradScaler checks DTensor gradients across the mesh); without it, every rank steps."""
    from trainscale.runtime.runtime import Runtime

    rt = Runtime(accelerator="cpu", devices="auto", strategy="fsdp", precision="16-mixed", timeout=60)
    torch.manual_seed(0)
    model, opt = rt.setup(torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1))
    before = [p.to_local().detach().clone() for p in model.parameters()]
    with rt.autocast():
        loss = model(torch.randn(2, 4)).float().sum() * 1e-3  # times the 2**16 loss scale: finite in fp16
    rt.backward(loss)
    if rank == 0 and inject:
        next(model.parameters()).grad._local_tensor.view(-1)[0] = float("inf")
    rt.step(opt)
    changed = any(not torch.equal(a, p.to_local().detach()) for a, p in zip(before, model.parameters()))
    scale = float(rt.precision.scaler.get_scale())
    rt.teardown()
    return changed, scale


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 16),
                         nn.BatchNorm1d(16, affine=False), nn.ReLU(), nn.Linear(16, 3))


def batchnorm_bf16_mixed(rank: int, steps: int) -> dict:
    """The same BatchNorm model under ddp and then fsdp, both "bf16-mixed", ``steps`` SGD steps on the
    same per-rank batches (one process group for both); the losses, the weights after, and what fsdp
    made of the BatchNorm layers."""
    from trainscale.runtime.runtime import Runtime

    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(steps)]
    out = {}
    for strategy in ("ddp", "fsdp"):
        rt = Runtime(accelerator="cpu", devices="auto", strategy=strategy, precision="bf16-mixed", timeout=60)
        model, optimizer = rt.setup(_bn_net(), lambda p: torch.optim.SGD(p, lr=0.1))
        losses = []
        for x, y in batches:
            with rt.autocast():
                loss = nn.functional.cross_entropy(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        inner = rt.strategy.unwrap(model)
        out[strategy] = {"losses": losses, "weights": full_state(inner)}
        if strategy == "fsdp":
            out["bn_param_dtype"] = inner[1].weight.dtype
            out["bn_running_mean_dtype"] = inner[1].running_mean.dtype
    rt.teardown()
    return out
