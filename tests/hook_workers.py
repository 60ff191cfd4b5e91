"""The modules and bodies of the multi-process tests of Lightning's set-up and batch hooks (module level for ``spawn``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainscale.lightning.module import TrainingModule

SCALE = 3.0  # what on_after_batch_transfer multiplies the inputs by


def regression_data(n: int = 8) -> TensorDataset:
    """n samples of 4 features and one target, the same on every rank (no random state)."""
    x = torch.linspace(-1.0, 1.0, n * 4).reshape(n, 4)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.5 + 0.25)


def initial_layer() -> nn.Linear:
    """The layer configure_model builds: fixed weights, so every rank builds the same one."""
    layer = nn.Linear(4, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[0.1, -0.2, 0.3, -0.4]]))
        layer.bias.fill_(0.05)
    return layer


class BuiltInConfigureModel(TrainingModule):
    """A module whose only layer is built in ``configure_model`` (idempotently) and whose inputs are scaled by
    ``on_after_batch_transfer``; ``calls`` records the set-up hooks in order."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = None
        self.calls: list[str] = []
        self.builds = 0
        self.local_rows: int | None = None  # rows of the weight this rank holds as the optimizer is built (DTensor)

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")

    def configure_model(self) -> None:
        self.calls.append("configure_model")
        if self.layer is None:  # idempotent, as Lightning asks: called in every stage
            self.layer = initial_layer()
            self.builds += 1

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x * SCALE, y

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])

    def configure_optimizers(self):
        from torch.distributed.tensor import DTensor

        self.calls.append("configure_optimizers")
        weight = self.layer.weight  # built after the strategy wrapped the model: sharded under fsdp
        self.local_rows = weight.to_local().shape[0] if isinstance(weight, DTensor) else None
        return torch.optim.SGD(self.parameters(), lr=0.05)


def reference_weights(world_size: int, batch_size: int, steps: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the layer trained on the scaled inputs, ``world_size * batch_size`` samples per step in order (a
    distributed sampler without shuffling gives rank r samples r, r + world_size, ...: together, each step's block)."""
    layer = initial_layer()
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    x, y = regression_data().tensors
    block = world_size * batch_size
    for step in range(steps):
        xs, ys = x[step * block:(step + 1) * block], y[step * block:(step + 1) * block]
        F.mse_loss(layer(xs * SCALE), ys).backward()
        opt.step()
        opt.zero_grad()
    return {f"layer.{k}": v.detach() for k, v in layer.state_dict().items()}


def configure_model_fsdp_body(rank: int, root: str) -> dict:
    """fsdp on 2 ranks: fit (2 steps of 2 samples per rank), then validate, of :class:`BuiltInConfigureModel`."""
    from torch.distributed.tensor import DTensor

    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", strategy="fsdp", max_epochs=1, default_root_dir=root,
                      enable_progress_bar=False, enable_checkpointing=False, num_sanity_val_steps=0, timeout=60)
    model = BuiltInConfigureModel()
    trainer.fit(model, DataLoader(regression_data(), batch_size=2), DataLoader(regression_data(4), batch_size=2))
    trainer.validate(model, DataLoader(regression_data(4), batch_size=2))
    weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
               for k, v in model.state_dict().items()}
    trainer.runtime.teardown()
    return {"calls": model.calls, "builds": model.builds, "local_rows": model.local_rows, "weights": weights}
