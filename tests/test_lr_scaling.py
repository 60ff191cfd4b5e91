"""LR scaling with the global batch size (Goyal et al. 2017 linear; Malladi et al. 2022 sqrt)."""

import math

import pytest
import torch

from trainscale.scaling.lr_scaling import lr_factor, scale_learning_rates, warmup


def two_group_sgd():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.01}], lr=0.1)


def test_factors_of_each_rule():
    assert lr_factor(512, 256, "linear") == 2.0 and lr_factor(128, 256, "linear") == 0.5
    assert lr_factor(1024, 256, "sqrt") == 2.0 and lr_factor(512, 256, "sqrt") == pytest.approx(math.sqrt(2))
    assert lr_factor(1024, 256, "none") == 1.0
    with pytest.raises(ValueError, match="choose one of 'linear', 'sqrt', 'none'"):
        lr_factor(512, 256, "quadratic")
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="positive int"):
            lr_factor(bad, 256)


def test_each_group_is_scaled_from_its_tuned_value_and_rescaling_does_not_compound():
    opt = two_group_sgd()
    assert scale_learning_rates(opt, 256, 64, "linear") == pytest.approx([0.4, 0.04])
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.4, 0.04])
    assert scale_learning_rates(opt, 128, 64, "linear") == pytest.approx([0.2, 0.02])  # from 0.1, not from 0.4
    restored = two_group_sgd()
    restored.load_state_dict(opt.state_dict())  # a resumed run keeps the tuned values
    assert scale_learning_rates(restored, 64, 64) == pytest.approx([0.1, 0.01])


def test_tensor_lr_and_scheduler_order():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(1e-3))
    assert scale_learning_rates(opt, 400, 100, "sqrt") == pytest.approx([2e-3])
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) and opt.param_groups[0]["lr"].item() == pytest.approx(2e-3)
    late = two_group_sgd()
    torch.optim.lr_scheduler.StepLR(late, step_size=1)
    with pytest.raises(ValueError, match="before building the LR scheduler"):
        scale_learning_rates(late, 128, 64)


def test_warmup_ramps_from_the_unscaled_lr_to_the_scaled_one():
    opt = two_group_sgd()
    scale_learning_rates(opt, 256, 64)  # × 4
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup(4, factor=4.0))
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.175, 0.25, 0.325, 0.4, 0.4])
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup(-1, 2.0)


def test_learning_rates_kept_names_follow_new_param_groups_optimizers_and_a_loaded_state():
    from trainscale.scaling.lr_scaling import LearningRates, learning_rates

    opt, read = two_group_sgd(), LearningRates()
    assert read([opt]) == learning_rates([opt]) == pytest.approx({"lr-SGD/pg1": 0.1, "lr-SGD/pg2": 0.01})
    opt.param_groups[0]["lr"] = 0.5  # a scheduler's step: the value changes, the names stay
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2})  # BaseFinetuning's unfreezing
    assert read([opt]) == learning_rates([opt]) == pytest.approx({"lr-SGD/pg1": 0.5, "lr-SGD/pg2": 0.01,
                                                                  "lr-SGD/pg3": 0.2})
    restored = two_group_sgd()
    restored.load_state_dict(two_group_sgd().state_dict() | {"param_groups": [
        {**g, "lr": 0.3} for g in restored.state_dict()["param_groups"]]})  # new group dicts
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    assert read([restored, adam]) == pytest.approx({"lr-SGD/pg1": 0.3, "lr-SGD/pg2": 0.3, "lr-Adam": 1e-3})
