"""Body of the batch-finder's 2-process test: each rank searches with its own memory budget, then trains
with the batch the ranks agreed on while PyTorch's ``MemTracker`` counts the training run's live tensors."""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

# rank 0 gets the smaller budget, so it decides; rank 1 alone would fit a larger batch
BUDGETS = (9 * 2**20, 16 * 2**20)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(512, 1, 28, 28, generator=g), torch.randint(0, 10, (512,), generator=g))


def search_then_train(rank: int, tmp: str, budgets=BUDGETS) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainscale.callbacks import Callback
    from trainscale.models import ConvNet
    from trainscale.loop.trainer import Trainer
    from trainscale.tune import find_batch_size

    tracker = MemTracker()

    class OneStepStats(Callback):  # MemTracker keeps per-module statistics of one iteration only
        def on_train_batch_end(self, trainer, module, *args):
            tracker.reset_mod_stats()

    torch.manual_seed(0)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, default_root_dir=tmp,
                      enable_progress_bar=False, enable_checkpointing=False, logger=False, timeout=60,
                      callbacks=[OneStepStats()])
    model = ConvNet()
    before = [p.detach().clone() for p in model.parameters()]
    trials: list = []
    found = find_batch_size(model, F.cross_entropy, data(), optimizer=adamw, runtime=trainer.runtime,
                            max_memory=budgets[rank], trials=trials)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    tracker.track_external(model)
    with tracker:  # the real run: DDP's wrapping, buckets, data loading and three steps are counted
        trainer.fit(model, DataLoader(data(), batch_size=found, shuffle=True), loss_fn=F.cross_entropy,
                    optimizer=adamw)
    peak = sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
    trainer.runtime.teardown()
    return {"found": found, "trials": [vars(t) for t in trials], "train_peak": peak, "unchanged": unchanged,
            "budget": budgets[rank]}
