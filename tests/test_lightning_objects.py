"""Lightning's object API, in one process: ``TrainingModule.load_from_checkpoint``, the results table of
``validate``/``test`` (verbose), ``EarlyStopping``'s arguments and ``ModelCheckpoint``'s file names and ``last.ckpt``."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import pickle
import shutil
import threading
import urllib.error
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainscale.callbacks import EarlyStopping, ModelCheckpoint
from trainscale.checkpointing import run_dirs as ckpt
from trainscale.lightning.module import TrainingModule
from trainscale.loop.config import TrainerConfig
from trainscale.loop.trainer import Trainer
from trainscale.runtime.checkpoint_io import CheckpointError


def _data(n: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


class Classifier(TrainingModule):
    """A module whose __init__ needs an argument, kept by save_hyperparameters (a module argument is left out)."""

    def __init__(self, hidden: int, lr: float = 0.1, head: nn.Module | None = None, scores=None):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), head or nn.Linear(hidden, 3))
        self.lr, self.scores = lr, scores  # scores: per epoch, logged as "score" by validation_step when given

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))
        if self.scores is not None:
            self.log("score", self.scores[self.current_epoch])

    test_step = validation_step

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _trainer(tmp_path, **kw) -> Trainer:
    return Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, logger=False,
                   **{"max_epochs": 1, **kw})


def _fit(tmp_path, model, epochs: int = 1, **kw) -> Trainer:
    trainer = _trainer(tmp_path, max_epochs=epochs, **kw)
    trainer.fit(model, DataLoader(_data(), batch_size=8), DataLoader(_data(8), batch_size=8))
    return trainer


# -- load_from_checkpoint ------------------------------------------------------------------------------
def test_load_from_checkpoint_rebuilds_the_module_from_its_hyperparameters(tmp_path, capsys):
    model = Classifier(hidden=5, lr=0.05, head=nn.Linear(5, 3))
    trainer = _fit(tmp_path, model)
    path = ckpt.find_last(tmp_path)
    assert torch.load(path, weights_only=True)["hyper_parameters"] == {"hidden": 5, "lr": 0.05, "scores": None}
    loaded = Classifier.load_from_checkpoint(path, head=nn.Linear(5, 3))  # the module argument, not saved, given
    assert loaded.hparams.hidden == 5 and loaded.hparams.lr == 0.05
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
    assert Classifier.load_from_checkpoint(path, lr=0.5, unknown=1).hparams.lr == 0.5  # unknown dropped, as Lightning
    for weights_only in (None, True, False):  # Lightning's argument: taken, not passed on to __init__
        assert Classifier.load_from_checkpoint(path, weights_only=weights_only, head=nn.Linear(5, 3)).hparams.hidden == 5
    capsys.readouterr()
    assert trainer.validate(loaded, DataLoader(_data(8), batch_size=8), verbose=False) == \
        trainer.validate(model, DataLoader(_data(8), batch_size=8), verbose=False)
    assert "metric" not in capsys.readouterr().out  # verbose=False: no table
    (results,) = trainer.test(loaded, DataLoader(_data(8), batch_size=8))  # verbose by default, as Lightning
    table = capsys.readouterr().out
    assert "Test metric" in table and "DataLoader 0" in table
    assert any(line.split() == ["val_loss", f"{results['val_loss']:.6g}"] for line in table.splitlines())


def test_load_from_checkpoint_names_what_is_missing(tmp_path):
    class NoHparams(Classifier):
        def save_hyperparameters(self, *args, **kwargs):  # as a module that never calls it
            pass

    _fit(tmp_path / "a", NoHparams(hidden=5))
    with pytest.raises(TypeError, match=r"__init__ needs hidden: the checkpoint holds no hyperparameters.*"
                                        r"save_hyperparameters.*load_from_checkpoint\(path, hidden=\.\.\.\)"):
        NoHparams.load_from_checkpoint(ckpt.find_last(tmp_path / "a"))
    assert NoHparams.load_from_checkpoint(ckpt.find_last(tmp_path / "a"), hidden=5).net[0].out_features == 5
    with pytest.raises(RuntimeError, match="size mismatch"):
        NoHparams.load_from_checkpoint(ckpt.find_last(tmp_path / "a"), hidden=6)
    plain = tmp_path / "plain.pt"
    torch.save({"state_dict": Classifier(2).state_dict()}, plain)
    with pytest.raises(CheckpointError, match="not a trainscale checkpoint.*a Lightning checkpoint"):
        Classifier.load_from_checkpoint(plain, verify=False)
    with pytest.raises(FileNotFoundError):
        Classifier.load_from_checkpoint(tmp_path / "missing.pt")


@contextlib.contextmanager
def _serving(directory: Path):
    """``directory`` over HTTP on a free local port (a thread of the standard library's server): yields its URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_load_from_checkpoint_reads_an_http_url_through_torch_hubs_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # torch.hub.get_dir() follows it
    for name in ("no_proxy", "NO_PROXY"):  # the local server directly, whatever proxy the machine sets
        monkeypatch.setenv(name, "127.0.0.1")
    model = Classifier(hidden=4)
    _fit(tmp_path / "run", model)
    served = tmp_path / "served"
    served.mkdir()
    shutil.copyfile(ckpt.find_last(tmp_path / "run"), served / "model.ckpt")
    with _serving(served) as url:
        loaded = Classifier.load_from_checkpoint(f"{url}/model.ckpt")
        with pytest.raises(urllib.error.HTTPError):
            Classifier.load_from_checkpoint(f"{url}/missing.ckpt")
    torch.testing.assert_close(loaded.net[0].weight, model.net[0].weight, rtol=0, atol=0)
    cached = tmp_path / "torch_home" / "hub" / "checkpoints" / "model.ckpt"
    assert cached.read_bytes() == (served / "model.ckpt").read_bytes()
    # the server is gone: torch.hub's rule, the cached file is read without a download
    again = Classifier.load_from_checkpoint(f"{url}/model.ckpt", hidden=4)
    torch.testing.assert_close(again.net[2].bias, model.net[2].bias, rtol=0, atol=0)
    with pytest.raises(ValueError, match="s3:// URL.*local"):
        Classifier.load_from_checkpoint("s3://bucket/model.ckpt")


def test_load_from_checkpoint_reads_a_checkpoint_edited_and_saved_back_with_torch_save(tmp_path):
    model = Classifier(hidden=4, lr=0.5)
    _fit(tmp_path, model)
    path = ckpt.find_last(tmp_path)
    raw = torch.load(path, weights_only=True)
    raw["state_dict"]["net.0.bias"] = torch.full((4,), 7.0)  # the edit Lightning's docs show, saved back as a plain file
    raw["module_arguments"] = {**raw.pop("hyper_parameters"), "lr": 0.25}  # Lightning's older key of the hyperparameters
    edited = tmp_path / "edited.ckpt"
    torch.save(raw, edited)
    with pytest.warns(UserWarning, match="records no SHA-256.*loaded without verifying"):
        loaded = Classifier.load_from_checkpoint(edited)
    assert torch.equal(loaded.net[0].bias, torch.full((4,), 7.0)) and loaded.hparams.lr == 0.25
    assert loaded.hparams.hidden == 4
    damaged = bytearray(Path(path).read_bytes())  # a file that records its SHA-256 and no longer matches it
    damaged[len(damaged) // 2] ^= 0xFF
    (tmp_path / "damaged.ckpt").write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        Classifier.load_from_checkpoint(tmp_path / "damaged.ckpt")


def test_load_from_checkpoint_reads_a_checkpoint_lightning_wrote(tmp_path):
    trained = Classifier(hidden=4, lr=0.5)
    written_by_lightning = {  # the entries of a Lightning 2.x ModelCheckpoint file, saved with plain torch.save
        "epoch": 2, "global_step": 12, "pytorch-lightning_version": "2.6.6", "state_dict": trained.state_dict(),
        "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": 2}}}}, "callbacks": {},
        "optimizer_states": [], "lr_schedulers": [], "hparams_name": "kwargs",
        "hyper_parameters": {"hidden": 4, "lr": 0.5, "scores": None}}
    torch.save(written_by_lightning, tmp_path / "epoch=2-step=12.ckpt")
    with pytest.warns(UserWarning, match="records no SHA-256"):
        loaded = Classifier.load_from_checkpoint(tmp_path / "epoch=2-step=12.ckpt", lr=0.25)
    assert loaded.hparams.hidden == 4 and loaded.hparams.lr == 0.25  # the saved hyperparameters, one overridden
    for name, tensor in trained.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="written by Lightning.*load_from_checkpoint"):  # no loop state to resume
        _trainer(tmp_path / "resumed", max_epochs=1).fit(Classifier(hidden=4), DataLoader(_data(), batch_size=8),
                                                         ckpt_path=tmp_path / "epoch=2-step=12.ckpt", ckpt_verify=False)


def test_load_from_checkpoint_takes_every_form_of_torch_loads_map_location(tmp_path):
    model = Classifier(hidden=4)
    _fit(tmp_path, model)
    path = ckpt.find_last(tmp_path)
    for device in ("cpu", torch.device("cpu")):
        loaded = Classifier.load_from_checkpoint(path, map_location=device)
        torch.testing.assert_close(loaded.net[0].weight, model.net[0].weight, rtol=0, atol=0)
    # a dict maps the location each tensor was saved from ("cpu" here); the module follows its weights, as Lightning
    for moved in (Classifier.load_from_checkpoint(path, map_location={"cpu": "meta"}),
                  Classifier.load_from_checkpoint(path, map_location="meta")):
        assert {p.device.type for p in moved.parameters()} == {"meta"}
    locations = []

    def keep_here(storage, location):  # torch.load's callable form
        locations.append(location)
        return storage

    loaded = Classifier.load_from_checkpoint(path, map_location=keep_here)
    assert locations and set(locations) == {"cpu"}
    torch.testing.assert_close(loaded.net[2].bias, model.net[2].bias, rtol=0, atol=0)
    with pytest.raises(TypeError, match="map_location=3; pass a device or its name"):
        Classifier.load_from_checkpoint(path, map_location=3)
    # a sharded (DCP) checkpoint is read on the CPU, then each tensor is placed as torch.load places it
    from trainscale.checkpointing.checkpointer import _mapped

    weights = {"w": torch.ones(2)}
    assert _mapped(weights, {"cpu": "meta"})["w"].device.type == "meta" and _mapped(weights, "cpu") is weights
    locations.clear()
    torch.testing.assert_close(_mapped(weights, keep_here)["w"], weights["w"], rtol=0, atol=0)
    assert locations == ["cpu"]


# -- EarlyStopping ---------------------------------------------------------------------------------------
class _Loop:
    """What EarlyStopping reads of a Trainer (one process)."""

    def __init__(self, **config):
        self.callback_metrics, self.current_epoch, self.should_stop = {}, 0, False
        self.fitting, self.sanity_checking = True, False
        self.config = TrainerConfig(**config)
        self.fast_dev_run = self.config.fast_dev_run
        self.runtime = type("Rt", (), {"is_rank_zero": True, "rank": 0, "world_size": 1, "print": print})()


def _checks(stop: EarlyStopping, values, hook: str = "on_train_epoch_end", **config) -> _Loop:
    """Feed ``values`` one check each, as ``fit`` does; returns the loop (``current_epoch``: where it stopped)."""
    loop = _Loop(**config)
    for epoch, value in enumerate(values):
        loop.current_epoch = epoch
        loop.callback_metrics["m"] = value
        getattr(stop, hook)(loop, None)
        if loop.should_stop:
            break
    return loop


@pytest.mark.parametrize(("kwargs", "values", "epoch", "reason"), [
    ({"stopping_threshold": 0.5}, [1.0, 0.7, 0.5, 0.4, 0.3], 3, "STOPPING_THRESHOLD"),  # strictly better: 0.4
    ({"divergence_threshold": 2.0}, [1.0, 1.5, 2.0, 2.5, 0.1], 3, "DIVERGENCE_THRESHOLD"),  # strictly worse: 2.5
    ({}, [1.0, float("nan"), 0.5], 1, "NON_FINITE_METRIC"),
    ({"check_finite": False, "patience": 2}, [1.0, float("nan"), float("nan"), 0.5], 2, "PATIENCE_EXHAUSTED"),
    ({"min_delta": 0.1, "patience": 2}, [1.0, 0.95, 0.91, 0.5], 2, "PATIENCE_EXHAUSTED"),  # 0.05, 0.09 <= min_delta
    ({"mode": "max", "min_delta": 0.1, "patience": 1}, [1.0, 1.2, 1.25], 2, "PATIENCE_EXHAUSTED"),
])
def test_early_stopping_follows_lightnings_criteria(kwargs, values, epoch, reason):
    stop = EarlyStopping("m", **kwargs)
    loop = _checks(stop, values)
    assert loop.should_stop and stop.stopped_epoch == loop.current_epoch == epoch
    assert stop.stopping_reason.name == reason and stop.stopping_reason_message
    again = EarlyStopping("m", **kwargs)
    again.load_state_dict(stop.state_dict())
    assert again.state_dict() == pytest.approx(stop.state_dict(), nan_ok=True)


def test_early_stopping_strict_when_and_verbose(capsys):
    with pytest.raises(ValueError, match="monitors 'missing'.*among the metrics: m.*strict=False"):
        _checks(EarlyStopping("missing"), [1.0])
    with pytest.warns(RuntimeWarning, match="monitors 'missing'"):
        assert not _checks(EarlyStopping("missing", strict=False, verbose=True, patience=0), [1.0]).should_stop
    # validation more than once per epoch (Lightning's rule): checked at each validation end during fit only
    stop = EarlyStopping("m", patience=1)
    assert not _checks(stop, [1.0, 2.0], val_check_interval=0.5).should_stop  # epoch ends: not checked
    assert _checks(stop, [1.0, 2.0], "on_validation_end", val_check_interval=0.5).should_stop
    late = EarlyStopping("m", patience=0, check_on_train_epoch_end=False)
    late.on_fit_end(None, None)  # trainer.validate() after fit: no check
    loop = _Loop()
    loop.callback_metrics["m"] = 1.0
    late.on_validation_end(loop, None)
    assert late.wait_count == 0 and not loop.should_stop
    capsys.readouterr()
    _checks(EarlyStopping("m", patience=1, verbose=True), [1.0, 0.5, 0.7])
    out = capsys.readouterr().out
    assert "Metric m improved by 0.500 >= min_delta = 0.0. New best score: 0.500" in out and "did not improve" in out


def test_two_early_stoppings_keep_their_own_states_and_a_class_named_state_still_loads(tmp_path):
    from trainscale.callbacks import resolve_callbacks
    from trainscale.runtime.checkpoint_io import save_file

    # Lightning's keys (Callback._generate_state_key): the class name and the arguments that tell instances apart
    assert EarlyStopping("val_loss").state_key == "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}"
    assert ModelCheckpoint(monitor="val_loss", mode="max").state_key == (
        "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'max', 'every_n_train_steps': 0, 'every_n_epochs': 1, "
        "'train_time_interval': None}")
    with pytest.raises(ValueError, match="two callbacks save their state under .*EarlyStopping.*val_loss"):
        resolve_callbacks([EarlyStopping("val_loss"), EarlyStopping("val_loss", patience=9)])
    stops = [EarlyStopping("val_loss", patience=5), EarlyStopping("train_loss", mode="max", patience=5)]
    trainer = _fit(tmp_path, Classifier(hidden=4), epochs=1, callbacks=stops)
    metrics = trainer.callback_metrics
    assert [s.best_score for s in stops] == [metrics["val_loss"], metrics["train_loss"]]
    path = ckpt.find_last(tmp_path)
    resumed = [EarlyStopping("val_loss", patience=5), EarlyStopping("train_loss", mode="max", patience=5)]
    _trainer(tmp_path, callbacks=resumed).fit(Classifier(hidden=4), DataLoader(_data(), batch_size=8), ckpt_path=path)
    assert [s.best_score for s in resumed] == [s.best_score for s in stops]  # each its own
    # a checkpoint written when the key was the class name ("EarlyStopping"): still restored
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["callbacks"] = {"EarlyStopping": stops[0].state_dict()}
    old = tmp_path / "old.pt"
    save_file(checkpoint, old)
    legacy = EarlyStopping("val_loss", patience=5)
    _trainer(tmp_path, callbacks=[legacy]).fit(Classifier(hidden=4), DataLoader(_data(), batch_size=8), ckpt_path=old)
    assert legacy.best_score == stops[0].best_score


# -- the checkpoint's keys --------------------------------------------------------------------------------------
def test_a_checkpoint_file_holds_the_weights_under_state_dict_and_one_under_model_still_loads(tmp_path):
    """Lightning's checkpointing guide reads ``torch.load(path)["state_dict"]``; a file that holds them under
    ``model`` (the key trainscale wrote before) still resumes, loads and evaluates."""
    from trainscale.runtime.checkpoint_io import save_file

    model = Classifier(hidden=4)
    _fit(tmp_path / "a", model)
    path = ckpt.find_last(tmp_path / "a")
    checkpoint = torch.load(path, weights_only=True)
    assert "model" not in checkpoint and set(checkpoint["state_dict"]) == set(model.state_dict())
    plain = Classifier(hidden=4)
    plain.load_state_dict(checkpoint["state_dict"])  # the guide's way, with no trainscale call
    for key, value in model.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[key], value, rtol=0, atol=0)

    checkpoint["model"] = checkpoint.pop("state_dict")
    old = tmp_path / "old.pt"
    save_file(checkpoint, old)
    loaded = Classifier.load_from_checkpoint(old)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
    trainer = _trainer(tmp_path / "b")
    (own,) = trainer.validate(model, DataLoader(_data(8), batch_size=8), verbose=False)
    assert trainer.validate(Classifier(hidden=4), DataLoader(_data(8), batch_size=8), ckpt_path=old,
                            verbose=False) == [own]
    resumed = Classifier(hidden=4)
    _trainer(tmp_path / "b", max_epochs=2).fit(resumed, DataLoader(_data(), batch_size=8), ckpt_path=old)
    assert resumed.trainer.global_step == 4  # 2 steps per epoch: the first epoch's came from the checkpoint


# -- ModelCheckpoint in a fit ----------------------------------------------------------------------------
def test_model_checkpoint_template_and_last_ckpt_in_a_fit(tmp_path):
    callback = ModelCheckpoint(filename="{epoch}-{val_loss:.2f}", monitor="val_loss", save_top_k=1, save_last=True)
    trainer = _fit(tmp_path, Classifier(hidden=4), epochs=2, callbacks=[callback])
    ckpt_dir = trainer.run_dir / "checkpoints"
    losses = [r["val_loss"] for r in trainer.history]
    names = {f"epoch={e}-val_loss={loss:.2f}.ckpt" for e, loss in enumerate(losses)}  # Lightning's epoch: from 0
    kept = {p.name for p in ckpt_dir.glob("*.ckpt") if not p.is_symlink()}  # not the last.ckpt link
    assert kept <= names and f"epoch=1-val_loss={losses[1]:.2f}.ckpt" in kept  # the newest is always kept
    assert callback.best_model_path.endswith(f"epoch={losses.index(min(losses))}-val_loss={min(losses):.2f}.ckpt")
    last = ckpt_dir / "last.ckpt"
    assert last.resolve().name == f"epoch=1-val_loss={losses[1]:.2f}.ckpt"
    loaded = Classifier.load_from_checkpoint(last)
    assert loaded.hparams.hidden == 4 and loaded.net[0].out_features == 4
    # fit(ckpt_path=".../last.ckpt") resumes the checkpoint it names and continues that run in place
    again = _trainer(tmp_path, max_epochs=3, callbacks=[ModelCheckpoint(filename="{epoch}-{val_loss:.2f}",
                                                                        save_last=True)])
    again.fit(Classifier(hidden=4), DataLoader(_data(), batch_size=8), DataLoader(_data(8), batch_size=8),
              ckpt_path=last)
    assert again.run_dir == trainer.run_dir and len(again.history) == 3
    assert last.resolve().name.startswith("epoch=2-")


def test_last_ckpt_is_a_copy_where_the_file_system_refuses_symbolic_links(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):  # as a FUSE or SMB mount without symbolic links
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", refuse)
    callback = ModelCheckpoint(dirpath=tmp_path / "c", save_top_k=1, save_last=True)
    _fit(tmp_path, Classifier(hidden=4), epochs=2, callbacks=[callback])
    last = tmp_path / "c" / "last.ckpt"
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["epoch=1-step=4.ckpt", "last.ckpt"]
    assert not last.is_symlink() and callback.last_model_path == str(last)
    assert last.read_bytes() == Path(callback.best_model_path).read_bytes()  # the newest, its SHA-256 inside
    assert Classifier.load_from_checkpoint(last).net[0].out_features == 4


# -- profilers -----------------------------------------------------------------------------------------------------
def test_the_profiler_flag_takes_lightnings_names_or_objects():
    from trainscale.profilers import (AdvancedProfiler, PassThroughProfiler, PyTorchProfiler, SimpleProfiler,
                                      resolve_profiler)

    assert isinstance(resolve_profiler(None), PassThroughProfiler)
    for name, cls in (("simple", SimpleProfiler), ("Advanced", AdvancedProfiler), ("pytorch", PyTorchProfiler)):
        assert type(resolve_profiler(name)) is cls
    mine = SimpleProfiler(extended=False)
    assert resolve_profiler(mine) is mine
    with pytest.raises(ValueError, match="'xla' is not a profiler name; pass one of"):
        resolve_profiler("xla")
    with pytest.raises(TypeError, match="pass one of"):
        resolve_profiler(3)


def test_simple_and_advanced_profilers_report_each_action_as_lightnings(tmp_path):
    from trainscale.profilers import AdvancedProfiler, SimpleProfiler

    simple = SimpleProfiler()
    for _ in range(3):
        with simple.profile("a"):
            sum(range(1000))
    with simple.profile("b"):
        pass
    assert [len(simple.recorded_durations[k]) for k in ("a", "b")] == [3, 1]
    report = simple.summary()
    assert "Profiler Report" in report and "Mean duration (s)" in report and "Percentage %" in report
    (a_row,) = [line for line in report.splitlines() if line.count("|") > 2 and line.split("|")[1].strip() == "a"]
    assert a_row.split("|")[3].strip() == "3"  # the number of calls
    with pytest.raises(ValueError, match="which has already started"):
        simple.start("c")
        simple.start("c")
    with pytest.raises(ValueError, match="never started"):
        simple.stop("d")

    advanced = AdvancedProfiler(dirpath=tmp_path, filename="adv", dump_stats=True)
    advanced.setup("fit", local_rank=1)
    with advanced.profile("sorting"):
        sorted(range(1000), key=lambda i: -i)
    text = advanced.summary()
    assert "FIT Profiler Report" in text and "Profile stats for: sorting rank: 1" in text and "sorted" in text
    assert (tmp_path / "fit-adv-1-sorting.prof").is_file()  # Lightning's file name: stage-filename-rank-action
    advanced.describe()
    assert "Profile stats for: sorting" in (tmp_path / "fit-adv-1.txt").read_text()


@pytest.mark.timeout(60)
def test_a_fit_times_the_regions_train_step_names(tmp_path, capsys):
    trainer = _trainer(tmp_path, max_epochs=2, profiler="simple", accumulate_grad_batches=2)
    trainer.fit(Classifier(hidden=4), DataLoader(_data(), batch_size=4), DataLoader(_data(8), batch_size=8))
    calls = {k: len(v) for k, v in trainer.profiler.recorded_durations.items()}
    # 4 micro-batches of 4 per epoch, 2 per step; validation at each epoch end; a checkpoint check per step
    assert calls["training_step_and_backward"] == 8 and calls["optimizer_step"] == 4
    assert calls["validation"] == 2 and calls["checkpoint_if_due"] == 4
    assert "FIT Profiler Report" in capsys.readouterr().out  # printed at the end of fit, as Lightning


@pytest.mark.timeout(60)
def test_the_pytorch_profiler_writes_a_chrome_trace_and_an_operator_table_that_report_lists(tmp_path, monkeypatch):
    import json

    from trainscale.telemetry import report

    trainer = _trainer(tmp_path, max_epochs=1, profiler="pytorch")  # 4 steps: the 3rd and 4th are recorded
    trainer.fit(Classifier(hidden=4), DataLoader(_data(), batch_size=4))
    (trace,) = trainer.profiler.trace_paths
    assert trace == trainer.run_dir / "fit.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    regions = [e for e in events if e.get("name") == "training_step_and_backward"]
    assert len(regions) == 2 and any(e.get("name", "").startswith("aten::addmm") for e in events)
    table = (trainer.run_dir / "fit-ops.txt").read_text()
    assert "Name" in table and "CPU total" in table and "aten::" in table
    monkeypatch.setattr(report, "pyplot", lambda: None)  # the text only: no plots drawn
    _, text = report.make_report(trainer.run_dir)
    assert str(trace) in text and str(trainer.run_dir / "fit-ops.txt") in text


@pytest.mark.timeout(90)
def test_the_pytorch_profiler_on_two_ranks_writes_one_loadable_trace_per_rank(tmp_path):
    import json

    from tests import module_workers as mw
    from tests.helpers import run_distributed
    from trainscale.telemetry.report import profiler_text

    results = run_distributed(mw.pytorch_profiler_body, str(tmp_path), timeout=80)
    run_dir = Path(results[0]["run_dir"])
    assert [r["traces"] for r in results] == [[str(run_dir / f"fit-{rank}.pt.trace.json")] for rank in (0, 1)]
    for rank in (0, 1):
        events = json.loads((run_dir / f"fit-{rank}.pt.trace.json").read_text())["traceEvents"]
        assert sum(e.get("name") == "training_step_and_backward" for e in events) == 1  # the 3rd step
        assert str(run_dir / f"fit-{rank}.pt.trace.json") in profiler_text(run_dir)


# -- BaseFinetuning and the progress-bar callbacks -----------------------------------------------------------------
class Backboned(TrainingModule):
    """A backbone (with a BatchNorm) and a head; the optimizer takes the parameters that require gradients."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
        self.head = nn.Linear(6, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1)


def test_base_finetuning_freezes_before_the_optimizer_and_unfreezes_into_a_new_group(tmp_path):
    from trainscale.callbacks import BaseFinetuning

    class UnfreezeAtOne(BaseFinetuning):
        def __init__(self):
            self.groups: list[int] = []

        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.backbone, train_bn=False)

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.backbone, optimizer)  # lr: 0.1 / 10
            self.groups.append(len(optimizer.param_groups))

    model = Backboned()
    frozen = {k: v.detach().clone() for k, v in model.backbone.state_dict().items()}
    callback = UnfreezeAtOne()
    trainer = _trainer(tmp_path, max_epochs=1, callbacks=[callback], enable_checkpointing=False)
    trainer.fit(model, DataLoader(_data(), batch_size=8))
    (group,) = trainer.optimizers[0].param_groups  # the optimizer was built after the freeze: the head only
    assert {id(p) for p in group["params"]} == {id(p) for p in model.head.parameters()}
    for key, value in model.backbone.state_dict().items():  # untrained: weights and BatchNorm statistics
        torch.testing.assert_close(value, frozen[key], rtol=0, atol=0)
    assert not model.backbone[1].track_running_stats  # train_bn=False froze the BatchNorm too

    model, callback = Backboned(), UnfreezeAtOne()
    trainer = _trainer(tmp_path, max_epochs=2, callbacks=[callback], enable_checkpointing=False)
    before = model.backbone[0].weight.detach().clone()
    trainer.fit(model, DataLoader(_data(), batch_size=8))
    assert callback.groups == [1, 2]
    added = trainer.optimizers[0].param_groups[1]
    assert added["lr"] == pytest.approx(0.01) and {id(p) for p in added["params"]} == {
        id(p) for p in model.backbone.parameters()}
    assert not torch.equal(model.backbone[0].weight, before)  # trained in the second epoch
    assert list(BaseFinetuning.filter_params(model, requires_grad=False)) == []
    with pytest.warns(UserWarning, match="already exist within another group"):
        BaseFinetuning.unfreeze_and_add_param_group(model.head, trainer.optimizers[0])


def test_learning_rate_monitor_carries_one_groups_rates_on_under_pg1_once_groups_are_added(tmp_path):
    """When ``BaseFinetuning`` gives the optimizer a second param group, ``LearningRateMonitor``'s ``lr-SGD`` rates go
    on under ``lr-SGD/pg1`` (moved after the other names) and ``lr-SGD/pg2`` follows, as Lightning's ``_remap_keys``:
    no name of the single group is left behind."""
    from trainscale.callbacks import BaseFinetuning, LearningRateMonitor
    from trainscale.loggers import CSVLogger

    class UnfreezeAtOne(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.backbone)

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1 and isinstance(optimizer, torch.optim.SGD):
                self.unfreeze_and_add_param_group(pl_module.backbone, optimizer)  # lr: 0.1 / 10

    class WithAdam(Backboned):  # a second optimizer, stepped by hand, whose name stays first
        automatic_optimization = False

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()
            for opt in self.optimizers():
                opt.zero_grad()

        def configure_optimizers(self):
            sgd = torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1)
            return [sgd, torch.optim.Adam(self.head.parameters(), lr=0.5)]

    monitor = LearningRateMonitor()
    trainer = Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, max_epochs=3,
                      callbacks=[UnfreezeAtOne(), monitor], logger=CSVLogger(tmp_path), enable_checkpointing=False)
    trainer.fit(WithAdam(), DataLoader(_data(), batch_size=8))
    assert list(monitor.lrs) == ["lr-Adam", "lr-SGD/pg1", "lr-SGD/pg2"]
    assert monitor.lrs["lr-SGD/pg1"] == [0.1, 0.1, 0.1]  # one rate per epoch start, the first under lr-SGD
    assert monitor.lrs["lr-SGD/pg2"] == [pytest.approx(0.01)] * 2


def test_progress_bar_callbacks_set_the_trainers_bar(tmp_path):
    from trainscale.callbacks import RichProgressBar, TQDMProgressBar
    from trainscale.loop.progress import ProgressBar

    bar = TQDMProgressBar(refresh_rate=3)
    assert Trainer(accelerator="cpu", callbacks=[bar], default_root_dir=tmp_path).progress_bar_callback is bar
    assert isinstance(Trainer(accelerator="cpu", default_root_dir=tmp_path).progress_bar_callback, TQDMProgressBar)
    assert Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path).progress_bar_callback is None
    with pytest.raises(ValueError, match="enable_progress_bar=False"):
        Trainer(accelerator="cpu", enable_progress_bar=False, callbacks=[RichProgressBar()], default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="several progress bars"):
        Trainer(accelerator="cpu", callbacks=[bar, RichProgressBar()], default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="refresh_rate=-1"):
        TQDMProgressBar(refresh_rate=-1)
    drawn = ProgressBar(True, 10, "epoch 1", refresh_rate=3)
    if drawn._bar is None:
        pytest.skip("tqdm is not installed")
    for _ in range(7):
        drawn.update()
    assert drawn._bar.n == 6  # drawn at every 3rd micro-batch
    drawn.close()
    assert drawn._bar.n == 7
    assert ProgressBar(True, 10, "epoch 1", refresh_rate=0)._bar is None  # 0: no bar, as Lightning


class _Stream(torch.utils.data.IterableDataset):
    """Samples without end and without a length."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(4, generator=g), torch.randint(0, 3, (), generator=g)


@pytest.mark.timeout(60)
def test_the_progress_bar_callback_holds_the_training_epochs_tqdm_bar(tmp_path):
    pytest.importorskip("tqdm")
    from trainscale.callbacks import TQDMProgressBar

    trainer = Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=3, limit_val_batches=0,
                      enable_model_summary=False, default_root_dir=tmp_path / "a")
    bar = trainer.progress_bar_callback
    with pytest.raises(TypeError, match=r"The `TQDMProgressBar._train_progress_bar` reference has not been set yet"):
        bar.train_progress_bar  # noqa: B018 (before the first epoch: Lightning's error)
    trainer.fit(Classifier(8), DataLoader(_data(), batch_size=4))
    assert (bar.train_progress_bar.total, bar.train_progress_bar.n) == (3, 3)  # the last epoch's
    own = TQDMProgressBar(refresh_rate=2)
    own.train_progress_bar = bar.train_progress_bar
    copy = pickle.loads(pickle.dumps(own))  # without the tqdm bar, which holds the terminal stream
    assert copy.refresh_rate == 2
    with pytest.raises(TypeError, match="has not been set yet"):
        copy.train_progress_bar  # noqa: B018
    # an endless stream bounded by max_steps alone: the bar counts to max_steps, as Lightning's
    trainer = Trainer(accelerator="cpu", max_epochs=-1, max_steps=5, limit_val_batches=0, enable_model_summary=False,
                      default_root_dir=tmp_path / "b")
    trainer.fit(Classifier(8), DataLoader(_Stream(), batch_size=4))
    assert trainer.progress_bar_callback.train_progress_bar.total == 5
