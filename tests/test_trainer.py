"""Trainer behaviour in one process: model kinds, records, summary, validation counting."""

import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from tests import workers
from tests.helpers import run_distributed
from trainscale.loop.trainer import Trainer

SUMMARY_KEYS = {"world_size", "strategy", "epochs", "global_batch_size", "train_loss", "val_loss", "val_accuracy",
                "epoch_time_s", "samples_per_s", "torch_version", "device"}


class StepModel(nn.Module):
    """A model that defines its own steps and optimizer (Lightning-style)."""

    def __init__(self):
        super().__init__()
        self.net = workers.make_model()
        self.seen_validation = 0

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch):
        x, y = batch
        self.seen_validation += len(y)
        return {"loss": F.cross_entropy(self.net(x), y), "ten": torch.tensor(10.0)}

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def test_summary_and_metrics_files(tmp_path):
    out = workers.trainer_fit(0, str(tmp_path), 16, 2)
    summary = out["summary"]
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["world_size"] == 1 and summary["strategy"] == "single" and summary["epochs"] == 2
    assert len(summary["epoch_time_s"]) == 2 and all(t > 0 for t in summary["epoch_time_s"])
    on_disk = json.loads((tmp_path / "version_0" / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    records = [json.loads(line) for line in open(tmp_path / "version_0" / "metrics.jsonl")]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1]
    assert 0.0 <= summary["val_accuracy"] <= 1.0 and math.isfinite(summary["val_loss"])


def test_model_with_its_own_steps(tmp_path):
    model = StepModel()
    trainer = Trainer(accelerator="cpu", max_epochs=2, enable_progress_bar=False, default_root_dir=tmp_path)
    summary = trainer.fit(model, DataLoader(workers.tiny_dataset(32), batch_size=8, shuffle=True),
                          DataLoader(workers.tiny_dataset(13, seed=2), batch_size=4))
    assert summary["steps"] == 8
    # the sanity check's 2 batches of 4 (num_sanity_val_steps=2, Lightning's default), then 13 samples once per epoch
    assert model.seen_validation == 2 * 4 + 26
    assert trainer.history[-1]["val_ten"] == pytest.approx(10.0)
    assert trainer.history[-1]["val_loss"] > 0


def test_max_steps_stops_mid_epoch(tmp_path):
    trainer = Trainer(accelerator="cpu", max_epochs=5, max_steps=3, enable_progress_bar=False,
                      default_root_dir=tmp_path)
    summary = trainer.fit(workers.make_model(), DataLoader(workers.tiny_dataset(64), batch_size=8),
                          optimizer=workers.sgd)
    assert summary["steps"] == 3 and summary["epochs"] == 1


def test_the_users_model_is_called_as_a_module_so_its_hooks_run(tmp_path):
    model, calls = workers.make_model(), []
    model.register_forward_hook(lambda module, args, out: calls.append(out.shape[0]))
    Trainer(accelerator="cpu", max_epochs=1, enable_progress_bar=False, enable_checkpointing=False,
            default_root_dir=tmp_path).fit(
        model, DataLoader(workers.tiny_dataset(24), batch_size=8), optimizer=workers.sgd)
    assert calls == [8, 8, 8]


def test_gradient_clipping_by_norm_matches_plain_pytorch(tmp_path):
    trainer = Trainer(accelerator="cpu", max_epochs=1, gradient_clip_val=0.01, enable_progress_bar=False,
                      default_root_dir=tmp_path, enable_checkpointing=False)
    model = workers.make_model()
    loader = DataLoader(workers.tiny_dataset(32), batch_size=16)
    trainer.fit(model, loader, optimizer=workers.sgd)
    ref = workers.make_model()
    opt = workers.sgd(ref.parameters())
    for x, y in loader:
        F.cross_entropy(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.multiprocess
def test_validation_counts_each_sample_once_across_ranks():
    n = 37  # odd: a padding sampler would count one sample twice
    single = workers.validate_body(0, n)
    both = run_distributed(workers.validate_body, n, timeout=60)
    assert both[0] == both[1]
    assert both[0]["val_accuracy"] == pytest.approx(single["val_accuracy"], abs=1e-6)
    assert both[0]["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    x, y = workers.tiny_dataset(n, seed=3).tensors
    with torch.no_grad():
        expected = (workers.make_model(0)(x).argmax(1) == y).float().mean().item()
    assert single["val_accuracy"] == pytest.approx(expected, abs=1e-6)


def test_ddp_on_one_process_equals_single(tmp_path):
    """strategy="ddp" with devices=1 (e.g. one GPU) makes its own one-rank process group."""
    out = workers.trainer_fit(0, str(tmp_path), 16, 1, extra={"strategy": "ddp", "devices": 1})
    assert out["summary"]["strategy"] == "ddp" and out["summary"]["world_size"] == 1
    for key, ref in workers.plain_pytorch_reference(16, 1).items():
        torch.testing.assert_close(out["state"][key], ref, rtol=1e-5, atol=1e-6)
