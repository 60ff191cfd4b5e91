"""Bodies of the multi-process tests of meta-device initialisation and model parallelism (module level
so ``spawn`` can import them). Each returns plain tensors and numbers for the test to compare."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Subset

from trainscale.models import GPT, GPTConfig, lm_loss
from trainscale.models.gpt import Block

# Small enough for 4 CPU processes, large enough that every linear layer splits over 2 ranks.
CONFIG = GPTConfig(vocab_size=256, context_length=32, n_layer=2, n_head=4, n_embd=64)


def text_loader(batch_size: int, samples: int = 512) -> DataLoader:
    from trainscale.data import load_text

    train, _ = load_text(context_length=CONFIG.context_length)
    return DataLoader(Subset(train, range(samples)), batch_size=batch_size, shuffle=True)


def tensor_bytes(tensors) -> int:
    """Bytes held by this rank: the local shard of a DTensor, the whole of a plain tensor."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def fsdp_meta_gpt(rank: int, steps: int) -> dict:
    """A GPT built on the meta device, sharded by fsdp (one unit per Block), trained ``steps`` steps."""
    from trainscale.runtime.runtime import Runtime

    rt = Runtime(accelerator="cpu", devices="auto", strategy="fsdp", timeout=60,
                 strategy_options={"auto_wrap_policy": {Block}})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(CONFIG)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    wrapped, optimizer = rt.setup(model, lambda params: torch.optim.AdamW(params, lr=3e-3))
    shard = wrapped.blocks[0].mlp.fc.weight.to_local().detach().clone()
    out = {"full_bytes": full_bytes, "param_bytes": tensor_bytes(wrapped.parameters()), "shard": shard,
           "finite": all(bool(torch.isfinite(p.full_tensor()).all()) for p in wrapped.parameters())}
    out["losses"] = train_steps(rt, wrapped, optimizer, rt.setup_dataloader(text_loader(batch_size=8)), steps)
    rt.teardown()
    return out


def train_steps(rt, wrapped, optimizer, batches, steps: int) -> list[float]:
    """``steps`` plain steps of a GPT on ``batches`` (no clipping); each step's loss averaged over the ranks."""
    losses = []
    for _, (x, y) in zip(range(steps), batches):
        x, y = rt.to_device((x, y))
        loss = lm_loss(wrapped(x), y)
        rt.backward(loss)
        rt.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        losses.append(rt.all_reduce(loss.detach(), op="mean").item())
    return losses


def full_weights(model) -> dict:
    """Every parameter in full on every rank (DTensor shards all-gathered), detached copies."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def state_bytes(model, optimizer) -> int:
    """This rank's exact training-state bytes: parameters + gradients + optimizer state tensors."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensor_bytes(params) + tensor_bytes(grads) + tensor_bytes(states)


def train_gpt(rank: int, strategy: str, parallel: dict | None, batch_size: int, steps: int,
              checkpoint: str | None = None, teardown: bool = True, strategy_options: dict | None = None,
              precision: str = "32-true") -> dict:
    """``steps`` SGD steps (momentum 0.9; AdamW's per-element normalisation would magnify rounding
    differences of near-zero gradients) of a GPT (seed 0) with clipping at norm 0.5 through the Runtime; the full
    weights after, the losses and norms, this rank's parameter bytes and its training-state bytes after the
    last step (parameters + gradients + momentum buffers), the parameters whose last gradient was a DTensor
    of partial sums; a DCP checkpoint if asked. ``teardown=False``: another Runtime follows in these processes, on
    the same process group (a second process group started on the same port after a teardown failed to connect
    here)."""
    from trainscale.runtime.runtime import Runtime

    rt = Runtime(accelerator="cpu", devices=1 if strategy == "single" else "auto", strategy=strategy, parallel=parallel,
                 timeout=60, strategy_options=strategy_options, precision=precision)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    wrapped, optimizer = rt.setup(model, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    out = {"losses": [], "norms": [], "param_bytes": tensor_bytes(wrapped.parameters())}
    for _, (x, y) in zip(range(steps), rt.setup_dataloader(text_loader(batch_size))):
        x, y = rt.to_device((x, y))
        loss = lm_loss(wrapped(x), y)
        rt.backward(loss)
        out["norms"].append(rt.clip_gradients(wrapped, optimizer, max_norm=0.5).item())
        out["partial"] = [n for n, p in wrapped.named_parameters()  # partial sums would reach momentum and checkpoints
                          if any(pl.is_partial() for pl in getattr(p.grad, "placements", ()))]
        rt.step(optimizer)
        out["state_bytes"] = state_bytes(wrapped, optimizer)  # gradients still held: the step's peak state
        optimizer.zero_grad(set_to_none=True)
        out["losses"].append(rt.all_reduce(loss.detach(), op="mean").item())
    out["weights"] = full_weights(wrapped)
    if checkpoint is not None:
        rt.save(checkpoint, {"model": wrapped, "optimizer": optimizer, "step": steps})
    if teardown:
        rt.teardown()
    return out


def predict_gpt(rank: int, n: int, strategy: str = "tp", parallel: dict | None = None) -> torch.Tensor:
    """``Trainer.predict`` of the GPT (seed 0) under ``strategy`` (tp 2 by default) on ``n`` sequences of token
    ids (seed 3), 4 per batch."""
    from trainscale.loop.trainer import Trainer

    torch.manual_seed(0)
    model = GPT(CONFIG)
    ids = torch.randint(0, CONFIG.vocab_size, (n, CONFIG.context_length), generator=torch.Generator().manual_seed(3))
    trainer = Trainer(accelerator="cpu", devices="auto", strategy=strategy, parallel=parallel,
                      enable_progress_bar=False, timeout=60)
    out = trainer.predict(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, ids), batch_size=4))
    trainer.runtime.teardown()
    return out


def tp_fp16_setup_error(rank: int) -> str:
    """The error of setting up the GPT under tp 2, "16-mixed", with a user's plan of its blocks' linear layers only
    (the norms and embeddings stay plain tensors beside the DTensors), or "" when there is none."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from trainscale.runtime.runtime import Runtime

    plan = {**{f"blocks.*.attn.{name}": ColwiseParallel() for name in ("q", "k", "v")},
            "blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(),
            "blocks.*.mlp.proj": RowwiseParallel()}
    rt = Runtime(accelerator="cpu", devices="auto", strategy="tp", timeout=60, precision="16-mixed", tp_plan=plan)
    try:
        rt.setup(GPT(CONFIG), lambda params: torch.optim.SGD(params, lr=0.1))
        return ""
    except ValueError as err:
        return str(err)
    finally:
        rt.teardown()


def train_gpt_layouts(rank: int, runs: tuple) -> dict:
    """:func:`train_gpt` once per ``(label, strategy, parallel, batch_size, steps)`` of ``runs``, one after the
    other in these processes, each with its own Runtime and mesh on one process group (torn down after the
    last): ``{label: its result}``."""
    return {label: train_gpt(rank, strategy, parallel, batch_size, steps, teardown=i == len(runs) - 1)
            for i, (label, strategy, parallel, batch_size, steps) in enumerate(runs)}


def fit_gpt(rank: int, strategy: str, root: str, batch_size: int, steps: int) -> dict:
    """``Trainer.fit`` of the GPT for ``steps`` steps (log every step) on 4·``batch_size`` samples; the
    summary and the step and epoch records of rank zero's metrics.jsonl."""
    import json
    from pathlib import Path

    from trainscale import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", strategy=strategy, max_epochs=1, max_steps=steps,
                      log_every_n_steps=1, default_root_dir=root, enable_progress_bar=False,
                      enable_checkpointing=False, timeout=60)
    torch.manual_seed(0)
    summary = trainer.fit(GPT(CONFIG), text_loader(batch_size, samples=4 * batch_size), loss_fn=lm_loss,
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    records = []
    if rank == 0:
        records = [json.loads(line) for line in (Path(trainer.run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "records": records}


def saved_activation_bytes(rank: int, batch_size: int) -> dict:
    """Bytes of the tensors one forward of the GPT (``CONFIG``, seed 0) saves for backward on this rank
    (``torch.autograd.graph.saved_tensors_hooks``; each storage once, a DTensor by its local shard,
    parameters left out), in one process ("single") and under the built-in tp plan over all ranks with
    and without sequence parallelism; and the largest logits difference from one process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainscale.runtime.strategies.apply_tp import apply_tp

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)  # the same batch on every rank
    x = next(iter(text_loader(batch_size)))[0]
    out = {}
    for label, sp in (("single", None), ("tp", False), ("tp+sp", True)):
        torch.manual_seed(0)
        model = GPT(CONFIG)
        if sp is not None:
            apply_tp(model, mesh, sequence_parallel=sp)
        out[label], logits = _saved_bytes(model, x)
        out[f"{label} logits"] = logits.detach()
    dist.destroy_process_group()
    return out


def _saved_bytes(model, x) -> tuple[int, torch.Tensor]:
    """Bytes saved for backward by ``model(x)`` (parameters excluded, each storage once) and the output."""
    params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        local = t.to_local() if hasattr(t, "to_local") else t
        ptr = local.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = local.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x)
    return sum(seen.values()), logits
