"""Lightning's callbacks that ports import from ``lightning.pytorch.callbacks``, run in one process on small
``TensorDataset`` loaders: what each callback is given and what it does to the run."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainscale.callbacks import (BackboneFinetuning, BasePredictionWriter, Callback, DeviceStatsMonitor,
                                  OnExceptionCheckpoint, RichModelSummary, StochasticWeightAveraging)
from trainscale.lightning.module import TrainingModule
from trainscale.loop.trainer import Trainer


class Tiny(TrainingModule):
    """A linear model whose ``predict_step`` returns its output and the batch index."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 1)

    fail_at: int | None = None  # training_step raises once this many optimizer steps are taken

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.fail_at:
            raise RuntimeError("bad batch")
        return self.layer(batch[0]).pow(2).mean()

    def predict_step(self, batch, batch_idx):
        return {"y": self.layer(batch[0]), "batch_idx": batch_idx}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader(n=10, batch_size=4):
    x = torch.linspace(-1, 1, 2 * n).reshape(n, 2)
    return DataLoader(TensorDataset(x, torch.zeros(n)), batch_size=batch_size)


def _trainer(tmp_path, **kw):
    kw.setdefault("enable_model_summary", False)
    return Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, **kw)


class Recorder(BasePredictionWriter):
    def __init__(self, write_interval):
        super().__init__(write_interval)
        self.batches, self.epochs = [], []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((prediction["batch_idx"], batch_indices, batch[0].shape[0], batch_idx, dataloader_idx))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.epochs.append((predictions, batch_indices))


@pytest.mark.parametrize("interval", ["batch", "epoch", "batch_and_epoch"])
def test_prediction_writer_is_called_at_its_interval(tmp_path, interval):
    writer = Recorder(interval)
    model = Tiny()
    returned = _trainer(tmp_path, callbacks=[writer]).predict(model, _loader())
    on_batch, on_epoch = interval != "epoch", interval != "batch"
    assert writer.batches == ([(0, [0, 1, 2, 3], 4, 0, 0), (1, [4, 5, 6, 7], 4, 1, 0), (2, [8, 9], 2, 2, 0)]
                              if on_batch else [])
    assert len(writer.epochs) == int(on_epoch)
    if on_epoch:
        predictions, indices = writer.epochs[0]
        assert [p["batch_idx"] for p in predictions] == [0, 1, 2]
        assert indices == [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]]  # loaders x batches x samples, as Lightning's
        with torch.no_grad():
            expected = model.layer(torch.linspace(-1, 1, 20).reshape(10, 2))
        torch.testing.assert_close(torch.cat([p["y"] for p in predictions]), expected)
        torch.testing.assert_close(torch.cat([p["y"] for p in returned]), expected)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([torch.ones(2), torch.zeros(2), torch.ones(2)])


def test_prediction_writer_gets_the_sample_indices_the_sampler_gave_and_none_for_an_iterable(tmp_path):
    """``batch_indices`` are the data set indices of each batch's samples, whatever order the loader's sampler gives
    them in (a list as sampler here), per loader at the epoch end; a loader over an ``IterableDataset`` has none
    (``[]``), as Lightning's."""
    x = torch.arange(12.0).reshape(6, 2)
    picked = DataLoader(TensorDataset(x, torch.zeros(6)), batch_size=2, sampler=[5, 0, 3, 4, 1])
    writer = Recorder("batch_and_epoch")

    class Both(Tiny):
        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            return {"y": self.layer(batch[0] if dataloader_idx == 0 else batch), "batch_idx": batch_idx}

    _trainer(tmp_path, callbacks=[writer]).predict(Both(), [picked, DataLoader(_Stream(), batch_size=2)])
    assert [(indices, loader) for _, indices, _, _, loader in writer.batches] == [
        ([5, 0], 0), ([3, 4], 0), ([1], 0), ([], 1), ([], 1)]
    assert writer.epochs[0][1] == [[[5, 0], [3, 4], [1]], [[], []]]
    seen = [batch[0].sum(dim=1).tolist() for batch in picked]  # the rows the indices name: x[i] sums to 4i + 1
    assert seen == [[21.0, 1.0], [13.0, 17.0], [5.0]]


def test_prediction_writer_refuses_an_unknown_interval():
    with pytest.raises(ValueError, match="`write_interval` should be one of"):
        BasePredictionWriter("step")


def test_prediction_writer_without_its_method_raises_not_implemented(tmp_path):
    with pytest.raises(NotImplementedError):
        _trainer(tmp_path, callbacks=[BasePredictionWriter("epoch")]).predict(Tiny(), _loader())


@pytest.mark.timeout(60)
def test_on_exception_checkpoint_saves_the_failed_fit_which_resumes_from_it(tmp_path):
    callback = OnExceptionCheckpoint(tmp_path / "crash")
    assert callback.ckpt_path == str(tmp_path / "crash" / "on_exception.ckpt")
    failing = Tiny()
    failing.fail_at = 2
    with pytest.raises(RuntimeError, match="bad batch"):
        _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, callbacks=[callback]).fit(failing, _loader())
    saved = torch.load(callback.ckpt_path, weights_only=True)
    assert saved["global_step"] == 2
    torch.testing.assert_close(saved["state_dict"]["layer.weight"], failing.layer.weight.detach())

    model = Tiny()
    again = OnExceptionCheckpoint(tmp_path / "crash")
    resumed = _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, callbacks=[again])
    resumed.fit(model, _loader(), ckpt_path=callback.ckpt_path)
    assert resumed.ckpt_path == str(tmp_path / "crash" / "on_exception.ckpt") and resumed.global_step == 6
    assert not (tmp_path / "crash" / "on_exception.ckpt").exists()  # a stage that ends normally removes it


def test_on_exception_checkpoint_overwrites_its_own_file_but_not_another_runs(tmp_path):
    first = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    first.fit(Tiny(), _loader())
    foreign = first.run_dir / "keep.ckpt"
    foreign.write_bytes(b"first run's")
    stale = tmp_path / "stale.ckpt"
    stale.write_bytes(b"stale")
    callbacks = [OnExceptionCheckpoint(first.run_dir, filename="keep"), OnExceptionCheckpoint(tmp_path, "stale")]
    failing = Tiny()
    failing.fail_at = 1
    with pytest.warns(RuntimeWarning, match="keep.ckpt.*another run"):
        with pytest.raises(RuntimeError, match="bad batch"):
            _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=callbacks).fit(failing, _loader())
    assert foreign.read_bytes() == b"first run's"
    assert torch.load(stale, weights_only=True)["global_step"] == 1  # outside every run: replaced, as Lightning

    stale.write_bytes(b"stale")  # a normal end removes only the file it wrote or resumed from
    _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=[OnExceptionCheckpoint(tmp_path, "stale")]
             ).fit(Tiny(), _loader())
    assert stale.read_bytes() == b"stale"


def test_on_exception_checkpoint_needs_a_filename():
    with pytest.raises(ValueError, match="The filename cannot be empty"):
        OnExceptionCheckpoint(".", filename="")


class WeightsAtEpochStart(Callback):
    """Notes a copy of the module's parameters and the learning rate at every training epoch's start."""

    def __init__(self):
        self.weights, self.lrs = [], []

    def on_train_epoch_start(self, trainer, pl_module):
        self.weights.append([p.detach().clone() for p in pl_module.parameters()])
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.timeout(60)
def test_swa_ends_the_fit_with_the_mean_of_the_weights_at_the_averaged_epochs_start(tmp_path):
    seen = WeightsAtEpochStart()
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=1)
    model = Tiny()
    trainer = _trainer(tmp_path, max_epochs=4, num_sanity_val_steps=0, callbacks=[seen, swa])
    trainer.fit(model, _loader(n=16, batch_size=4))
    assert swa.swa_start == 1 and swa.swa_end == 3 and int(swa.n_averaged) == 3  # epochs 1, 2, 3 (0-based)
    for i, param in enumerate(model.parameters()):
        expected = torch.stack([w[i] for w in seen.weights[1:]]).mean(0)
        torch.testing.assert_close(param.detach(), expected)
        assert not torch.equal(expected, seen.weights[-1][i])  # the average differs from the last epoch's start
    assert seen.lrs[:2] == [0.05, 0.05] and trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01)
    assert isinstance(trainer.lr_scheduler_configs[0].scheduler, torch.optim.swa_utils.SWALR)
    saved = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)
    state = saved["callbacks"]["StochasticWeightAveraging"]
    assert state["n_averaged"] == 3 and state["latest_update_epoch"] == 3


@pytest.mark.timeout(60)
def test_swa_resumed_mid_average_ends_as_the_uninterrupted_fit(tmp_path):
    from trainscale.callbacks import ModelCheckpoint

    whole = Tiny()
    start = {k: v.clone() for k, v in whole.state_dict().items()}
    every = ModelCheckpoint(dirpath=tmp_path / "c", save_top_k=-1)
    swa = [StochasticWeightAveraging(0.01, swa_epoch_start=2) for _ in range(2)]
    _trainer(tmp_path, max_epochs=4, num_sanity_val_steps=0, callbacks=[swa[0], every]).fit(whole, _loader(16, 4))
    resumed = Tiny()
    resumed.load_state_dict(start)
    _trainer(tmp_path, max_epochs=4, num_sanity_val_steps=0, enable_checkpointing=False, callbacks=[swa[1]]).fit(
        resumed, _loader(16, 4), ckpt_path=tmp_path / "c" / "epoch=2-step=12.ckpt")  # averaged at epochs 1 and 2
    assert int(swa[1].n_averaged) == 3
    for a, b in zip(whole.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)


class Normalised(Tiny):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(2)

    def forward(self, x):
        return self.layer(self.norm(x))

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()


@pytest.mark.timeout(60)
def test_swa_recomputes_batchnorm_statistics_for_the_averaged_weights(tmp_path):
    model = Normalised()
    data = _loader(n=16, batch_size=4)
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, callbacks=[swa]).fit(model, data)
    inputs = data.dataset.tensors[0]
    # update_bn's cumulative mean over equal batches: the data's mean and the mean of the batches' variances
    torch.testing.assert_close(model.norm.running_mean, inputs.mean(0))
    batch_vars = torch.stack([b.var(0, unbiased=True) for b in inputs.split(4)]).mean(0)
    torch.testing.assert_close(model.norm.running_var, batch_vars)
    assert model.norm.momentum == 0.1  # update_bn restores it


def test_swa_refuses_sharded_strategies_and_lightnings_bad_arguments():
    from types import SimpleNamespace

    trainer = SimpleNamespace(runtime=SimpleNamespace(strategy=SimpleNamespace(name="fsdp"), config=None))
    with pytest.raises(ValueError, match="does not support strategy='fsdp'"):
        StochasticWeightAveraging(swa_lrs=0.1).setup(trainer, None, "fit")
    for kwargs, message in [({"swa_lrs": 0.1, "swa_epoch_start": 0}, "swa_epoch_start should be"),
                            ({"swa_lrs": 0.1, "swa_epoch_start": 1.5}, "swa_epoch_start should be"),
                            ({"swa_lrs": -0.1}, "`swa_lrs` should"), ({"swa_lrs": [0.1, 1]}, "`swa_lrs` should"),
                            ({"swa_lrs": 0.1, "avg_fn": 3}, "`avg_fn` should be callable"),
                            ({"swa_lrs": 0.1, "device": 0}, "device is expected")]:
        with pytest.raises(ValueError, match=message):
            StochasticWeightAveraging(**kwargs)


class WithBackbone(Tiny):
    """``backbone`` then ``head``; its optimizer holds the parameters that require gradients (the head's at first)."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(2, 2)

    def forward(self, x):
        return self.layer(self.backbone(x))

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


class BackboneLr(Callback):
    """Notes the backbone's learning rate (None while it is not in the optimizer) and weights after each epoch."""

    def __init__(self):
        self.lrs, self.weights = [], []

    def on_train_epoch_end(self, trainer, pl_module):
        groups = trainer.optimizers[0].param_groups
        self.lrs.append(groups[-1]["lr"] if len(groups) > 1 else None)
        self.weights.append(pl_module.backbone.weight.detach().clone())


@pytest.mark.timeout(60)
def test_backbone_finetuning_unfreezes_at_its_epoch_then_doubles_the_rate_up_to_the_heads(tmp_path, caplog):
    import logging

    seen = BackboneLr()
    model = WithBackbone()
    before = model.backbone.weight.detach().clone()
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=True)
    with caplog.at_level(logging.INFO, logger="trainscale.callbacks.backbone_finetuning"):
        _trainer(tmp_path, max_epochs=6, num_sanity_val_steps=0, callbacks=[finetuning, seen]).fit(model, _loader())
    # 0.1 x 0.1 at the unfreeze, then x2 per epoch until it would pass the head's 0.1
    assert seen.lrs == pytest.approx([None, 0.01, 0.02, 0.04, 0.08, 0.1]) and seen.lrs[0] is None
    assert torch.equal(seen.weights[0], before) and not torch.equal(seen.weights[1], before)
    assert finetuning.previous_backbone_lr == pytest.approx(0.1) and finetuning.state_dict() == {
        "previous_backbone_lr": finetuning.previous_backbone_lr}
    assert "Current lr: 0.1, Backbone lr: 0.01" in caplog.text


def test_backbone_finetuning_needs_a_backbone(tmp_path):
    with pytest.raises(ValueError, match="should have a nn.Module `backbone` attribute"):
        _trainer(tmp_path, max_epochs=1, callbacks=[BackboneFinetuning()]).fit(Tiny(), _loader())


class Notes:
    """A logger that keeps what ``log_metrics`` was given."""

    def __init__(self):
        self.calls = []

    def setup(self, run_dir):
        pass

    def log_hyperparams(self, params):
        pass

    def log_metrics(self, metrics, step):
        self.calls.append((dict(metrics), step))

    def finalize(self, status):
        pass


class Validated(Tiny):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.layer(batch[0]).pow(2).mean())


@pytest.mark.timeout(60)
def test_device_stats_monitor_logs_cpu_stats_at_the_log_steps(tmp_path):
    notes = Notes()
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, log_every_n_steps=2, logger=notes,
                       callbacks=[DeviceStatsMonitor()])
    trainer.fit(Validated(), _loader(n=12, batch_size=4), _loader(n=4, batch_size=2))
    ours = [(sorted(m), step) for m, step in notes.calls if any(k.startswith("DeviceStatsMonitor.") for k in m)]
    names = ["cpu_percent", "cpu_swap_percent", "cpu_vm_percent"]
    # training steps 0, 1, 2: the one that makes the 2nd step is logged; the validation after 3 steps (the 4th) too
    expected = [([f"DeviceStatsMonitor.on_train_batch_{when}/{n}" for n in names], 1) for when in ("start", "end")]
    expected += [([f"DeviceStatsMonitor.on_validation_batch_{when}/{n}" for n in names], 3)
                 for _ in range(2) for when in ("start", "end")]
    assert ours == expected
    values = [v for m, _ in notes.calls for k, v in m.items() if k.startswith("DeviceStatsMonitor.")]
    assert values and all(0 <= v <= 100 for v in values)


def test_device_stats_monitor_cuda_stats_with_a_faked_allocator(monkeypatch):
    """The CUDA branch, on a faked ``torch.cuda.memory_stats`` (no GPU runs here)."""
    fake = {"allocated_bytes.all.current": 1024, "allocated_bytes.all.peak": 4096, "num_ooms": 0}
    asked = []
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: asked.append(device) or dict(fake))
    cuda = torch.device("cuda", 1)
    assert DeviceStatsMonitor()._stats(cuda) == fake and asked == [cuda]
    assert DeviceStatsMonitor(filter_keys={"num_ooms"})._stats(cuda) == {"num_ooms": 0}
    both = DeviceStatsMonitor(cpu_stats=True)._stats(cuda)
    assert set(both) == set(fake) | {"cpu_percent", "cpu_vm_percent", "cpu_swap_percent"}
    assert DeviceStatsMonitor(cpu_stats=False)._stats(torch.device("cpu")) == {}


def test_device_stats_monitor_needs_a_logger_and_warns_on_unknown_keys(tmp_path):
    with pytest.raises(ValueError, match="Cannot use `DeviceStatsMonitor` callback with `Trainer\\(logger=False\\)`"):
        _trainer(tmp_path, max_epochs=1, logger=False, callbacks=[DeviceStatsMonitor()]).fit(Tiny(), _loader())
    with pytest.warns(UserWarning, match="filter_keys contains keys not found.*cpu_prcent"):
        _trainer(tmp_path, max_epochs=1, logger=Notes(), num_sanity_val_steps=0,
                 callbacks=[DeviceStatsMonitor(filter_keys={"cpu_prcent", "cpu_percent"})]).fit(Tiny(), _loader())


@pytest.mark.timeout(60)
def test_rich_model_summary_draws_the_layers_and_totals_with_rich(tmp_path, capsys):
    pytest.importorskip("rich")
    model = WithBackbone()  # layer (2 -> 1) and backbone (2 -> 2): 3 + 6 parameters
    model.backbone.requires_grad_(False)
    trainer = _trainer(tmp_path, max_epochs=1, enable_model_summary=True, num_sanity_val_steps=0,
                       callbacks=[RichModelSummary(max_depth=1)])
    trainer.fit(model, _loader())
    out = capsys.readouterr().out
    assert sum(isinstance(cb, RichModelSummary) for cb in trainer.callbacks) == 1
    assert not any(type(cb).__name__ == "ModelSummary" for cb in trainer.callbacks)  # no default one beside it
    assert "┃" in out or "│" in out  # rich's box drawing, not tabulate's
    rows = [line for line in out.splitlines() if "Linear" in line]
    assert len(rows) == 2 and "layer" in rows[0] and rows[0].rstrip(" │").endswith("3")
    assert "backbone" in rows[1] and rows[1].rstrip(" │").endswith("6")
    assert "Trainable params: 3" in out and "Non-trainable params: 6" in out and "Total params: 9" in out


def test_rich_model_summary_without_rich_names_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rich" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install -U rich"):
        RichModelSummary()


@pytest.mark.timeout(60)
def test_swa_says_which_scheduler_it_swaps_for_swalr(tmp_path, caplog):
    import logging

    class WithStepLR(Tiny):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    with caplog.at_level(logging.INFO, logger="trainscale.callbacks.swa"):
        _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, callbacks=[swa]).fit(WithStepLR(), _loader())
    assert "Swapping scheduler `StepLR` for `SWALR`" in caplog.text  # Lightning's note, at INFO
