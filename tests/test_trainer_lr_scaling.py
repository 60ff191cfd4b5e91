"""Trainer(lr_scaling=..., base_batch_size=..., lr_warmup_steps=...): the lr each optimizer step uses, its
composition with LR schedulers, the logged values, resume, and 2-process ddp (scaling/batch_scaling.py)."""

import json
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests import workers
from tests.helpers import run_distributed
from trainscale.runtime.checkpoint_io import load_file
from trainscale.loop.config import resolve_trainer_config
from trainscale.lightning.module import TrainingModule
from trainscale.loop.trainer import Trainer


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def fit(root, *, scheduler=None, steps=None, epochs=1, accumulate=1, ckpt_path=None, n=64, **flags):
    """A logistic regression (SGD lr 0.1, batch 8) on one process; returns the recorder, summary and step records."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    used = workers.LrUsed()

    def optimizer(params):
        opt = torch.optim.SGD(params, lr=0.1)
        if scheduler is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler(opt), "interval": "step"}}

    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=epochs, max_steps=steps,
                      accumulate_grad_batches=accumulate,
                      log_every_n_steps=1, default_root_dir=root, enable_progress_bar=False, logger=False,
                      callbacks=[used], **flags)
    summary = trainer.fit(model, DataLoader(data(n), batch_size=8, shuffle=True), optimizer=optimizer,
                          ckpt_path=ckpt_path)
    trainer.runtime.teardown()
    records = [json.loads(line) for line in open(f"{summary['run_dir']}/metrics.jsonl")]
    return {"trainer": trainer, "used": used, "summary": summary, "model": model,
            "logged": [r["lr-SGD"] for r in records if r.get("kind") == "step"]}


def first(lrs: list[list[float]]) -> list[float]:
    """The first param group's lr of each step."""
    return [step[0] for step in lrs]


def decay(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def test_flags_are_validated_with_the_fix_named():
    with pytest.raises(ValueError, match="needs base_batch_size=: the global batch size your learning rates"):
        resolve_trainer_config(lr_scaling="linear")
    with pytest.raises(ValueError, match="base_batch_size=64 has no effect without lr_scaling"):
        resolve_trainer_config(base_batch_size=64)
    with pytest.raises(ValueError, match="lr_warmup_steps=5 has no effect without lr_scaling"):
        resolve_trainer_config(lr_warmup_steps=5)
    with pytest.raises(ValueError, match="lr_scaling='quadratic'; choose None, 'linear' or 'sqrt'"):
        resolve_trainer_config(lr_scaling="quadratic", base_batch_size=64)
    with pytest.raises(ValueError, match="base_batch_size=0 must be an int >= 1"):
        resolve_trainer_config(lr_scaling="sqrt", base_batch_size=0)
    with pytest.raises(ValueError, match="lr_warmup_steps=-1 must be an int >= 0"):
        resolve_trainer_config(lr_scaling="sqrt", base_batch_size=8, lr_warmup_steps=-1)
    cfg = resolve_trainer_config(lr_scaling="sqrt", base_batch_size=8, lr_warmup_steps=3)
    assert (cfg.lr_scaling, cfg.base_batch_size, cfg.lr_warmup_steps) == ("sqrt", 8, 3)


def test_each_step_uses_the_schedule_times_the_warmed_up_factor(tmp_path, capsys):
    plain = fit(tmp_path / "plain", scheduler=decay, steps=4, accumulate=2)
    capsys.readouterr()
    scaled = fit(tmp_path / "scaled", scheduler=decay, steps=4, accumulate=2, lr_scaling="linear", base_batch_size=4,
                 lr_warmup_steps=2)
    # global batch 8 per device × 1 rank × 2 accumulation = 16, base 4: × 4, ramped 1 → 4 over 2 steps
    assert scaled["trainer"].global_batch_size == 16 and scaled["summary"]["global_batch_size"] == 16
    assert scaled["summary"]["lr_scaling"] == {"rule": "linear", "base_batch_size": 4, "factor": 4.0, "warmup_steps": 2}
    multipliers = [1.0, 2.5, 4.0, 4.0, 4.0]
    assert first(plain["used"].used) == pytest.approx([0.1, 0.05, 0.1 / 3, 0.025], rel=1e-12)
    expected = [lr * m for lr, m in zip(first(plain["used"].used), multipliers)]
    assert first(scaled["used"].used) == pytest.approx(expected, rel=1e-12)
    # between steps the groups hold the schedule's values (after its step); the records show the lr the next step uses
    assert first(scaled["used"].between) == pytest.approx([0.1 / (s + 2) for s in range(4)], rel=1e-12)
    assert scaled["logged"] == pytest.approx([0.1 / (s + 2) * multipliers[s + 1] for s in range(4)], rel=1e-12)
    out = capsys.readouterr().out
    assert out.count("lr scaling") == 1
    assert ("lr scaling linear: global batch 16 (8 per device × 1 rank(s) × 2 accumulation) / base 4 → lr × 4 "
            "(0.1 → 0.4), warmed up from × 1 over 2 steps") in out


def test_one_cycle_schedule_is_scaled_whole_by_the_sqrt_rule(tmp_path):
    def one_cycle(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=6)

    plain = fit(tmp_path / "plain", scheduler=one_cycle, steps=6)
    scaled = fit(tmp_path / "scaled", scheduler=one_cycle, steps=6, lr_scaling="sqrt", base_batch_size=2)
    factor = math.sqrt(8 / 2)
    assert first(scaled["used"].used) == pytest.approx([lr * factor for lr in first(plain["used"].used)], rel=1e-12)
    assert max(first(scaled["used"].used)) > 0.1  # above OneCycleLR's max_lr: the peak is scaled too


def test_resume_keeps_the_scaled_lr_and_the_checkpoint_holds_it_once(tmp_path):
    flags = {"scheduler": decay, "lr_scaling": "linear", "base_batch_size": 4, "n": 32}  # 4 steps per epoch, × 2
    full = fit(tmp_path / "full", epochs=2, **flags)
    stopped = fit(tmp_path / "stopped", epochs=1, **flags)
    resumed = fit(tmp_path / "stopped", epochs=2, ckpt_path="last", **flags)
    assert len(full["used"].used) == 8 and len(resumed["used"].used) == 4
    assert first(resumed["used"].used) == pytest.approx(first(full["used"].used[4:]), rel=1e-12)  # × 2, not × 4
    assert resumed["used"].used[0][0] == pytest.approx(2 * 0.1 / 5)
    for key, value in full["model"].state_dict().items():
        torch.testing.assert_close(resumed["model"].state_dict()[key], value, rtol=0, atol=0)
    ckpt = load_file(next((tmp_path / "stopped").glob("version_0/checkpoints/epoch=0-step=4.ckpt")))
    group = ckpt["optimizer"]["param_groups"][0]
    assert group["lr"] == pytest.approx(0.1 / 5)  # LambdaLR's value after 4 steps, unscaled: the checkpoint holds
    assert stopped["used"].used[-1][0] == pytest.approx(2 * 0.1 / 4)  # the lr once; the steps used it × 2


@pytest.mark.multiprocess
def test_ddp_two_processes_log_the_lr_times_the_factor(tmp_path):
    ranks = run_distributed(workers.lr_scaling_body, str(tmp_path), timeout=120)
    for rank in ranks:  # 8 per device × 2 ranks × 2 accumulation = 32 = 4 × base 8: SGD's 0.05 → 0.2
        assert rank["global_batch_size"] == 32 and rank["summary"]["global_batch_size"] == 32
        assert first(rank["used"]) == pytest.approx([0.2] * 3, rel=1e-12)
        assert rank["summary"]["lr_scaling"]["factor"] == 4.0
    assert ranks[0]["logged"] == pytest.approx([0.2] * 3, rel=1e-12)


class _ManualLinear(TrainingModule):
    """Manual optimization: one SGD step per batch, taken by the module itself."""

    automatic_optimization = False

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.layer(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_manual_optimization_steps_at_the_scaled_lr_the_records_show(tmp_path):
    torch.manual_seed(0)
    used = workers.LrUsed()
    trainer = Trainer(devices=1, max_steps=3, lr_scaling="linear", base_batch_size=2, log_every_n_steps=1,
                      default_root_dir=tmp_path, enable_progress_bar=False, logger=False, callbacks=[used])
    summary = trainer.fit(_ManualLinear(), DataLoader(data(), batch_size=8))
    trainer.runtime.teardown()
    records = [json.loads(line) for line in open(f"{summary['run_dir']}/metrics.jsonl")]
    logged = [r["lr-SGD"] for r in records if r.get("kind") == "step"]
    # global batch 8, base 2: × 4 on every step (no warm-up)
    assert first(used.used) == pytest.approx([0.4, 0.4, 0.4], rel=1e-12)
    assert logged == pytest.approx([0.4, 0.4, 0.4], rel=1e-12)
    assert first(used.between) == pytest.approx([0.1, 0.1, 0.1], rel=1e-12)
