"""EMA of the weights: equal to torch's AveragedModel with an EMA function over the same run (one process, ddp,
fsdp with DTensor shards), validated with the average, saved in checkpoints (a file; DCP shards under fsdp) and
resumed mid-epoch to the uninterrupted run's average."""

import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset

from tests.fsdp_workers import full_state
from tests.helpers import run_distributed
from trainscale.callbacks import EMA
from trainscale.loop.trainer import Trainer

DECAY, EVERY, START = 0.7, 2, 1  # updates after the optimizer steps of index 2, 4, 6 (0-based)
STEPS = 8  # 2 epochs of 4 steps of 4 samples


def _data(n: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def reference() -> dict:
    """A plain PyTorch loop over the same batches with torch's AveragedModel; the EMA's validation loss at
    each epoch end, and the trained and averaged weights."""
    data, model = _data(), _model()
    opt = _sgd(model.parameters())
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)
    x_all, y_all = data.tensors
    val_losses = []
    for step_idx in range(STEPS):
        i = step_idx % 4
        loss = nn.functional.cross_entropy(model(x_all[4 * i:4 * i + 4]), y_all[4 * i:4 * i + 4])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step_idx >= START and step_idx % EVERY == 0:
            ema.update_parameters(model)
        if i == 3:
            with torch.no_grad():
                val_losses.append(nn.functional.cross_entropy(ema.module(x_all), y_all).item())
    return {"val_loss": val_losses, "model": model.state_dict(), "ema": ema.module.state_dict()}


def _fit(root, ckpt_path=None, teardown=False, **flags):
    model, ema = _model(), EMA(DECAY, every_n_steps=EVERY, start_step=START)
    per_rank = 4 // int(os.environ.get("WORLD_SIZE", 1))  # 4 samples per optimizer step on any world size
    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=2, enable_progress_bar=False, seed=0,
                      default_root_dir=root, timeout=60, callbacks=[ema],
                      logger=False, **flags)
    trainer.fit(model, DataLoader(_data(), batch_size=per_rank), DataLoader(_data(), batch_size=8),
                optimizer=_sgd, loss_fn=nn.functional.cross_entropy, ckpt_path=ckpt_path)
    average = ema.state_dict()["average"].tensors  # DTensors under fsdp, each with its parameter's placements
    layout = {n: (type(t).__name__, getattr(t, "placements", None), t.to_local().shape if hasattr(t, "to_local") else None)
              for n, t in average.items()}
    out = {"ema": full_state(model), "val_loss": [r["val_loss"] for r in trainer.history], "layout": layout,
           "params": {n: (type(p).__name__, getattr(p, "placements", None),
                          p.to_local().shape if hasattr(p, "to_local") else None) for n, p in model.named_parameters()}}
    if teardown:
        trainer.runtime.teardown()
    return out


def _whole_cut_resumed(root: str, **flags) -> dict:
    whole = _fit(f"{root}/whole", **flags)
    _fit(f"{root}/cut", max_steps=3, checkpoint_every_n_steps=3, **flags)  # mid-epoch 0, after the first update
    return {"whole": whole, "resumed": _fit(f"{root}/cut", ckpt_path="last", **flags)}


def sharded_body(rank: int, root: str) -> dict:
    """fsdp (the average as DTensor shards, a DCP checkpoint): whole run, stopped and resumed; then ddp."""
    runs = _whole_cut_resumed(f"{root}/fsdp", strategy="fsdp")
    runs["ddp"] = _fit(f"{root}/ddp", strategy="ddp", teardown=True)
    return runs


def _check(run: dict, ref: dict) -> None:
    for key, value in ref["ema"].items():
        torch.testing.assert_close(run["ema"][key.removeprefix("module.")], value)
    assert run["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)


def _check_resume(runs: dict) -> None:
    for key, value in runs["whole"]["ema"].items():
        torch.testing.assert_close(runs["resumed"]["ema"][key], value, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_ema_matches_averaged_model_validates_with_it_and_resumes_from_a_checkpoint_file(tmp_path):
    ref = reference()
    runs = _whole_cut_resumed(str(tmp_path))
    _check(runs["whole"], ref)
    _check_resume(runs)
    checkpoint = torch.load(next(Path(tmp_path, "cut").glob("version_0/checkpoints/epoch=0-step=3.ckpt")),
                            weights_only=True)
    assert checkpoint["callbacks"]["EMA"] == {"decay": DECAY, "n_averaged": 1, "latest_update_step": 3}
    assert set(checkpoint["callbacks/EMA/average"]) == set(checkpoint["state_dict"])  # the average beside the weights


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_ema_under_fsdp_keeps_dtensor_shards_equal_to_one_process_and_resumes_from_dcp_and_under_ddp(tmp_path):
    ref = reference()
    for rank, runs in enumerate(run_distributed(sharded_body, str(tmp_path), timeout=80)):
        _check(runs["whole"], ref)
        _check(runs["ddp"], ref)
        _check_resume(runs)
        layout = runs["whole"]["layout"]
        assert layout == runs["whole"]["params"] and layout["0.weight"][0] == "DTensor"
        assert layout["0.weight"][2] == (4, 4)  # this rank's shard of the (8, 4) weight: never gathered
        assert runs["ddp"]["layout"]["0.weight"][0] == "Tensor"
    assert any(Path(tmp_path, "fsdp", "cut").glob("version_0/checkpoints/*/__0_0.distcp"))  # sharded through DCP


def test_ema_refuses_bad_arguments():
    for kwargs, match in (({"decay": 1.5}, r"decay=1.5\) must be a number in \[0, 1\]"),
                          ({"every_n_steps": 0}, r"every_n_steps=0\) must be an int >= 1"),
                          ({"start_step": -1}, r"start_step=-1\) must be an int >= 0")):
        with pytest.raises(ValueError, match=match):
            EMA(**kwargs)
