"""Lightning's throughput tools: ``Throughput``'s rolling window against numbers worked out by hand (a made-up
clock), ``measure_flops`` against the FLOPs of a linear layer, and ``ThroughputMonitor`` in a fit, its values read
back from a ``CSVLogger``'s file. No assertion depends on how fast this machine runs."""

import csv
import warnings
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainscale.callbacks import ThroughputMonitor
from trainscale.lightning.module import TrainingModule
from trainscale.loggers import CSVLogger
from trainscale.loop.trainer import Trainer
from trainscale.telemetry import counting
from trainscale.telemetry.throughput import Throughput, compute_dtype, get_available_flops, measure_flops


def _feed(throughput, rows):
    for time, batches, samples, lengths, flops in rows:
        throughput.update(time=time, batches=batches, samples=samples, lengths=lengths, flops=flops)


def test_rates_wait_for_a_full_window_then_follow_its_ends():
    tp = Throughput(available_flops=100.0, world_size=2, window_size=3, separator="|", using_sparse_model=False)
    _feed(tp, [(0.5, 1, 3, 6, 10), (1.0, 2, 6, 12, 10)])
    assert tp.compute() == {"time": 1.0, "batches": 2, "samples": 6, "lengths": 12}  # two of three: no rates yet
    _feed(tp, [(2.0, 3, 9, 18, 10)])
    # window t = 0.5, 1.0, 2.0 (1.5 s); per device 2 batches, 6 samples, 12 items over it; FLOPs: each update's
    # 10 per device is 20 for both devices, the window's first left out: 40 FLOPs in 1.5 s
    assert tp.compute() == pytest.approx({
        "time": 2.0, "batches": 3, "samples": 9, "lengths": 18,
        "device|batches_per_sec": 2 / 1.5, "device|samples_per_sec": 6 / 1.5, "device|items_per_sec": 12 / 1.5,
        "batches_per_sec": 2 * 2 / 1.5, "samples_per_sec": 2 * 6 / 1.5, "items_per_sec": 2 * 12 / 1.5,
        "flops_per_sec": 40 / 1.5, "device|flops_per_sec": 20 / 1.5, "device|mfu": 20 / 1.5 / 100.0})
    _feed(tp, [(4.5, 4, 10, 19, 30)])
    # window t = 1.0, 2.0, 4.5 (3.5 s): 2 batches, 4 samples, 7 items; FLOPs 20 + 60 after the first
    got = tp.compute()
    assert got["device|batches_per_sec"] == pytest.approx(2 / 3.5)
    assert got["device|samples_per_sec"] == pytest.approx(4 / 3.5)
    assert got["device|items_per_sec"] == pytest.approx(7 / 3.5)
    assert got["flops_per_sec"] == pytest.approx(80 / 3.5)
    assert got["device|mfu"] == pytest.approx(40 / 3.5 / 100.0)


def test_one_device_has_no_global_rates_and_reset_forgets():
    tp = Throughput(window_size=2)
    _feed(tp, [(1.0, 1, 4, None, 7), (3.0, 2, 8, None, 7)])
    assert tp.compute() == {"time": 3.0, "batches": 2, "samples": 8, "device/batches_per_sec": 0.5,
                            "device/samples_per_sec": 2.0, "device/flops_per_sec": 3.5}  # no peak: no MFU
    tp.reset()
    tp.update(time=0.1, batches=1, samples=1)  # earlier than before: fine after reset
    assert tp.compute() == {"time": 0.1, "batches": 1, "samples": 1}


def test_sparse_models_double_the_peak_and_dense_is_said():
    with pytest.warns(UserWarning, match="MFU assumes dense model FLOPs"):
        Throughput(available_flops=100.0)
    tp = Throughput(available_flops=100.0, window_size=2, using_sparse_model=True)
    assert tp.available_flops == 200.0
    _feed(tp, [(1.0, 1, 1, None, 50), (2.0, 2, 2, None, 50)])
    assert tp.compute()["device/mfu"] == pytest.approx(50 / 200.0)


def test_throughput_refuses_values_that_do_not_grow():
    tp = Throughput(window_size=2)
    tp.update(time=1.0, batches=1, samples=2)
    with pytest.raises(ValueError, match=r"Expected the value to increase, last: 1.0, current: 1.0"):
        tp.update(time=1.0, batches=2, samples=4)
    with pytest.raises(ValueError, match=r"Expected samples \(1\) to be greater or equal than batches \(3\)"):
        Throughput().update(time=1.0, batches=3, samples=1)
    with pytest.raises(ValueError, match=r"Expected lengths \(1\) to be greater or equal than samples \(2\)"):
        Throughput().update(time=1.0, batches=1, samples=2, lengths=1)
    mixed = Throughput()
    mixed.update(time=1.0, batches=1, samples=1)
    with pytest.raises(RuntimeError, match="If lengths are passed"):
        mixed.update(time=2.0, batches=2, samples=2, lengths=4)
    for bad in ({"window_size": 1}, {"world_size": 0}, {"sparse_cuda_acceleration_factor": 0.5}):
        with pytest.raises(ValueError):
            Throughput(**bad)


def test_measure_flops_of_a_linear_layer():
    batch, n_in, n_out = 5, 8, 4
    with torch.device("meta"):
        layer = nn.Linear(n_in, n_out)
        x = torch.randn(batch, n_in, requires_grad=True)
    forward = 2 * batch * n_in * n_out  # one multiply-add per weight and sample
    assert measure_flops(layer, lambda: layer(x)) == forward
    # backward: the gradients of the input and of the weight, a matmul of the forward's size each
    assert measure_flops(layer, lambda: layer(x), lambda y: y.sum()) == 3 * forward
    assert isinstance(measure_flops(layer, lambda: layer(x)), int)


def test_measure_flops_refuses_an_incomplete_count(monkeypatch):
    def formula_that_fails(*args, **kwargs):
        raise AssertionError("shapes not understood")

    monkeypatch.setattr(counting, "flop_registry", {torch.ops.aten.addmm: formula_that_fails})
    layer = nn.Linear(3, 2)
    with pytest.raises(RuntimeError, match="could not count 1 op.*shapes not understood"):
        measure_flops(layer, lambda: layer(torch.ones(2, 3)))


def test_available_flops_from_the_table_and_the_warnings_when_unknown(monkeypatch):
    import trainscale.runtime.precision as precision

    gpu = torch.device("cuda", 0)
    assert get_available_flops(torch.device("cpu"), torch.float32) is None  # no peak for a CPU, no warning
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(precision, "tf32_enabled", lambda: (False, False))
    assert get_available_flops(gpu, torch.bfloat16) == 312e12
    assert get_available_flops(gpu, torch.float32) == 19.5e12
    monkeypatch.setattr(precision, "tf32_enabled", lambda: (True, True))  # set_float32_matmul_precision("high")
    assert get_available_flops(gpu, torch.float32) == 156e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert get_available_flops(gpu, torch.float32) == 8.1e12  # no TF32 before Ampere
    with pytest.warns(UserWarning, match=r"'Tesla T4' does not support torch.bfloat16"):
        assert get_available_flops(gpu, torch.bfloat16) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Imaginary X9")
    with pytest.warns(UserWarning, match=r"FLOPs not found for 'NVIDIA Imaginary X9'"):
        assert get_available_flops(gpu, torch.float32) is None
    assert [compute_dtype(p) for p in ("32-true", "16-mixed", "bf16-mixed", "bf16-true", "64-true")] == [
        torch.float32, torch.float16, torch.bfloat16, torch.bfloat16, torch.float64]


class Net(TrainingModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(6, 3)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.layer(batch[0]).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(n):
    return DataLoader(TensorDataset(torch.randn(n, 6)), batch_size=4)  # batches of 4, 4, ..., the rest


def _rows(logger):
    logger.save()
    with open(logger.path, newline="") as f:
        return list(csv.DictReader(f))


def test_fit_logs_the_numbers_to_the_loggers(tmp_path):
    net = Net()
    with torch.device("meta"):  # counted on a twin that holds no memory (Lightning's advice)
        twin, x = nn.Linear(6, 3), torch.randn(4, 6)
    net.flops_per_batch = measure_flops(twin, lambda: twin(x), lambda y: y.sum())
    logger = CSVLogger(tmp_path / "logs", name="")
    monitor = ThroughputMonitor(batch_size_fn=lambda b: b[0].size(0), length_fn=lambda b: b[0].numel(),
                                window_size=2)
    peak = 1e15
    Trainer(accelerator="cpu", max_epochs=2, log_every_n_steps=1, logger=logger, callbacks=[monitor],
            peak_flops=peak, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
            default_root_dir=tmp_path).fit(net, _loader(10), _loader(6))
    rows = _rows(logger)
    train = [r for r in rows if r.get("train/batches")]
    # 3 batches (4, 4, 2 samples) per epoch, one step each; the counts run on through the fit
    assert [int(r["step"]) for r in train] == [0, 1, 2, 3, 4, 5]
    assert [int(r["epoch"]) for r in train] == [0, 0, 0, 1, 1, 1]
    assert [int(r["train/batches"]) for r in train] == [1, 2, 3, 4, 5, 6]
    assert [int(r["train/samples"]) for r in train] == [4, 8, 10, 14, 18, 20]
    assert [int(r["train/lengths"]) for r in train] == [24, 48, 60, 84, 108, 120]
    assert not train[0]["train/device/samples_per_sec"]  # one reading: no window yet
    times = [float(r["train/time"]) for r in train]
    assert all(t > 0 for t in times) and times == sorted(times)
    for r, size in zip(train[1:], [4, 2, 4, 4, 2]):  # the window of 2 spans the last batch
        per_sec = {k: float(r[f"train/device/{k}_per_sec"]) for k in ("batches", "samples", "items", "flops")}
        assert per_sec["batches"] > 0
        assert per_sec["samples"] / per_sec["batches"] == pytest.approx(size)
        assert per_sec["items"] / per_sec["batches"] == pytest.approx(6 * size)
        assert per_sec["flops"] / per_sec["batches"] == pytest.approx(net.flops_per_batch)
        assert float(r["train/device/mfu"]) == pytest.approx(per_sec["flops"] / peak)
    assert "train/batches_per_sec" not in rows[0]  # one device: no global rates
    # validation (6 samples: 4, 2) after each epoch, not the sanity check; its steps count the fit's batches
    val = [r for r in rows if r.get("validate/batches")]
    assert [(int(r["step"]), int(r["validate/batches"]), int(r["validate/samples"])) for r in val] == [
        (1, 1, 4), (2, 2, 6), (3, 1, 4), (4, 2, 6)]
    assert not any(r.get("epoch") for r in val)


def test_a_fake_clock_gives_the_numbers_worked_out_by_hand(tmp_path):
    """The monitor's clock is ``time.perf_counter`` (patched here, as Lightning's tests patch it); the Trainer's own
    clocks are not, so the readings below are all the monitor's, in order."""
    logger = CSVLogger(tmp_path / "logs", name="")
    monitor = ThroughputMonitor(batch_size_fn=lambda b: b[0].size(0), window_size=2)
    net = Net()
    net.flops_per_batch = 10
    readings = [100.0,  # on_train_start
                101.0, 103.0,  # training batches 1 and 2 end
                104.0, 106.0,  # validation (val_check_interval=2) starts; its one batch ends
                110.0, 111.0,  # training batches 3 and 4 end
                112.0, 113.0]  # the epoch end's validation
    with mock.patch("time.perf_counter", side_effect=readings):
        Trainer(accelerator="cpu", max_epochs=1, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
                log_every_n_steps=1, logger=logger, callbacks=[monitor], peak_flops=100.0, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=tmp_path).fit(net, _loader(16), _loader(4))
    rows = _rows(logger)
    train = [{k: float(v) for k, v in r.items() if v and (k.startswith("train/") or k == "step")}
             for r in rows if r.get("train/batches")]
    # validation's 2 s and the 1 s gap before it leave training's clock: 100 + 3 is its start from then on
    assert train == [
        {"step": 0, "train/time": 1.0, "train/batches": 1, "train/samples": 4},
        {"step": 1, "train/time": 3.0, "train/batches": 2, "train/samples": 8, "train/device/batches_per_sec": 0.5,
         "train/device/samples_per_sec": 2.0, "train/device/flops_per_sec": 5.0, "train/device/mfu": 0.05},
        {"step": 2, "train/time": 7.0, "train/batches": 3, "train/samples": 12, "train/device/batches_per_sec": 0.25,
         "train/device/samples_per_sec": 1.0, "train/device/flops_per_sec": 2.5, "train/device/mfu": 0.025},
        {"step": 3, "train/time": 8.0, "train/batches": 4, "train/samples": 16, "train/device/batches_per_sec": 1.0,
         "train/device/samples_per_sec": 4.0, "train/device/flops_per_sec": 10.0, "train/device/mfu": 0.1}]
    val = [(int(r["step"]), float(r["validate/time"]), int(r["validate/batches"])) for r in rows
           if r.get("validate/batches")]
    assert val == [(1, 2.0, 1), (2, 1.0, 1)]


def test_accumulation_logs_at_the_step_and_log_every_n_steps_spaces_it(tmp_path):
    logger = CSVLogger(tmp_path / "logs", name="")
    monitor = ThroughputMonitor(batch_size_fn=lambda b: b[0].size(0), window_size=2, separator="|")
    net = Net()
    with pytest.warns(UserWarning, match="you need to define a `flops_per_batch` attribute or property in Net"):
        Trainer(accelerator="cpu", max_epochs=2, accumulate_grad_batches=2, log_every_n_steps=2, logger=logger,
                callbacks=[monitor], enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=tmp_path).fit(net, _loader(12))
    train = [r for r in _rows(logger) if r.get("train|batches")]
    # 3 batches per epoch: steps of 2 and 1 batch; steps 0..3, every second logged (1 and 3)
    assert [(int(r["step"]), int(r["train|batches"])) for r in train] == [(1, 3), (3, 6)]
    assert "train|device|flops_per_sec" not in train[0] and "train|device|samples_per_sec" in train[0]


def test_the_missing_flops_warning_is_said_once(tmp_path):
    monitor = ThroughputMonitor(batch_size_fn=lambda b: 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(accelerator="cpu", max_epochs=2, logger=False, callbacks=[monitor], enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=tmp_path).fit(Net(), _loader(8))
    said = [w for w in caught if "`flops_per_batch`" in str(w.message)]
    assert len(said) == 1


def test_monitor_arguments_fail_at_construction():
    with pytest.raises(TypeError, match="batch_size_fn"):
        ThroughputMonitor()  # required, as in Lightning
    with pytest.raises(ValueError, match="window_size"):
        ThroughputMonitor(batch_size_fn=len, window_size=1)
    with pytest.raises(TypeError, match="window"):
        ThroughputMonitor(batch_size_fn=len, windowsize=10)
    with pytest.raises(TypeError, match="'world_size', which the Trainer gives"):
        ThroughputMonitor(batch_size_fn=len, world_size=8)
