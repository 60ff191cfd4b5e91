"""FLOP counting never breaks training: a formula that raises, a higher-order operator the
counter has no rule for, or a step that fails only while counted -> the step's result is unchanged, one warning,
and an analytic estimate (6·N per token) or no FLOPs."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import flop_counter
from torch.utils.data import DataLoader, TensorDataset

from trainscale.telemetry import flops
from trainscale.loop.trainer import Trainer


def _input_loop(x: torch.Tensor) -> torch.Tensor:
    """x doubled twice by torch's while_loop: a higher-order operator with no FLOP rule (torch 2.13)."""
    from torch._higher_order_ops.while_loop import while_loop

    return while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, v * 2), (torch.tensor(0), x))[1]


class LoopNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(_input_loop(x))))


def _grads_of_one_step(model, x, y, counter=None):
    model.zero_grad()
    with counter.measure(len(x)) if counter is not None else torch.enable_grad():
        F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _measured(model, x, y, **measure):
    counter = flops.FlopsPerSample()
    counter.parameters = sum(p.numel() for p in model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = _grads_of_one_step(model, x, y)
        grads = _grads_of_one_step(model, x, y, counter)
        after = _grads_of_one_step(model, x, y)  # later steps run too (compiled operators not left broken)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(grads, reference, after))
    return counter, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_an_operator_without_a_flop_rule_runs_uncounted_with_one_warning():
    torch.manual_seed(0)
    counter, warned = _measured(LoopNet(), torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))
    assert counter.value is None and counter.method is None  # no tokens: no analytic estimate
    assert len(warned) == 1 and "while_loop" in str(warned[0].message) and "no MFU" in str(warned[0].message)


def test_a_raising_flop_formula_falls_back_to_six_n_per_token(monkeypatch):
    def broken(*args, **kwargs):
        raise AssertionError("unexpected shapes")

    for op in (torch.ops.aten.addmm, torch.ops.aten.mm):
        monkeypatch.setitem(flop_counter.flop_registry, op, broken)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))
    ids = torch.randint(0, 50, (4, 12))
    counter = flops.FlopsPerSample()
    counter.parameters = sum(p.numel() for p in model.parameters())
    with pytest.warns(RuntimeWarning, match="FLOP formula raised AssertionError: unexpected shapes"):
        with counter.measure(samples=4, tokens=ids.numel()):
            F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    assert counter.value == 6 * counter.parameters * 12 and counter.method == "analytic (6N per token)"


def test_counting_still_counts_when_nothing_fails():
    counter, warned = _measured(nn.Linear(8, 3), torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))
    assert warned == [] and counter.method == "counted"
    assert counter.value == 2 * 8 * 3 * 2  # forward 2·in·out, weight gradient 2·in·out (no input gradient)


def test_a_step_that_fails_only_while_counted_raises_flop_count_error_and_runs_again_uncounted():
    from torch.nn.attention.flex_attention import flex_attention  # eager: torch.compile(fullgraph=True) inside

    def step():
        q = torch.randn(1, 2, 16, 8)
        return flex_attention(q, q, q)

    counter = flops.FlopsPerSample()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # flex_attention's own "not compiled" warning
        with pytest.warns(RuntimeWarning, match="raised while counted"):
            with pytest.raises(flops.FlopCountError, match="count_flops=False") as info:
                with counter.measure(samples=1):
                    step()
        assert info.value.__cause__ is not None  # the original error, chained
        assert step().shape == (1, 2, 16, 8)  # the same step outside counting: what the caller runs again
    assert counter.value is None and counter.done


def test_trainer_trains_a_model_whose_operator_cannot_be_counted(tmp_path):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, count_flops=True, default_root_dir=tmp_path,
                      enable_progress_bar=False, enable_checkpointing=False, log_every_n_steps=2)
    with pytest.warns(RuntimeWarning, match="FLOP counting failed"):
        summary = trainer.fit(LoopNet(), DataLoader(data, batch_size=8),
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    tele = summary["telemetry"]
    assert tele["flops_per_sample"] is None and tele["flops_method"] is None and tele["samples_per_s"] > 0


class _RefusesCounting(torch.autograd.Function):
    """Identity whose backward refuses to run under a dispatch mode, as a region compiled inside a model
    does (eager ``flex_attention`` calls ``torch.compile(fullgraph=True)``; its CPU backward is not built)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if _get_current_dispatch_mode() is not None:
            raise RuntimeError("this region cannot run under a dispatch mode")
        return grad


class UncountableNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # backward reaches head's gradients first, then fails under counting
        return self.head(_RefusesCounting.apply(self.body(x)))


def _fit_uncountable(tmp_path, count_flops: bool):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 3, (16,)))
    model = UncountableNet()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, count_flops=count_flops,
                      default_root_dir=tmp_path / str(count_flops), enable_progress_bar=False,
                      enable_checkpointing=False)
    summary = trainer.fit(model, DataLoader(data, batch_size=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    return model, summary


def test_trainer_runs_a_micro_batch_that_fails_under_counting_again_uncounted(tmp_path):
    """FlopCountError from the first micro-batch: the Trainer warns, runs it again without counting (the
    gradients its failed backward had already made dropped), and ends at the weights of a run that never
    counted."""
    with pytest.warns(RuntimeWarning, match="raised while counted"):
        counted, summary = _fit_uncountable(tmp_path, count_flops=True)
    uncounted, _ = _fit_uncountable(tmp_path, count_flops=False)
    assert summary["steps"] == 4 and summary["telemetry"]["flops_per_sample"] is None
    for a, b in zip(counted.parameters(), uncounted.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
