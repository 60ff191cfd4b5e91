"""Lightning's Tuner (trainscale.tuner): the learning-rate range test on a tiny regression (its points, its schedule
as the optimizer saw it, the suggestion, the attribute set, the weights and the optimizer's state as before, the early
stop on a diverging loss) and the batch-size search with a module that runs out of memory above a size, in both
modes; the errors a port meets. One process; each test a few seconds."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainscale as L
from trainscale.tune import BatchSizeError, search
from trainscale.tuner import LRFinder, Tuner

_W = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def _data(n: int = 64):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x @ _W)


class Regression(L.LightningModule):
    """y = x·w with SGD (or a kept Adam); records the learning rate each training step ran at and the batch sizes."""

    def __init__(self, lr: float = 1e-3, batch_size: int = 16, n: int = 64, adam: bool = False, oom_above=None):
        super().__init__()
        self.lr, self.batch_size, self.n, self.adam, self.oom_above = lr, batch_size, n, adam, oom_above
        self.net = nn.Linear(4, 1)
        self.seen_lrs: list[float] = []
        self.seen_sizes: list[int] = []
        self.optimizer = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen_sizes.append(len(x))
        if self.oom_above is not None and len(x) > self.oom_above:  # what a device without room for it raises
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate a batch of {len(x)} (fake)")
        self.seen_lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if not self.adam:
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.optimizer is None:  # one optimizer for every fit: its state must survive the tuner
            self.optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        return self.optimizer

    def train_dataloader(self):
        return DataLoader(_data(self.n), batch_size=self.batch_size, shuffle=True)


def _trainer(tmp_path, **flags):
    return L.Trainer(default_root_dir=tmp_path, accelerator="cpu", seed=0, **flags)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lr_find_runs_the_schedule_sets_the_suggestion_and_leaves_the_model_as_it_was(tmp_path):
    torch.manual_seed(1)
    model = Regression(n=256)
    weights, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    trainer = _trainer(tmp_path)
    finder = Tuner(trainer).lr_find(model, min_lr=1e-6, max_lr=0.5, num_training=30, early_stop_threshold=None)

    lrs, losses = finder.results["lr"], finder.results["loss"]
    assert len(lrs) == len(losses) == 30 and all(math.isfinite(v) for v in losses)
    # Lightning's exponential schedule: min_lr first, then min_lr·(max/min)^((k+1)/N), max_lr last
    ratio = 0.5 / 1e-6
    assert lrs == pytest.approx([1e-6] + [1e-6 * ratio ** ((k + 1) / 30) for k in range(1, 30)], rel=1e-9)
    assert model.seen_lrs == pytest.approx(lrs, rel=1e-12)  # the learning rate each step trained at
    suggestion = finder.suggestion()
    assert 1e-6 <= suggestion <= 0.5 and model.lr == suggestion
    assert _same(model.state_dict(), weights)  # the 30 steps are undone
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.trainer is trainer and trainer.global_step == 0
    assert list(tmp_path.iterdir()) == []  # the throwaway fit's directory is gone; nothing written in the user's runs


def test_lr_find_linear_mode_and_the_optimizer_state_after_a_fit_are_kept(tmp_path):
    model = Regression(adam=True)
    trainer = _trainer(tmp_path, max_steps=3, enable_checkpointing=False, logger=False, enable_progress_bar=False)
    trainer.fit(model)
    optimizer = model.optimizer
    opt_state, weights = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(model.state_dict())
    assert opt_state["state"]  # Adam's moments after 3 steps
    model.seen_lrs.clear()
    finder = Tuner(trainer).lr_find(model, min_lr=1e-4, max_lr=1e-2, num_training=12, mode="linear",
                                    early_stop_threshold=None, update_attr=False)

    assert finder.results["lr"] == pytest.approx([1e-4] + [1e-4 + (k + 1) / 12 * (1e-2 - 1e-4) for k in range(1, 12)])
    assert model.seen_lrs == pytest.approx(finder.results["lr"])
    state = optimizer.state_dict()
    assert state["param_groups"] == opt_state["param_groups"]  # lr as before, no "initial_lr" left behind
    assert all(_same(state["state"][i], opt_state["state"][i]) for i in opt_state["state"])
    assert _same(model.state_dict(), weights) and model.lr == 1e-3 and trainer.global_step == 3


def test_lr_find_counts_optimizer_steps_under_accumulation(tmp_path):
    model = Regression(n=256)
    finder = Tuner(_trainer(tmp_path, accumulate_grad_batches=2)).lr_find(model, num_training=10,
                                                                           early_stop_threshold=None)
    assert len(finder.results["lr"]) == len(finder.results["loss"]) == 10
    assert model.seen_lrs == [lr for lr in finder.results["lr"] for _ in range(2)]  # both micro-batches of a step


def test_lr_find_stops_early_when_the_loss_diverges(tmp_path):
    # full-batch SGD on a quadratic: stable below lr = 2 / the largest curvature, diverging far above it
    model = Regression(batch_size=64)
    finder = Tuner(_trainer(tmp_path)).lr_find(model, min_lr=1e-3, max_lr=100.0, num_training=60, update_attr=False)
    losses = finder.results["loss"]
    assert 2 < len(losses) < 60
    assert losses[-1] > 4.0 * min(losses[:-1])  # the point that crossed Lightning's threshold ended the test
    assert all(v <= 4.0 * min(losses[:i + 1]) for i, v in enumerate(losses[:-1]) if i >= 1)


def test_suggestion_is_the_steepest_descent_of_the_loss_over_the_learning_rate():
    lrs = list(np.logspace(-5, 0, 40))
    losses = [1.0 / (1.0 + math.exp((math.log10(lr) + 2.5) * 3.0)) + 0.1 for lr in lrs]  # falls fastest near 1e-2.5
    losses[25] = float("nan")  # a step without a loss: left out, as Lightning
    finder = LRFinder("exponential", 1e-5, 1.0, 40)
    finder.results = {"lr": lrs, "loss": losses}
    kept = [i for i in range(10, 39) if math.isfinite(losses[i])]
    slope = np.gradient(np.array([losses[i] for i in kept]), np.array([lrs[i] for i in kept]))
    assert finder.suggestion() == lrs[kept[int(np.argmin(slope))]]
    finder.results = {"lr": lrs[:12], "loss": losses[:12]}
    assert finder.suggestion() is None  # one point after skipping: no suggestion (Lightning logs an error)


def test_lr_find_plot_draws_the_curve_and_the_suggestion(tmp_path):
    matplotlib = pytest.importorskip("matplotlib", reason="the plot extra: pip install 'trainscale[plot]'")
    matplotlib.use("Agg")
    finder = LRFinder("exponential", 1e-5, 1.0, 40)
    lrs = list(np.logspace(-5, 0, 40))
    finder.results = {"lr": lrs, "loss": [1.0 / (1.0 + lr * 100) for lr in lrs]}
    fig = finder.plot(suggest=True)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and len(ax.lines) == 2  # the curve and the red dot
    assert ax.lines[1].get_xdata()[0] == finder.suggestion()


@pytest.mark.parametrize("mode, init_val, expected, tried", [
    ("power", 2, 32, [2, 4, 8, 16, 32, 64]),
    ("binsearch", 2, 40, [2, 4, 8, 16, 32, 64, 48, 40, 44, 42, 41]),
    ("power", 128, 32, [128, 64, 32]),  # init_val out of memory: halved until one runs (Lightning's)
    ("binsearch", 128, 40, [128, 64, 32, 48, 40, 44, 42, 41]),
])
def test_scale_batch_size_grows_until_out_of_memory(tmp_path, mode, init_val, expected, tried):
    model = Regression(n=512, batch_size=7, oom_above=40)
    weights = copy.deepcopy(model.state_dict())
    found = Tuner(_trainer(tmp_path)).scale_batch_size(model, mode=mode, init_val=init_val, steps_per_trial=2,
                                                       margin=0.0)
    assert found == expected and model.batch_size == expected
    first_of_each = list(dict.fromkeys(model.seen_sizes))  # each trial's loader rebuilt with the size set
    assert first_of_each == tried
    assert _same(model.state_dict(), weights)
    assert list(tmp_path.iterdir()) == []


def test_scale_batch_size_when_nothing_fits_raises_and_keeps_the_attribute(tmp_path):
    model = Regression(batch_size=7, oom_above=0)
    with pytest.raises(BatchSizeError, match="not even a batch of 1"):
        Tuner(_trainer(tmp_path)).scale_batch_size(model, init_val=4)
    assert model.seen_sizes == [4, 2, 1] and model.batch_size == 7
    assert list(tmp_path.iterdir()) == []


def test_scale_batch_size_without_trials_keeps_init_val(tmp_path):
    model = Regression()
    assert Tuner(_trainer(tmp_path)).scale_batch_size(model, init_val=5, max_trials=0) == 5 == model.batch_size
    assert model.seen_sizes == []


def test_scale_batch_size_binsearch_margin_and_a_data_module(tmp_path):
    class Data(L.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 4

        def train_dataloader(self):
            return DataLoader(_data(100), batch_size=self.batch_size)

    data = Data()
    model = Regression()
    del model.batch_size  # the data module holds it
    found = Tuner(_trainer(tmp_path)).scale_batch_size(model, datamodule=data, mode="binsearch", steps_per_trial=1)
    # no memory limit here: the growth stops at the data set's 100 samples, then Lightning's 5% margin
    assert found == int(100 * 0.95) == data.batch_size


def test_scale_batch_size_of_a_validation_loop(tmp_path):
    class Eval(Regression):
        def validation_step(self, batch, batch_idx):
            if len(batch[0]) > 24:
                raise torch.OutOfMemoryError("CUDA out of memory. (fake)")
            self.seen_sizes.append(len(batch[0]))

        def val_dataloader(self):
            return DataLoader(_data(256), batch_size=self.batch_size)

    model = Eval()
    found = Tuner(_trainer(tmp_path)).scale_batch_size(model, method="validate", mode="binsearch", margin=0.0,
                                                       init_val=8)
    assert found == 24 == model.batch_size


def test_scale_batch_size_refuses_a_loader_it_cannot_rebuild(tmp_path):
    model = Regression()
    with pytest.raises(ValueError, match=r"passed directly.*define train_dataloader\(\)"):
        Tuner(_trainer(tmp_path)).scale_batch_size(model, train_dataloaders=DataLoader(_data(), batch_size=4))
    with pytest.raises(AttributeError, match="batch_arg_name="):
        Tuner(_trainer(tmp_path)).scale_batch_size(model, batch_arg_name="bs")


def test_lr_find_errors_name_the_fix(tmp_path):
    class NoLr(Regression):
        def __init__(self):
            super().__init__()
            del self.lr

    tuner = Tuner(_trainer(tmp_path))
    with pytest.raises(AttributeError, match=r"attr_name=\.\.\."):
        tuner.lr_find(NoLr())
    with pytest.raises(AttributeError, match="set to rate"):
        tuner.lr_find(Regression(), attr_name="rate")
    with pytest.raises(ValueError, match="only valid configuration"):
        tuner.lr_find(Regression(), method="validate")
    with pytest.raises(ValueError, match="`dataloaders` argument should be None"):
        tuner.lr_find(Regression(), dataloaders=DataLoader(_data()))
    with pytest.raises(ValueError, match="linear"):
        tuner.lr_find(Regression(), mode="cosine")
    with pytest.raises(ValueError, match="must both be > 0"):
        tuner.lr_find(Regression(), min_lr=0.0)


def test_lr_find_with_min_lr_above_max_lr_runs_a_falling_schedule(tmp_path):
    # Lightning's own test (test_lr_candidates_between_min_and_max) swaps them: the rates stay between the two
    finder = Tuner(_trainer(tmp_path)).lr_find(Regression(), min_lr=1.0, max_lr=1e-8, num_training=3)
    assert finder.results["lr"][0] == 1.0 and all(1e-8 <= lr <= 1.0 for lr in finder.results["lr"])


def test_lr_find_finds_hparams_lr_and_skips_under_fast_dev_run(tmp_path):
    class Hp(Regression):
        def __init__(self, learning_rate: float = 0.01):
            super().__init__()
            del self.lr
            self.save_hyperparameters()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)

    model = Hp()
    Tuner(_trainer(tmp_path)).lr_find(model, num_training=15, early_stop_threshold=None)
    assert model.hparams.learning_rate != 0.01 and 1e-8 <= model.hparams.learning_rate <= 1
    with pytest.warns(UserWarning, match="fast_dev_run"):
        assert Tuner(_trainer(tmp_path, fast_dev_run=True)).lr_find(Regression()) is None


def test_search_power_mode_and_shrink():
    assert search(lambda s: s <= 40, 2, mode="power") == 32
    assert search(lambda s: s <= 40, 64, mode="binsearch", shrink=True) == 40
    with pytest.raises(BatchSizeError):
        search(lambda s: False, 8, shrink=True)
