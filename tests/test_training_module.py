"""The Lightning-style contract: TrainingModule, self.log, configure_optimizers forms, manual
optimization, callbacks, test/predict; and the loop's records."""

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests import module_workers as mw
from tests import workers
from tests.helpers import run_distributed
from trainscale.callbacks import Callback, EarlyStopping, ModelCheckpoint
from trainscale.checkpointing import run_dirs as ckpt
from trainscale.lightning.module import TrainingModule
from trainscale.lightning.optimizers import parse_optimization
from trainscale.loop.trainer import Trainer


def _trainer(tmp_path, **kw):
    return Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, **{"max_epochs": 1, **kw})


# -- configure_optimizers ---------------------------------------------------------------------------
def _opt():
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)


def test_every_lightning_configure_optimizers_form():
    opt, opt2 = _opt(), _opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    assert parse_optimization(opt).optimizers == (opt,)
    assert parse_optimization((opt, sched)).schedulers[0].scheduler is sched
    form = parse_optimization(([opt], [sched]))
    assert form.optimizers == (opt,) and form.schedulers[0].interval == "epoch"
    form = parse_optimization({"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 2}})
    assert form.schedulers[0].interval == "step" and form.schedulers[0].frequency == 2
    form = parse_optimization({"optimizer": opt, "lr_scheduler": plateau, "monitor": "val_loss"})
    assert form.schedulers[0].monitor == "val_loss"
    form = parse_optimization([{"optimizer": opt}, {"optimizer": opt2, "lr_scheduler": sched}])
    assert form.optimizers == (opt, opt2) and len(form.schedulers) == 1
    assert parse_optimization([opt, opt2]).optimizers == (opt, opt2)
    with pytest.raises(ValueError, match="must include a monitor when a `ReduceLROnPlateau`"):
        parse_optimization({"optimizer": opt, "lr_scheduler": plateau})
    with pytest.raises(ValueError, match="must be \"step\" or \"epoch\", not 'hour'"):
        parse_optimization({"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "hour"}})
    with pytest.raises(ValueError, match="return an optimizer"):
        parse_optimization("adam")


class TwoOptimizers(mw.LitClassifier):
    def configure_optimizers(self):
        return [workers.sgd(self.net.parameters()), torch.optim.Adam(self.net.parameters())]


def test_a_second_optimizer_without_manual_optimization_is_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="automatic_optimization = False.*returned 2 optimizers"):
        _trainer(tmp_path).fit(TwoOptimizers(), DataLoader(workers.tiny_dataset(16), batch_size=8))


def test_optimizer_built_on_another_model_is_an_error(tmp_path):
    other = workers.make_model()
    with pytest.raises(ValueError, match="not the model's"):
        _trainer(tmp_path).fit(workers.make_model(), DataLoader(workers.tiny_dataset(16), batch_size=8),
                               optimizer=lambda params: workers.sgd(other.parameters()))


def test_loss_fn_with_training_step_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="loss_fn was given, but LitClassifier defines training_step"):
        _trainer(tmp_path).fit(mw.LitClassifier(), DataLoader(workers.tiny_dataset(16), batch_size=8),
                               loss_fn=F.cross_entropy)


def test_plain_module_with_a_dict_batch_names_training_step(tmp_path):
    data = [{"x": torch.randn(1, 28, 28), "y": torch.tensor(0)} for _ in range(4)]
    with pytest.raises(TypeError, match="a dict with keys \\['x', 'y'\\].*define training_step"):
        _trainer(tmp_path).fit(workers.make_model(), DataLoader(data, batch_size=4), optimizer=workers.sgd)


def test_a_loader_without_batch_size_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="batch_size=None.*DataLoader\\(dataset, batch_size=N\\)"):
        _trainer(tmp_path).fit(workers.make_model(), DataLoader(workers.tiny_dataset(8), batch_size=None),
                               optimizer=workers.sgd)


def test_an_empty_train_loader_is_refused(tmp_path):
    with pytest.raises(ValueError, match="the training DataLoader is empty"):
        _trainer(tmp_path).fit(workers.make_model(), DataLoader(workers.tiny_dataset(0), batch_size=4),
                               optimizer=workers.sgd)


def test_resuming_adam_with_sgd_names_both(tmp_path):
    model = workers.make_model()
    loader = DataLoader(workers.tiny_dataset(16), batch_size=8)
    _trainer(tmp_path).fit(model, loader, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    with pytest.raises(ValueError, match="trained with optimizer\\(s\\) Adam but SGD is configured"):
        _trainer(tmp_path, max_epochs=2).fit(workers.make_model(), loader, optimizer=workers.sgd, ckpt_path="last")


# -- the module contract in one process -----------------------------------------------------------------
class Recorder(TrainingModule):
    def __init__(self, plateau: bool = False):
        super().__init__()
        self.net = nn.Linear(1, 2)
        self.seen: list[int] = []
        self.plateau = plateau

    def training_step(self, batch, batch_idx):
        self.seen.append(batch_idx)
        assert self.trainer.global_step == self.global_step and self.device.type == "cpu"
        x, y = batch
        return {"loss": F.cross_entropy(self.net(x), y), "other": 1}

    def validation_step(self, batch, batch_idx):
        self.log("const", 1.0)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if not self.plateau:
            return opt
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "const"}}


def test_training_step_gets_batch_idx_and_may_return_a_dict(tmp_path):
    model = Recorder()
    _trainer(tmp_path, max_epochs=2).fit(model, DataLoader(mw.indexed_dataset(12), batch_size=4))
    assert model.seen == [0, 1, 2, 0, 1, 2]


def test_reduce_lr_on_plateau_steps_on_the_monitored_metric_and_every_lr_is_logged(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=3)
    trainer.fit(Recorder(plateau=True), DataLoader(mw.indexed_dataset(12), batch_size=4),
                DataLoader(mw.indexed_dataset(6), batch_size=4))
    assert [r["lr-SGD"] for r in trainer.history] == [0.1, 0.1, 0.05]  # "const" never improves after epoch 1


def test_lightning_module_on_two_ranks_matches_plain_pytorch(tmp_path):
    ranks = run_distributed(mw.lit_body, str(tmp_path), timeout=180)
    ref = workers.plain_pytorch_reference(16, 2)  # 2 ranks × 8 = one process at 16
    for key, value in ref.items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=1e-5, atol=1e-6)
    record = ranks[0]["history"][-1]
    untimed = [[{k: v for k, v in r.items() if k not in ("epoch_time_s", "samples_per_s")} for r in rank["history"]]
               for rank in ranks]
    assert untimed[0] == untimed[1]  # the same reduced numbers on both ranks
    assert {"val_loss", "val_acc", "lr-SGD"} <= record.keys()
    # the ddp run's last checkpoint file, loaded in this plain process (no process group): the trained weights
    loaded = mw.LitClassifier.load_from_checkpoint(ckpt.find_last(tmp_path))
    for key, value in ranks[0]["state"].items():
        torch.testing.assert_close(loaded.net.state_dict()[key], value, rtol=0, atol=0)


# -- self.log reduction ---------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_self_log_counts_each_sample_once_with_uneven_last_batches(strategy):
    """Under fsdp the rank with fewer batches runs extra forwards (the collectives must match), whose results and
    logs are dropped (before the fix the count read 13: rank 1's extra forward of a batch of 4 was logged). Under
    ddp a torchmetrics Metric logged as such is computed over every rank's states."""
    n = 37 if strategy == "ddp" else 9  # ddp: rank 0 holds 19 samples (batches 4,4,4,4,3), rank 1 18 (4,4,4,4,2)
    metric = strategy == "ddp"  # a torchmetrics Metric too (its fsdp path: test_lightning_compat's metric tests)
    out = run_distributed(mw.log_reduction_body, n, None, strategy, metric, timeout=120)  # fsdp: batches of 4, 5 and 4
    assert out[0] == out[1]
    assert out[0]["mean_x"] == pytest.approx((n - 1) / 2)  # mean of 0..36, each sample once
    assert out[0]["count"] == n and out[0]["max_x"] == n - 1
    if metric:
        assert out[0]["metric_mean_x"] == pytest.approx((n - 1) / 2)  # compute() over every rank's states
    assert mw.log_reduction_body(0, n, None, "auto", metric) == out[0]  # one process: the same numbers


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_self_log_sums_count_each_sample_once_under_tensor_parallelism():
    # the 2 tp ranks read the same 21 samples: a sum over all ranks would count each twice
    n = 21
    out = run_distributed(mw.tp_log_reduction_body, n, timeout=150)
    assert out[0] == out[1]
    assert out[0]["count"] == n and out[0]["count"] == mw.log_reduction_body(0, n)["count"]
    assert out[0]["mean_x"] == pytest.approx((n - 1) / 2) and out[0]["max_x"] == n - 1


class _LogsReservedName(TrainingModule):
    def __init__(self, name: str, stage: str):
        super().__init__()
        self.lin, self.name, self.stage = nn.Linear(1, 2), name, stage

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.stage == "train":
            self.log(self.name, 1.0)
        return F.cross_entropy(self.lin(x), y)

    def validation_step(self, batch, batch_idx):
        self.log(self.name, 1.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("name, stage", [("step", "train"), ("epoch", "train"), ("epoch", "validation"),
                                         ("lr-SGD", "train"), ("samples_per_s", "train"), ("epoch_time_s", "validation")])
def test_self_log_of_a_records_own_field_names_the_alternative(tmp_path, name, stage):
    loader = DataLoader(mw.indexed_dataset(8), batch_size=4)
    with pytest.raises(ValueError, match=rf"self.log\('{name}', ...\): trainscale's records already hold '{name}'"
                                         rf".*'my_{name}'"):
        _trainer(tmp_path, enable_checkpointing=False).fit(_LogsReservedName(name, stage), loader, loader)


def test_every_field_of_the_runs_own_records_and_summary_is_reserved_but_the_losses(tmp_path):
    """A value logged under a field the step or epoch records (or summary.json) already hold would replace the
    learning rate, the throughput or the epoch time that `report`, `check` and `bench` read: each such name is
    refused. The losses stay free: a module's own train_loss/val_loss is what a Lightning user logs."""
    import json

    from trainscale.lightning.metrics import RESERVED, RESERVED_PREFIXES

    loader = DataLoader(mw.indexed_dataset(8), batch_size=4)
    trainer = _trainer(tmp_path, enable_checkpointing=False, log_every_n_steps=1)
    trainer.fit(_LogsReservedName("mine", "train"), loader, loader)
    fields = set()
    for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines():
        fields.update(json.loads(line))
    fields |= set(json.loads((trainer.run_dir / "summary.json").read_text())["telemetry"] or {})
    free = {"train_loss", "val_loss", "val_accuracy", "mine"}
    unreserved = {f for f in fields - free if f not in RESERVED and not f.startswith(tuple(RESERVED_PREFIXES))}
    assert "lr-SGD" in fields and "samples_per_s" in fields and unreserved == set()


def test_names_logged_on_some_ranks_only_are_an_error_on_every_rank():
    out = run_distributed(mw.log_reduction_body, 16, 1, timeout=120)
    for message in out:
        assert message.startswith("ValueError: ranks logged different epoch values") and "only_here" in message


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_sync_dist_or_manual_backward_on_some_ranks_only_is_an_error_on_every_rank_naming_them(tmp_path):
    """Under ddp and fsdp. Both stalled until the collective timeout (sync_dist: reported as "a transient stall")
    or aborted the job (a skipped manual_backward: SIGABRT inside gloo, "collective mismatch"; under fsdp at the
    next forward's all-gather, which met the other rank's reduce-scatter of its backward)."""
    out = run_distributed(mw.rank_mismatch_body, str(tmp_path), timeout=80)
    assert out[0] == out[1]  # every rank raises the same error
    for prefix in ("", "fsdp/"):
        assert out[0][f"{prefix}sync_dist"].startswith("ValueError: self.log('acc', ..., sync_dist=True) was called on "
                                                       "rank(s) [1] and not on rank(s) [0]")
    assert out[0]["manual_backward"].startswith("RuntimeError: SGD.step(): rank(s) [1] have no gradients while the "
                                                "other ranks have theirs: self.manual_backward(loss) was skipped there")
    assert out[0]["fsdp/manual_backward"].startswith("RuntimeError: self.manual_backward(loss) was called on rank(s) "
                                                     "[0] and not on rank(s) [1] before their opt.step()")


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_sync_dist_step_values_are_reduced_with_their_reduce_fx_and_reach_callback_metrics_by_the_epoch_end(tmp_path):
    """Lightning's sync_dist reduces with the value's reduce_fx (a "sum" of rank + 1 over 2 ranks is 3, not the
    mean 1.5); a fit whose last step is not a log step still ends with the reduced values in callback_metrics."""
    for every in (1, 50):  # each step a log step; none
        out = run_distributed(mw.sync_dist_steps_body, str(tmp_path / str(every)), every, timeout=80)
        for rank, metrics in enumerate(out):
            assert metrics == {"by_sum": 3.0, "by_mean": 1.5, "by_max": 2.0, "own_rank": float(rank)}


def _returned_keys_expected(n: int, world_size: int) -> tuple[float, float]:
    """The exact "mean_x" and "odd_x" of :class:`mw.Returner` on ``indexed_dataset(n)`` (x = sample index) split
    like the evaluation sampler (rank r: samples r, r + W, ...) into batches of 4."""
    odd = []
    for rank in range(world_size):
        samples = list(range(rank, n, world_size))
        odd += [x for b in range(1, (len(samples) + 3) // 4, 2) for x in samples[4 * b: 4 * b + 4]]
    return (n - 1) / 2, sum(odd) / len(odd)


@pytest.mark.timeout(60)
def test_returned_keys_and_predicted_dicts_keep_dataset_order_and_exact_means_on_two_ranks(tmp_path):
    """``predict_step`` returning a dict comes back in dataset order; a ``validation_step`` key returned by some
    batches only is recorded as the mean over those batches' samples (``validate`` returns only logged values,
    as Lightning's); a key returned on one rank only is an error on every rank naming it (as names logged with
    ``self.log`` on some ranks only)."""
    n = 22
    mean_x, odd_x = _returned_keys_expected(n, 2)
    assert odd_x != pytest.approx(mean_x)  # the batches that return "odd_x" are not a fair sample of all
    for out in run_distributed(mw.returned_keys_body, n, str(tmp_path), timeout=50):
        assert out["recorded"]["val_mean_x"] == pytest.approx(mean_x)
        assert out["recorded"]["val_odd_x"] == pytest.approx(odd_x)
        assert out["validated"] == {}
        batches = out["predicted"]  # Lightning's per-batch list: every sample in dataset order, 4 per batch
        assert [len(b["names"]) for b in batches] == [4, 4, 4, 4, 4, 2]
        predicted = {key: [b[key] for b in batches] for key in batches[0]}
        predicted = {"index": torch.cat(predicted["index"]), "doubled": torch.cat(predicted["doubled"]),
                     "names": [name for names in predicted["names"] for name in names]}
        assert predicted["index"].tolist() == list(range(n))
        torch.testing.assert_close(predicted["doubled"], 2 * torch.arange(n, dtype=torch.float32).reshape(n, 1))
        assert predicted["names"] == [f"s{i}" for i in range(n)]
        assert "validation_step returned keys on some ranks only ('only_here' not on rank(s) 0)" in out["error"]


def test_a_key_returned_by_some_batches_is_averaged_over_those_batches_in_one_process(tmp_path):
    out = mw.returned_keys_body(0, 22, str(tmp_path))
    mean_x, odd_x = _returned_keys_expected(22, 1)
    assert out["recorded"]["val_mean_x"] == pytest.approx(mean_x)
    assert out["recorded"]["val_odd_x"] == pytest.approx(odd_x)
    assert out["validated"] == {}  # returned, not logged: in the records only, as Lightning's validate()
    predicted = out["predicted"]  # as predict_step returned each batch (Lightning's)
    assert torch.cat([b["index"] for b in predicted]).tolist() == list(range(22))
    assert predicted[0]["names"][:2] == ["s0", "s1"]


# -- manual optimization -----------------------------------------------------------------------------------
def test_gan_with_manual_optimization_and_accumulation_matches_plain_pytorch(tmp_path):
    single = mw.gan_body(0, str(tmp_path / "one"), 8, 2)
    ref = mw.gan_reference(8, 2)
    for key, value in ref.items():
        torch.testing.assert_close(single[key], value, rtol=1e-5, atol=1e-6)


class _ForgetsManualBackward(TrainingModule):
    automatic_optimization = False

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        F.cross_entropy(self.lin(x), y)  # the loss, but no self.manual_backward(loss)
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_optimizer_step_without_manual_backward_warns_once(recwarn, tmp_path):
    from trainscale.loop.trainer import Trainer

    model = _ForgetsManualBackward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Trainer(accelerator="cpu", devices=1, max_epochs=1, enable_progress_bar=False, enable_checkpointing=False,
            default_root_dir=tmp_path).fit(model, DataLoader(mw.indexed_dataset(12), batch_size=4))
    warned = [w for w in recwarn if "with no gradients" in str(w.message)]
    assert len(warned) == 1 and "SGD.step() on rank 0" in str(warned[0].message)  # 3 steps, one warning
    assert "self.manual_backward(loss)" in str(warned[0].message)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_clip_gradients_clips_each_optimizers_gradients_by_their_norm(tmp_path):
    single = mw.gan_body(0, str(tmp_path / "one"), 8, 2, mw.ClippedGAN)
    for key, value in mw.gan_reference(8, 2, clip=mw.CLIP).items():
        torch.testing.assert_close(single[key], value, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(single[k], v) for k, v in mw.gan_reference(8, 2).items())  # clipping mattered


def test_gradient_clip_val_under_manual_optimization_is_an_error_naming_clip_gradients(tmp_path):
    trainer = _trainer(tmp_path, gradient_clip_val=1.0)
    with pytest.raises(ValueError, match=r"Automatic gradient clipping is not supported for manual optimization.*self.clip_gradients"):
        trainer.fit(mw.GAN(), DataLoader(mw.gan_dataset(), batch_size=8))


@pytest.mark.parametrize("strategy, cause", [("dp", "DataParallel's per-device replicas"),
                                              ("pp", "a pipeline schedule")])
def test_manual_optimization_under_dp_or_pp_is_an_error_naming_the_strategies_that_host_it(strategy, cause):
    from types import SimpleNamespace

    from trainscale.lightning.optimizer_setup import check_optimizers
    from trainscale.runtime.strategies import STRATEGY_CLASSES

    model = mw.GAN()
    # the strategy's class answers what the check asks (manual_optimization_refusal is a class attribute)
    runtime = SimpleNamespace(config=SimpleNamespace(strategy=strategy, parallel=None),
                              strategy=STRATEGY_CLASSES[strategy])
    config = SimpleNamespace(accumulate_grad_batches=1, gradient_clip_val=None)
    optimization = parse_optimization(model.configure_optimizers())
    with pytest.raises(ValueError, match=rf"strategy='{strategy}'.*{cause}.*use 'ddp', 'fsdp', 'hsdp' or 'tp'"):
        check_optimizers(optimization, model, True, config, runtime)


def test_gan_under_ddp_needs_no_find_unused_parameters(tmp_path):
    ranks = run_distributed(mw.ddp_gans_body, str(tmp_path), timeout=180)  # 2 ranks × 4 = one process at 8
    refs = {"GAN": mw.gan_reference(8, 2), "ClippedGAN": mw.gan_reference(8, 2, clip=mw.CLIP)}
    for out in ranks:  # ClippedGAN: clip_gradients averages the ranks' gradients before taking their norm
        for run, ref in refs.items():
            for key, value in ref.items():
                torch.testing.assert_close(out[run][key], value, rtol=1e-5, atol=1e-6, msg=f"{run} {key}")


MICRO_BATCHES = 2 * 32 // 8  # 2 epochs of 32 samples, 8 per micro-batch (2 ranks × 4)
STEPS = MICRO_BATCHES // mw.ACCUMULATE


@pytest.mark.timeout(300)
def test_gan_under_fsdp_matches_plain_pytorch_and_reduce_scatters_on_the_boundary_only(tmp_path):
    """fsdp, 2 processes: generator and discriminator each sharded; the same weights as one plain process."""
    ranks = run_distributed(mw.fsdp_gan_body, str(tmp_path), timeout=280)
    ref = mw.gan_reference(8, 2)
    discriminator = mw.make_gan()[1]
    discriminator.load_state_dict({k.removeprefix("discriminator."): v for k, v in ref.items() if "discr" in k})
    d_real = discriminator(mw.gan_dataset(8).tensors[1]).mean().item()
    for out in ranks:
        for run in ("sync", "toggle", "resumed"):  # resumed: 1 epoch, then the second from its checkpoint
            assert out[run].keys() == ref.keys() | {"d_real"}
            assert out[run]["d_real"] == pytest.approx(d_real, rel=1e-5)  # validation after training
            for key, value in ref.items():
                torch.testing.assert_close(out[run][key], value, rtol=1e-5, atol=1e-6, msg=f"{run} {key}")
        # one reduce-scatter of the discriminator's and one of the generator's gradients per optimizer step:
        # toggle_model(sync_grad=False) holds them back on the other micro-batches; without it, every backward
        # reduce-scatters (correct weights, twice the communication here)
        for key, value in mw.gan_reference(8, 2, clip=mw.CLIP).items():  # self.clip_gradients: the full norm
            torch.testing.assert_close(out["clipped"][key], value, rtol=1e-5, atol=1e-6, msg=f"clipped {key}")
        assert out["sync_reduce_scatters"] == 2 * STEPS
        assert out["toggle_reduce_scatters"] == 2 * MICRO_BATCHES
        assert "holds scale itself" in out["own_parameter"] and "move them into a submodule" in out["own_parameter"]
    # the fsdp run's last checkpoint, a sharded (DCP) directory, loaded whole in this plain process with its
    # saved hyperparameters (and one replaced)
    last = ckpt.find_last(tmp_path / "sync")
    assert last.is_dir()
    loaded = mw.SyncGAN.load_from_checkpoint(last, momentum=0.9)
    assert dict(loaded.hparams) == {"momentum": 0.9}
    assert dict(mw.SyncGAN.load_from_checkpoint(last).hparams) == {"momentum": 0.5}
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, ranks[0]["sync"][key], rtol=0, atol=0, msg=key)


@pytest.mark.timeout(240)
def test_gan_on_a_device_mesh_and_under_fsdp_16_mixed_matches_plain_pytorch(tmp_path):
    """Manual optimization, 2 processes: dp_shard 2 (global batch 8) and tp 2 (one data-parallel rank, global
    batch 4) each end at the weights of one plain float32 process over the same samples; fsdp with "16-mixed"
    within float16's rounding of them (a step on gradients left scaled by the GradScaler's 65536 lands far off)."""
    ranks = run_distributed(mw.mesh_gan_body, str(tmp_path), timeout=220)
    for name, global_batch in (("dp_shard", 8), ("tp", 4), ("fsdp-16-mixed", 8)):
        ref = mw.gan_reference(global_batch, 2)
        tolerance = dict(rtol=0, atol=2e-4) if name == "fsdp-16-mixed" else dict(rtol=1e-5, atol=1e-6)
        for out in ranks:
            assert out[name].keys() == ref.keys() | {"d_real"}
            for key, value in ref.items():
                torch.testing.assert_close(out[name][key], value, **tolerance, msg=f"{name} {key}")
    half = ranks[0]["fsdp-16-mixed"]
    assert max((half[k] - v).abs().max().item() for k, v in mw.gan_reference(8, 2).items()) > 1e-6  # float16 ran


# -- callbacks ---------------------------------------------------------------------------------------------
def test_early_stopping_stops_both_ranks_on_the_same_epoch(tmp_path):
    ranks = run_distributed(mw.early_stopping_body, str(tmp_path), timeout=180)
    # mean_x is the same every epoch: the first epoch sets the best, the second does not improve on it, and
    # Lightning's rule (wait_count >= patience) with patience 1 stops after it; current_epoch then counts the two
    # completed epochs, as Lightning's; rank zero says once that the sequential loader keeps its order
    assert ranks == [(2, 1, 2, True), (2, 1, 2, False)]


class Scored(TrainingModule):
    """Logs the score of its epoch in ``validation_step`` (and nothing else trains)."""

    def __init__(self, scores):
        super().__init__()
        self.scores = scores
        self.lin = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        return self.lin(batch[0][:, :1].float()).sum() * 0

    def validation_step(self, batch, batch_idx):
        self.log("score", self.scores[self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "sign"), [("min", 1.0), ("max", -1.0)])
def test_early_stopping_stops_on_the_epoch_lightnings_rule_gives(tmp_path, mode, sign):
    # Lightning's EarlyStopping._evaluate_stopping_criteria: an improvement resets wait_count to 0, any other
    # check adds 1, and training stops when wait_count >= patience. Scores 5, 3, 4, 1, 2, 2 with patience 2:
    # best 5, 3 (epochs 0, 1), wait 1 (epoch 2), best 1 (epoch 3), wait 1, 2 (epochs 4, 5): the last epoch
    # trained is epoch 5, 6 epochs in all (a rule of wait > patience would train a 7th).
    scores = [sign * v for v in (5.0, 3.0, 4.0, 1.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0)]
    stop = EarlyStopping("score", mode=mode, patience=2)
    trainer = _trainer(tmp_path, max_epochs=10, callbacks=[stop], enable_checkpointing=False)
    trainer.fit(Scored(scores), DataLoader(mw.indexed_dataset(4), batch_size=4), DataLoader(mw.indexed_dataset(2)))
    assert len(trainer.history) == 6 and stop.stopped_epoch == 5
    assert stop.best_score == sign * 1.0 and stop.wait_count == 2


class EpochMetric(Recorder):
    SCORES = [5.0, 3.0, 4.0, 1.0, 2.0]

    def validation_step(self, batch, batch_idx):
        self.log("score", self.SCORES[self.current_epoch])


def test_model_checkpoint_keeps_the_top_k_by_the_monitored_metric(tmp_path):
    callback = ModelCheckpoint(monitor="score", save_top_k=2)
    trainer = _trainer(tmp_path, max_epochs=5, callbacks=[callback])
    trainer.fit(EpochMetric(), DataLoader(mw.indexed_dataset(8), batch_size=4), DataLoader(mw.indexed_dataset(4)))
    kept = sorted(p.name for p in (trainer.run_dir / "checkpoints").glob("*.ckpt"))
    # scores 5, 3, 4, 1, 2 at the ends of epochs 0..4: the best two are kept (the newest is also "last")
    assert kept == ["epoch=3-step=8.ckpt", "epoch=4-step=10.ckpt"]
    assert callback.best_model_path.endswith("epoch=3-step=8.ckpt")
    assert (trainer.run_dir / "checkpoints" / "last").read_text().strip() == "epoch=4-step=10.ckpt"
    assert trainer.checkpoints.summary()["saves"] == 5  # one checkpoint per epoch end: the callback is the only writer


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_validate_and_predict_evaluate_the_best_and_the_last_checkpoint_on_two_ranks(tmp_path, strategy):
    """Lightning's ``trainer.validate(model, loader, ckpt_path="best")``: the weights of the ModelCheckpoint's best
    (the lowest val_loss), loaded into the model on both ranks (ddp: one file; fsdp: a sharded DCP directory);
    "last": the final epoch's checkpoint, whose predictions equal the fitted model's."""
    ranks = run_distributed(mw.evaluate_checkpoint_body, str(tmp_path), strategy, timeout=240)
    history = ranks[0]["history"]
    best = history.index(min(history))
    assert best < len(history) - 1  # the best is not the fitted weights: loading it changes the model
    assert f"epoch={best}-step=" in ranks[0]["best_path"] and ranks[1]["best_path"] == ranks[0]["best_path"]
    for r in ranks:
        assert r["own"] == pytest.approx(history[-1], rel=1e-6)  # without ckpt_path: the fitted weights
        assert r["best"] == pytest.approx(history[best], rel=1e-6)  # with it: the best epoch's
    for name, value in ranks[0]["best_weights"].items():
        torch.testing.assert_close(ranks[1]["best_weights"][name], value, rtol=0, atol=0)
    predictions = ranks[0]["last_predictions"]
    assert predictions.shape == (20, 10) and torch.equal(ranks[1]["last_predictions"], predictions)
    assert any(not torch.equal(ranks[0]["last_weights"][k], v) for k, v in ranks[0]["best_weights"].items())


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_ranking_of_a_monitored_save_is_rank_zeros_on_every_rank(tmp_path):
    """Values logged per step differ by rank; a checkpoint ranks by rank zero's value on both ranks, so they agree
    on whether it enters the top k (none waits at a save the other skips) and on ``best_model_path``."""
    import os

    ranks = run_distributed(mw.top_k_decision_body, str(tmp_path), timeout=150)
    steps = int(ranks[0][0])  # 16 samples, 2 ranks, batch 2: 4 steps, each better on rank zero
    assert ranks[0] == ranks[1] == [str(steps), f"step={steps}.ckpt"]
    assert os.listdir(tmp_path / "ckpts") == [f"step={steps}.ckpt"]


def test_ckpt_path_of_an_evaluation_is_checked_before_anything_runs(tmp_path):
    model, loader = mw.Logger(), DataLoader(mw.indexed_dataset(4))
    with pytest.raises(ValueError, match=r'`.validate\(ckpt_path="best"\)` is set but `ModelCheckpoint` is not '
                                         r"configured to save the best model \(it has saved no checkpoint: fit first\)"):
        _trainer(tmp_path).validate(model, loader, ckpt_path="best")
    with pytest.raises(ValueError, match=r'`.test\(ckpt_path="best"\)` is set but `ModelCheckpoint` is not '
                                         "configured: add one"):
        _trainer(tmp_path, enable_checkpointing=False).test(model, loader, ckpt_path="best")
    # "last" before any run has a checkpoint: Lightning's warning, and the model's own weights (not an error)
    with pytest.warns(UserWarning, match=r'.validate\(ckpt_path="last"\) is set, but there is no last checkpoint '
                                         r"available .* No checkpoint will be loaded"):
        assert _trainer(tmp_path / "empty").validate(model, loader, ckpt_path="last", verbose=False)
    with pytest.raises(FileNotFoundError, match="does not exist; pass an existing checkpoint, 'best', 'last' or None"):
        _trainer(tmp_path).predict(model, loader, ckpt_path=tmp_path / "nope.pt")
    with pytest.raises(ValueError, match="pass a checkpoint path, 'best', 'last' or None"):
        _trainer(tmp_path).validate(model, loader, ckpt_path=3)


class Counting(Callback):
    def __init__(self):
        self.calls: dict[str, int] = {}
        self.total = 0

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def on_fit_start(self, trainer, module):
        self._count("fit_start")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._count("batch_end")
        self.total += 1

    def on_train_epoch_end(self, trainer, module):
        self._count("epoch_end")

    def on_validation_end(self, trainer, module):
        self._count("validation_end")

    def on_fit_end(self, trainer, module):
        self._count("fit_end")

    def state_dict(self):
        return {"total": self.total}

    def load_state_dict(self, state):
        self.total = state["total"]


def test_callback_hooks_run_and_their_state_survives_a_resume(tmp_path):
    first, stop = Counting(), EarlyStopping("const", patience=5)
    loader, val = DataLoader(mw.indexed_dataset(12), batch_size=4), DataLoader(mw.indexed_dataset(4))
    _trainer(tmp_path, max_epochs=2, callbacks=[first, stop]).fit(Recorder(), loader, val)
    # validation ends: the sanity check's (num_sanity_val_steps=2, as Lightning), then one per epoch
    assert first.calls == {"fit_start": 1, "batch_end": 6, "epoch_end": 2, "validation_end": 1 + 2, "fit_end": 1}
    again, stop_again = Counting(), EarlyStopping("const", patience=5)
    _trainer(tmp_path, max_epochs=3, callbacks=[again, stop_again]).fit(Recorder(), loader, val, ckpt_path="last")
    assert again.total == 6 + 3  # restored 6, then one more epoch of 3 batches
    assert stop_again.wait_count == stop.wait_count + 1 and stop_again.best_score == stop.best_score == 1.0


# -- test() and predict() -------------------------------------------------------------------------------------
def test_test_uses_test_step_and_its_prefix(tmp_path):
    class WithTest(Recorder):
        def test_step(self, batch, batch_idx):
            self.log("test_loss", torch.tensor(2.0))
            return {"returned": torch.tensor(1.0)}  # not logged: not in test()'s results (Lightning's)

    out = _trainer(tmp_path).test(WithTest(), DataLoader(mw.indexed_dataset(5), batch_size=2))
    assert out == [{"test_loss": pytest.approx(2.0)}]


def test_predict_gathers_every_sample_once_in_dataset_order():
    n = 37
    out = run_distributed(mw.predict_body, n, timeout=120)
    x, _ = workers.tiny_dataset(n, seed=3).tensors
    with torch.no_grad():
        expected = workers.make_model(0)(x)
    for ranked in out:
        assert ranked.shape == (n, 10)
        torch.testing.assert_close(ranked, expected, rtol=1e-5, atol=1e-6)


# -- tokens ------------------------------------------------------------------------------------------------------
class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 16)

    def forward(self, idx):  # (B, T) -> (B, T, V)
        return self.emb(idx)


def test_tokens_per_second_for_token_id_batches(tmp_path):
    ids = torch.randint(0, 16, (8, 5))
    trainer = _trainer(tmp_path)
    trainer.fit(TinyLM(), DataLoader(TensorDataset(ids, ids), batch_size=4),
                loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()), optimizer=workers.sgd)
    record = trainer.history[-1]
    assert record["tokens_per_s"] == pytest.approx(40 / record["epoch_time_s"])


# -- records and run directories after a resume ---------------------------------------------------------------
def test_records_after_a_resume_equal_an_uninterrupted_run(tmp_path):
    loader = DataLoader(workers.tiny_dataset(48), batch_size=8, shuffle=True)
    full = _trainer(tmp_path / "full", max_epochs=2)
    full_model = workers.make_model()
    full.fit(full_model, loader, optimizer=workers.sgd)
    _trainer(tmp_path / "cut", max_epochs=2, max_steps=4).fit(workers.make_model(), loader, optimizer=workers.sgd)
    resumed = _trainer(tmp_path / "cut", max_epochs=2)
    model = workers.make_model()
    summary = resumed.fit(model, loader, optimizer=workers.sgd, ckpt_path="last")
    assert summary["epochs"] == 2 and [r["epoch"] for r in resumed.history] == [0, 1]
    for got, want in zip(resumed.history, full.history):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5) and "partial" not in got
    for a, b in zip(model.parameters(), full_model.parameters()):
        torch.testing.assert_close(a, b)


def test_two_mid_epoch_stops_in_one_epoch_resume_exactly(tmp_path):
    """A checkpoint written mid-epoch after a mid-epoch resume holds the right sample position."""
    loader = DataLoader(workers.tiny_dataset(64), batch_size=8, shuffle=True)  # 8 steps per epoch
    full, full_model = _trainer(tmp_path / "full", max_epochs=2), workers.make_model()
    full.fit(full_model, loader, optimizer=workers.sgd)
    _trainer(tmp_path / "cut", max_epochs=2, max_steps=2).fit(workers.make_model(), loader, optimizer=workers.sgd)
    _trainer(tmp_path / "cut", max_epochs=2, max_steps=5).fit(workers.make_model(), loader, optimizer=workers.sgd,
                                                              ckpt_path="last")
    resumed, model = _trainer(tmp_path / "cut", max_epochs=2), workers.make_model()
    resumed.fit(model, loader, optimizer=workers.sgd, ckpt_path="last")
    assert [r["epoch"] for r in resumed.history] == [0, 1] and resumed.global_step == 16
    for got, want in zip(resumed.history, full.history):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
    for a, b in zip(model.parameters(), full_model.parameters()):
        torch.testing.assert_close(a, b)


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_resuming_an_older_checkpoint_never_writes_into_its_run(tmp_path):
    loader = DataLoader(workers.tiny_dataset(16), batch_size=8)
    _trainer(tmp_path / "a", max_epochs=3).fit(workers.make_model(), loader, optimizer=workers.sgd)
    run_a = tmp_path / "a" / "version_0"
    before = _files(run_a)
    older = run_a / "checkpoints" / ckpt.checkpoint_name(0, 2)  # the end of the first epoch
    assert older.exists()
    trainer = _trainer(tmp_path / "b", max_epochs=3)
    summary = trainer.fit(workers.make_model(), loader, optimizer=workers.sgd, ckpt_path=older)
    assert _files(run_a) == before  # not one byte of run A changed
    assert trainer.run_dir == tmp_path / "b" / "version_0"
    assert summary["resumed_from"] == str(older) and (trainer.run_dir / "resumed_from").read_text().strip() == str(older)
    assert json.loads((trainer.run_dir / "summary.json").read_text())["epochs"] == 3


def test_last_never_resumes_another_scripts_run(tmp_path):
    loader = DataLoader(workers.tiny_dataset(16), batch_size=8)
    _trainer(tmp_path).fit(workers.make_model(), loader, optimizer=workers.sgd)
    (tmp_path / "version_0" / "script").write_text("/somewhere/else.py\n")
    with pytest.warns(UserWarning, match="starting fresh"):
        summary = _trainer(tmp_path).fit(workers.make_model(), loader, optimizer=workers.sgd, ckpt_path="last")
    assert summary["resumed_from"] is None and summary["run_dir"].endswith("version_1")


# -- batches the model cannot take -----------------------------------------------------------------------------
def test_float64_inputs_to_a_float32_model_name_the_conversion(tmp_path):
    data = TensorDataset(torch.randn(8, 4, dtype=torch.float64), torch.zeros(8, dtype=torch.long))
    with pytest.raises(TypeError, match="float64 \\(double\\) inputs but the model's parameters are float32.*x.float"):
        _trainer(tmp_path).fit(nn.Linear(4, 3), DataLoader(data, batch_size=4), optimizer=workers.sgd)


def test_labels_outside_the_models_outputs_are_named(tmp_path):
    data = TensorDataset(torch.randn(8, 4), torch.tensor([0, 1, 2, 7] * 2))
    with pytest.raises(ValueError, match="a class label is outside the model's outputs.*Target 7"):
        _trainer(tmp_path).fit(nn.Linear(4, 3), DataLoader(data, batch_size=4), optimizer=workers.sgd)


def test_a_data_set_that_shrank_under_a_mid_epoch_resume_is_named(tmp_path):
    _trainer(tmp_path, max_epochs=2, max_steps=3).fit(
        workers.make_model(), DataLoader(workers.tiny_dataset(64), batch_size=8), optimizer=workers.sgd)
    with pytest.raises(ValueError, match="the data set now holds 16 \\(it shrank\\)"):
        _trainer(tmp_path, max_epochs=2).fit(workers.make_model(), DataLoader(workers.tiny_dataset(16), batch_size=8),
                                             optimizer=workers.sgd, ckpt_path="last")


# -- manual optimization: the step count and schedulers, as Lightning ------------------------------------------
class ManualPair(TrainingModule):
    """Two optimizers stepping on every batch, each with a StepLR that halves its lr per step (interval "step");
    ``step_schedulers``: whether ``training_step`` steps them itself (Lightning leaves them to it)."""

    automatic_optimization = False

    def __init__(self, step_schedulers: bool):
        super().__init__()
        self.a, self.b = nn.Linear(1, 1), nn.Linear(1, 1)
        self.step_schedulers = step_schedulers
        self.seen_steps = []

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for opt, layer in zip(self.optimizers(), (self.a, self.b)):
            opt.zero_grad()
            self.manual_backward(layer(x).pow(2).mean())
            opt.step()
            self.seen_steps.append(self.global_step)
        if self.step_schedulers:
            for sched in self.lr_schedulers():
                sched.step()

    def configure_optimizers(self):
        opts = [torch.optim.SGD(self.a.parameters(), lr=1.0), torch.optim.SGD(self.b.parameters(), lr=1.0)]
        scheds = [{"scheduler": torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5), "interval": "step"} for o in opts]
        return opts, scheds


@pytest.mark.timeout(60)
def test_global_step_counts_each_optimizer_step_under_manual_optimization(tmp_path):
    # Lightning: trainer.global_step is the number of optimizer steps taken (under manual optimization each
    # optimizer.step() counts), and fit stops once global_step >= max_steps
    model = ManualPair(step_schedulers=False)
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(model, DataLoader(mw.indexed_dataset(6), batch_size=2))
    assert trainer.global_step == 6  # 3 batches × 2 optimizers
    assert model.seen_steps == [0, 0, 2, 2, 4, 4]  # self.global_step inside training_step: counted after it
    limited = _trainer(tmp_path, max_epochs=1, max_steps=3)
    limited.fit(ManualPair(step_schedulers=False), DataLoader(mw.indexed_dataset(6), batch_size=2))
    assert limited.global_step == 4  # 2 batches: after the first, 2 < 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("by_module", [False, True])
def test_schedulers_are_the_modules_to_step_under_manual_optimization(tmp_path, by_module):
    model = ManualPair(step_schedulers=by_module)
    trainer = _trainer(tmp_path, max_epochs=2)
    trainer.fit(model, DataLoader(mw.indexed_dataset(6), batch_size=2))
    # Lightning never steps schedulers under manual optimization: 6 batches stepping both halve each lr 6 times
    expected = 0.5 ** 6 if by_module else 1.0
    assert [opt.param_groups[0]["lr"] for opt in trainer.optimizers] == [expected, expected]
