"""The public surface as a user meets it: the top-level names, the commands' Python forms after their
subpackages are imported, ``Trainer.save_checkpoint`` around ``fit``, and the checkpoint dict that callbacks see."""

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests import public_api_body
from tests.helpers import run_distributed
from trainscale.callbacks import Callback


@pytest.mark.multiprocess
def test_every_documented_call_works_after_the_subpackages_are_imported():
    """In a process that has not imported trainscale yet (forked from the warm server, which holds only torch)."""
    (out,) = run_distributed(public_api_body.documented_calls_after_subpackage_imports, world_size=1, timeout=120)
    assert out == "ok"


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


class _Seen(Callback):
    def __init__(self):
        self.saved, self.loaded = [], []

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self.saved.append(sorted(checkpoint))
        checkpoint["my_note"] = {"step": trainer.global_step}  # a callback may add its own entries

    def on_load_checkpoint(self, trainer, module, checkpoint):
        self.loaded.append(checkpoint)


def test_save_checkpoint_after_fit_writes_a_loadable_checkpoint_of_the_fitted_state(tmp_path):
    from trainscale import Trainer
    from trainscale.runtime.checkpoint_io import load_file

    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=2, default_root_dir=tmp_path, enable_progress_bar=False,
                      logger=False, enable_checkpointing=False)
    with pytest.raises(RuntimeError, match="needs a fit first"):
        trainer.save_checkpoint(tmp_path / "early.pt")
    model = torch.nn.Linear(4, 2)
    trainer.fit(model, _data(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    path = trainer.save_checkpoint(tmp_path / "model.ckpt")
    assert path == tmp_path / "model.ckpt" and path.is_file()  # where Lightning writes it: the path as given
    assert "model.ckpt.sha256" not in os.listdir(tmp_path)  # one file, its digest inside
    saved = load_file(path)
    assert saved["train_state"]["global_step"] == 8 and saved["loop"]["complete"]
    assert torch.equal(saved["state_dict"]["weight"], model.weight.detach())
    resumed = Trainer(accelerator="cpu", devices=1, max_epochs=3, default_root_dir=tmp_path,
                      enable_progress_bar=False, logger=False, enable_checkpointing=False)
    resumed.fit(torch.nn.Linear(4, 2), _data(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), ckpt_path=path)
    assert resumed.global_step == 12  # epochs 1-2 from the checkpoint, epoch 3 trained


def test_callbacks_see_and_extend_the_checkpoint_dict(tmp_path):
    from trainscale import Trainer

    seen = _Seen()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False,
                      logger=False, callbacks=[seen])
    trainer.fit(torch.nn.Linear(4, 2), _data(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert len(seen.saved) == 1  # one checkpoint per epoch end
    assert {"state_dict", "optimizer", "train_state", "loop", "rng", "callbacks"} <= set(seen.saved[0])
    again = _Seen()
    resumed = Trainer(accelerator="cpu", devices=1, max_epochs=2, default_root_dir=tmp_path, enable_progress_bar=False,
                      logger=False, callbacks=[again])
    resumed.fit(torch.nn.Linear(4, 2), _data(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), ckpt_path="last")
    assert again.loaded and again.loaded[0]["my_note"] == {"step": 4}


def test_resuming_last_of_a_run_whose_checkpoints_are_in_its_own_dirpath_continues_that_run(tmp_path):
    from trainscale import Trainer
    from trainscale.callbacks import ModelCheckpoint

    def fit(epochs):
        trainer = Trainer(accelerator="cpu", devices=1, max_epochs=epochs, default_root_dir=tmp_path / "runs",
                          enable_progress_bar=False, logger=False,
                          callbacks=[ModelCheckpoint(dirpath=tmp_path / "mine", save_top_k=-1)])
        trainer.fit(torch.nn.Linear(4, 2), _data(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), ckpt_path="last")
        return trainer

    first = fit(1)
    resumed = fit(2)
    assert resumed.run_dir == first.run_dir == tmp_path / "runs" / "version_0"  # not the dirpath's parent
    assert resumed.global_step == 8 and sorted(p.name for p in (tmp_path / "mine").glob("*.ckpt")) == [
        "epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]


def test_trainer_names_its_place_in_the_job_as_lightning():
    from trainscale import Trainer

    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank) == (0, 0, 0)
    assert (trainer.world_size, trainer.num_nodes, trainer.is_global_zero) == (1, 1, True)
