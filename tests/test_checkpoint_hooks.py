"""``on_load_checkpoint`` as Lightning defines it: the hook sees the checkpoint as read, the weights under
``state_dict`` as a state dict, and what it changes there is what the model gets (the way a port renames the
weights of an older layout); ``Runtime.load``'s ``before_restore`` underneath, on one process and on 2 ranks."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests import ckpt_workers
from tests.helpers import run_distributed
from trainscale.callbacks import Callback
from trainscale.lightning.module import TrainingModule
from trainscale.loop.trainer import Trainer
from trainscale.runtime.runtime import Runtime


class Old(TrainingModule):
    """A one-layer model whose layer is called ``old``."""

    def __init__(self):
        super().__init__()
        self.old = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.forward_layer(batch[0]).pow(2).mean()

    def forward_layer(self, x):
        return self.old(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Renamed(Old):
    """The same model after its layer was renamed ``new``: ``on_load_checkpoint`` renames the saved weights."""

    def __init__(self):
        TrainingModule.__init__(self)
        self.new = nn.Linear(2, 1)
        self.seen: dict = {}

    def forward_layer(self, x):
        return self.new(x)

    def on_load_checkpoint(self, checkpoint):
        self.seen = {key: isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values())
                     for key, value in checkpoint.items()}  # which entries are state dicts
        weights = checkpoint["state_dict"]
        for key in [k for k in weights if k.startswith("old.")]:
            weights["new." + key[len("old."):]] = weights.pop(key)


class Notes(Callback):
    """Notes the weight names the callbacks' ``on_load_checkpoint`` sees (after the module's hook renamed them)."""

    def __init__(self):
        self.names: list[str] = []

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self.names = sorted(checkpoint["state_dict"])


def _loader():
    x = torch.linspace(-1, 1, 16).reshape(8, 2)
    return DataLoader(TensorDataset(x, torch.zeros(8)), batch_size=2)


def _trainer(tmp_path, **kw):
    return Trainer(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=tmp_path, num_sanity_val_steps=0, **kw)


@pytest.mark.timeout(60)
def test_a_resumed_fit_loads_the_weights_as_on_load_checkpoint_left_them(tmp_path):
    old = Old()
    _trainer(tmp_path, max_epochs=1).fit(old, _loader())
    saved = old.old.weight.detach().clone()
    renamed, notes = Renamed(), Notes()
    trainer = _trainer(tmp_path, max_epochs=1, callbacks=[notes])
    trainer.fit(renamed, _loader(), ckpt_path="last")  # the epoch is complete: nothing more trains
    assert renamed.seen["state_dict"] and renamed.seen["epoch"] is False
    assert notes.names == ["new.bias", "new.weight"]  # the module's hook ran first, as Lightning's
    assert torch.equal(renamed.new.weight, saved)


@pytest.mark.timeout(60)
def test_without_the_rename_the_resume_is_refused_naming_the_entry(tmp_path):
    _trainer(tmp_path, max_epochs=1).fit(Old(), _loader())

    class Plain(Renamed):
        def on_load_checkpoint(self, checkpoint):
            pass

    with pytest.raises(Exception, match="does not fit"):
        _trainer(tmp_path, max_epochs=1).fit(Plain(), _loader(), ckpt_path="last")


@pytest.mark.timeout(60)
def test_load_from_checkpoint_loads_the_weights_as_on_load_checkpoint_left_them(tmp_path):
    old = Old()
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(old, _loader())
    loaded = Renamed.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
    assert loaded.seen["state_dict"]
    assert torch.equal(loaded.new.weight, old.old.weight.detach())


@pytest.mark.timeout(60)
def test_runtime_load_lets_before_restore_change_a_file_checkpoint(tmp_path):
    runtime = Runtime(accelerator="cpu")
    model = nn.Linear(2, 1)
    runtime.save(tmp_path / "ck.pt", {"model": model, "step": 3})
    fresh = nn.Linear(2, 1)

    def halve(entries):
        assert entries["step"] == 3 and set(entries["model"]) == {"weight", "bias"}
        entries["model"]["weight"] = entries["model"]["weight"] / 2

    rest = runtime.load(tmp_path / "ck.pt", {"model": fresh}, before_restore=halve)
    assert rest["step"] == 3
    assert torch.equal(fresh.weight, model.weight.detach() / 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_before_restore_is_called_once_per_rank_under_ddp_and_fsdp(tmp_path, strategy):
    results = run_distributed(ckpt_workers.before_restore_body, str(tmp_path), strategy, timeout=55)
    for found in results:
        assert found["step"] == 4 and len(found["seen"]) == 1
        # a file holds the weights; a sharded directory's weights are read in place, its plain entries seen
        assert ("model" in found["seen"][0]) == (strategy == "ddp")
