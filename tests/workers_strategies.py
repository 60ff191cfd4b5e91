"""Bodies and references for the strategy/precision/clipping tests (module level: spawn imports them)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tests import workers


def clipped_reference(batch_size: int, epochs: int, max_norm: float | None = None,
                      clip_val: float | None = None, seed: int = 0, n: int = 96, ranks: int = 1) -> dict:
    """``workers.plain_pytorch_reference`` with gradient clipping, by hand, in one process.

    With ``ranks`` > 1, each step's gradient is computed as DDP does: one gradient per rank's
    micro-batch of ``batch_size`` (rank r takes positions r, r + ranks, ... of the epoch's permutation,
    as DistributedSampler), each divided by ``ranks`` and summed. The same order of float additions
    matters here: on an AMD EPYC host, a reference with one 16-sample batch per step ended 1.8e-4 away
    from 2-rank DDP after 4 steps of clipping by value (gradients of one step agree to ~1e-7), while
    this reference agrees to rtol 1e-5. Which op amplifies the rounding was not pinned down (a
    discontinuity such as ReLU at 0 before max-pool is the likely one).

    Computed with one thread, as each rank computes (``run_distributed`` gives every rank one thread): with
    more, a convolution's backward may sum in another order (seen on an Intel Xeon host: 5e-5 apart after one
    epoch of clipping by value).

    Returns the final state and the total gradient norm before clipping at every step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _clipped_reference(batch_size, epochs, max_norm, clip_val, seed, n, ranks)
    finally:
        torch.set_num_threads(threads)


def _clipped_reference(batch_size: int, epochs: int, max_norm: float | None, clip_val: float | None, seed: int,
                       n: int, ranks: int) -> dict:
    ds = workers.tiny_dataset(n)
    model = workers.make_model(seed)
    opt = workers.sgd(model.parameters())
    norms, max_abs = [], []
    for epoch in range(epochs):
        g = torch.Generator()
        g.manual_seed(seed + epoch)  # DistributedSampler's shuffling
        perm = torch.randperm(len(ds), generator=g)
        shards = [perm[r::ranks] for r in range(ranks)]
        for start in range(0, len(shards[0]), batch_size):
            grads = []
            for shard in shards:
                model.zero_grad(set_to_none=True)
                x, y = ds[shard[start:start + batch_size]]
                F.cross_entropy(model(x), y).backward()
                grads.append([p.grad for p in model.parameters()])
            for p, *per_rank in zip(model.parameters(), *grads):
                p.grad = per_rank[0] if ranks == 1 else sum(g / ranks for g in per_rank)
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
            max_abs.append(max(p.grad.abs().max().item() for p in model.parameters()))
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if clip_val is not None:
                torch.nn.utils.clip_grad_value_(model.parameters(), clip_val)
            opt.step()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms,
            "max_abs": max_abs}


def clipping_body(rank: int, root: str, batch_size: int, epochs: int, max_norm: float, clip_val: float,
                  n: int) -> dict:
    """Trainer under ddp: clipping by norm, then by value, in the same two processes (no validation)."""
    from torch.utils.data import DataLoader

    from trainscale.loop.trainer import Trainer

    out = {}
    for kind, flags in (("norm", {"gradient_clip_val": max_norm}),
                        ("value", {"gradient_clip_val": clip_val, "gradient_clip_algorithm": "value"})):
        trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=epochs, seed=0,
                          default_root_dir=f"{root}/{kind}",
                          enable_progress_bar=False, enable_checkpointing=False, log_every_n_steps=1, timeout=60,
                          **flags)
        model = workers.make_model(0)
        trainer.fit(model, DataLoader(workers.tiny_dataset(n), batch_size=batch_size, shuffle=True),
                    optimizer=workers.sgd)
        out[kind] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer.runtime.teardown()
    return out


def spawn_options_body(runtime) -> dict:
    """Runs inside ``Runtime.launch(fn)`` children: what each rank sees."""
    import torch.distributed as dist

    wrapped, _ = runtime.setup(nn.Linear(3, 2))
    total = runtime.all_reduce(torch.tensor(float(runtime.rank + 1)))
    return {"world_size": dist.get_world_size(), "rank": runtime.rank, "sum_of_ranks_plus_one": total.item(),
            "strategy": runtime.strategy.name, "static_graph": wrapped.static_graph,
            "gradient_as_bucket_view": wrapped.gradient_as_bucket_view, "bucket_bytes_cap": wrapped.bucket_bytes_cap}


class Block(nn.Module):
    """A residual MLP block that counts calls of its forward (recomputation shows up as extra calls)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.fc2(F.gelu(self.fc1(x)))


class BlockNet(nn.Module):
    """Input (B, 16) → 2 Blocks → logits (B, 4)."""

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def mlp_data(n: int = 64, features: int = 16, classes: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x[:, :classes].argmax(dim=1))  # learnable labels
    return torch.utils.data.TensorDataset(x, y)


def sync_batchnorm_cuda_body(rank: int) -> dict:
    """GPU only: a ConvNet with BatchNorm under ddp + sync_batchnorm; running statistics agree across ranks
    although each rank sees different data."""
    from torch.utils.data import DataLoader

    from trainscale.models import ConvNet
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cuda", devices="auto", strategy="ddp", sync_batchnorm=True, max_epochs=1,
                      enable_progress_bar=False, enable_checkpointing=False, timeout=60,
                      default_root_dir=f"/tmp/trainscale-syncbn-{rank}")
    model = ConvNet(batchnorm=True)
    trainer.fit(model, DataLoader(workers.tiny_dataset(64), batch_size=8, shuffle=True), optimizer=workers.sgd)
    bn = next(m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    trainer.runtime.teardown()
    return {"converted": isinstance(bn, nn.SyncBatchNorm), "running_mean": bn.running_mean.cpu().tolist()}
