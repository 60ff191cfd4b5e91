"""Lightning's ``GradientAccumulationScheduler``: the factor of each epoch, its checks, and the training it gives,
held against plain PyTorch (one process, and DDP over 2 gloo ranks) and against an uninterrupted run on resume."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests import fault_workers as fw
from tests import workers
from tests.helpers import run_distributed
from trainscale.callbacks import Callback, GradientAccumulationScheduler
from trainscale.lightning.module import TrainingModule
from trainscale.loop.trainer import Trainer

N = 32  # samples: 8 micro-batches of 4 per epoch in one process, 4 per rank on two


def plain_scheduled_reference(micro_batch: int, factors: list[int], n: int = N) -> dict:
    """A hand loop over the samples ``DistributedSampler(num_replicas=1)`` gives: in epoch ``e`` the gradients of
    ``factors[e]`` micro-batches of ``micro_batch`` are summed (each loss ÷ the factor), then one SGD step."""
    x_all, y_all = workers.tiny_dataset(n).tensors
    model = workers.make_model(0)
    opt = workers.sgd(model.parameters())
    for epoch, k in enumerate(factors):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))  # the sampler's shuffle, seed 0
        starts = list(range(0, n, micro_batch))
        for group in range(0, len(starts), k):
            opt.zero_grad(set_to_none=True)
            for start in starts[group:group + k]:
                idx = perm[start:start + micro_batch]
                (F.cross_entropy(model(x_all[idx]), y_all[idx]) / k).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class EpochWatch(Callback):
    """Notes the Trainer's ``accumulate_grad_batches`` and ``global_batch_size`` at each epoch start, the step count
    at each epoch end, and ``estimated_stepping_batches`` when training starts."""

    def __init__(self) -> None:
        self.factors: list[int] = []
        self.global_batches: list[int | None] = []
        self.steps: list[int] = []
        self.estimated = None

    def on_train_start(self, trainer, module) -> None:
        self.estimated = trainer.estimated_stepping_batches

    def on_train_epoch_start(self, trainer, module) -> None:
        self.factors.append(trainer.accumulate_grad_batches)
        self.global_batches.append(trainer.global_batch_size)

    def on_train_epoch_end(self, trainer, module) -> None:
        self.steps.append(trainer.global_step)


# -- the schedule and its errors ------------------------------------------------------------------------------------
def test_factor_of_each_epoch_is_that_of_the_last_key_reached():
    scheduler = GradientAccumulationScheduler({0: 1, 4: 2, 8: 4})
    assert [scheduler.get_accumulate_grad_batches(e) for e in range(10)] == [1, 1, 1, 1, 2, 2, 2, 2, 4, 4]
    late = GradientAccumulationScheduler({3: 5})  # epochs before the first key accumulate 1 (Lightning adds {0: 1})
    assert late.scheduling == {3: 5, 0: 1} and late.epochs == [0, 3]
    assert [late.get_accumulate_grad_batches(e) for e in range(5)] == [1, 1, 1, 5, 5]
    assert late.going_to_accumulate_grad_batches() and not GradientAccumulationScheduler({0: 1}).going_to_accumulate_grad_batches()


@pytest.mark.parametrize("scheduling, error, words", [
    ({}, TypeError, "Empty dict"),
    ({1: 2, -3: 4}, ValueError, "Epoch should be an int greater than or equal to 0"),
    ({0: 2, "2": 1}, ValueError, "Epoch should be an int greater than or equal to 0"),
    ({True: 2}, ValueError, "Epoch should be an int"),
    ({1: 0, 3: 4}, ValueError, "Accumulation factor should be an int greater than 0"),
    ({0: 2, 2: "2"}, ValueError, "Accumulation factor should be an int greater than 0"),
    ({0: 2.0}, ValueError, "Accumulation factor should be an int"),
])
def test_bad_schedules_are_refused_with_lightnings_words(scheduling, error, words):
    with pytest.raises(error, match=words):
        GradientAccumulationScheduler(scheduling)


def test_a_dict_for_the_trainer_flag_names_the_callback():
    with pytest.raises(ValueError, match=r"GradientAccumulationScheduler\(scheduling=\{4: 2\}\)"):
        Trainer(accelerator="cpu", accumulate_grad_batches={4: 2})


def test_two_schedulers_are_refused(tmp_path):
    with pytest.raises(ValueError, match="several GradientAccumulationScheduler"):
        Trainer(accelerator="cpu", default_root_dir=tmp_path, callbacks=[GradientAccumulationScheduler({0: 2}),
                                                                         GradientAccumulationScheduler({1: 3})])


class Linear(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ManualLinear(Linear):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()


class OwnStep(Linear):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)


def _fit(tmp_path, model, scheduling, watch=None, **flags):
    """Fit ``model`` on 10 batches an epoch, 2 epochs unless ``max_epochs`` says otherwise."""
    flags.setdefault("max_epochs", 2)
    callbacks = [GradientAccumulationScheduler(scheduling)] + ([watch] if watch else [])
    trainer = Trainer(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, callbacks=callbacks, **flags)
    x = torch.linspace(-1, 1, 20).reshape(10, 2)
    trainer.fit(model, DataLoader(TensorDataset(x, torch.zeros(10)), batch_size=1))
    return trainer


@pytest.mark.parametrize("model, flags, error, words", [
    (ManualLinear, {}, RuntimeError, "not supported for manual optimization"),
    (Linear, {"accumulate_grad_batches": 2}, ValueError, "Either remove `accumulate_grad_batches` from the Trainer"),
    (Linear, {"lr_scaling": "linear", "base_batch_size": 1}, ValueError, "drop lr_scaling"),
])
def test_what_the_callback_cannot_go_with_fails_when_training_starts(tmp_path, model, flags, error, words):
    watch = EpochWatch()
    with pytest.raises(error, match=words):
        _fit(tmp_path, model(), {1: 2}, watch, **flags)
    assert watch.factors == []  # before the first epoch


def test_a_module_with_its_own_optimizer_step_is_told_when_it_is_called(tmp_path):
    with pytest.warns(UserWarning, match="the hooks will not be called on every batch"):
        _fit(tmp_path / "own", OwnStep(), {1: 2})
    with warnings.catch_warnings():  # nothing to say when no epoch accumulates
        warnings.filterwarnings("error", message=".*hooks will not be called")
        _fit(tmp_path / "ones", OwnStep(), {0: 1})


def test_steps_per_epoch_follow_the_schedule_and_the_trainer_reports_each_epochs_factor(tmp_path):
    """10 batches an epoch, {1: 2, 3: 4}: 10, 5, 5 and 3 optimizer steps (4 + 4 + 2 in the last)."""
    watch = EpochWatch()
    trainer = _fit(tmp_path, Linear(), {1: 2, 3: 4}, watch, max_epochs=4)
    assert trainer.accumulate_grad_batches == 4  # the last epoch's, after the fit (Lightning's attribute)
    assert watch.factors == [1, 2, 2, 4] and watch.global_batches == [1, 2, 2, 4]
    assert watch.steps == [10, 15, 20, 23]
    assert watch.estimated == 23  # every epoch at its own factor
    before = Trainer(accelerator="cpu", default_root_dir=tmp_path, callbacks=[GradientAccumulationScheduler({0: 2})])
    assert before.accumulate_grad_batches == 1  # the flag until a fit's first epoch starts


# -- against plain PyTorch ------------------------------------------------------------------------------------------
def test_one_process_fit_equals_a_hand_loop_accumulating_1_then_2(tmp_path):
    watch = EpochWatch()
    out = workers.trainer_fit(0, str(tmp_path), 4, 2, n=N,
                              extra={"callbacks": [GradientAccumulationScheduler({0: 1, 1: 2}), watch]})
    assert watch.steps == [8, 12] and out["summary"]["steps"] == 12
    assert out["summary"]["accumulate_grad_batches"] == 2 and out["summary"]["global_batch_size"] == 8
    for key, ref in plain_scheduled_reference(4, [1, 2]).items():
        torch.testing.assert_close(out["state"][key], ref, rtol=1e-5, atol=1e-6)


def _ddp_scheduled_body(rank: int, root: str) -> dict:
    counter, watch = workers.CallCounter(), EpochWatch()
    extra = {"callbacks": [GradientAccumulationScheduler({0: 1, 1: 2}), watch], "enable_checkpointing": False,
             "strategy_options": {"ddp_comm_hook": workers.counting_allreduce_hook, "ddp_comm_state": counter}}
    out = workers.trainer_fit(rank, root, 4, 2, extra=extra, n=N)
    return {**out, "allreduces": counter.calls, "factors": watch.factors, "steps": watch.steps}


@pytest.mark.multiprocess
def test_ddp_two_ranks_agree_and_equal_a_hand_loop_accumulating_1_then_2(tmp_path):
    """2 ranks × 4 samples = micro-batches of 8: epoch 0 steps on each (4 steps), epoch 1 on every second (2), with
    one gradient all-reduce per optimizer step (the small model's gradients fit one bucket): no_sync before."""
    results = run_distributed(_ddp_scheduled_body, str(tmp_path), timeout=120)
    reference = plain_scheduled_reference(8, [1, 2])
    for r in results:
        assert r["factors"] == [1, 2] and r["steps"] == [4, 6] and r["allreduces"] == 6
        assert r["summary"]["global_batch_size"] == 16  # the last epoch's: 4 × 2 ranks × 2
    for key, ref in reference.items():
        torch.testing.assert_close(results[0]["state"][key], ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(results[1]["state"][key], results[0]["state"][key], rtol=0, atol=0)


def _pp_scheduled_body(rank: int, root: str, strategy: str) -> dict:
    from tests.pipeline_workers import fit_gpt

    return fit_gpt(rank, f"{root}/{strategy}", strategy, epochs=2, train=48, val=8,
                   callbacks=(GradientAccumulationScheduler({1: 2}),))


@pytest.mark.multiprocess
def test_pipeline_stages_follow_the_schedule_as_one_process(tmp_path):
    """pp has its own micro-batches inside each batch: each schedule step is given the epoch's divisor, so a GPT
    cut into 2 stages trains as one process does (48 samples of 8: 6 steps, then 3)."""
    single = _pp_scheduled_body(0, str(tmp_path), "single")
    results = run_distributed(_pp_scheduled_body, str(tmp_path), "pp", timeout=120)
    assert single["summary"]["steps"] == 9 and [r["summary"]["steps"] for r in results] == [9, 9]
    assert set().union(*(r["weights"] for r in results)) == set(single["weights"])  # the stages hold every weight
    for r in results:
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, single["weights"][name], rtol=1e-5, atol=1e-6)


# -- resume ---------------------------------------------------------------------------------------------------------
def test_resume_mid_epoch_in_a_scheduled_epoch_equals_the_uninterrupted_run(tmp_path):
    """16 samples of 4: 4 micro-batches an epoch; {1: 2}: 4 + 2 + 2 steps. The cut run stops at step 5, after the
    first accumulated step of epoch 1; the resumed run asks the schedule for epoch 1 again (dropout: RNG matters)."""
    def schedule():
        return [GradientAccumulationScheduler({1: 2})]

    kw = dict(epochs=3, n=16)
    full, full_summary = fw.fit(str(tmp_path / "full"), callbacks=schedule(), **kw)
    fw.fit(str(tmp_path / "cut"), max_steps=5, callbacks=schedule(), **kw)
    resumed, summary = fw.fit(str(tmp_path / "cut"), ckpt_path="last", callbacks=schedule(), **kw)
    assert full_summary["steps"] == summary["steps"] == 8
    assert resumed.seen[0][:2] == (1, 5) and len(resumed.seen) == 2 + 4  # the rest of epoch 1, then epoch 2
    for key, value in full.weights().items():
        assert torch.equal(resumed.weights()[key], value), key


def test_setting_the_factor_from_code_names_the_flag_and_the_callback():
    trainer = Trainer(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False)
    with pytest.raises(AttributeError, match="GradientAccumulationScheduler"):
        trainer.accumulate_grad_batches = 4
    assert trainer.accumulate_grad_batches == 1
