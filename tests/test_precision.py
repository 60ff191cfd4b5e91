"""Precision plugins run for real on CPU: autocast dtypes, bf16-true casts, the GradScaler's state in
checkpoints, unscaling once before clipping, and the loss of mixed precision against fp32.
(fp16 convolution backward is ~90x slower on this CPU: these tests use a small MLP.)"""

import functools

import pytest
import torch
from torch.nn import functional as F

from tests import workers_strategies as ws
from trainscale.runtime.runtime import Runtime

# Measured here (30 SGD steps of BlockNet, batch 32, lr 0.1; the fp32 loss goes 1.41 -> 0.78): the largest
# per-step loss difference to fp32 was 9.2e-05 for 16-mixed, 9.7e-04 for bf16-mixed, 1.2e-02 for bf16-true.
# The tolerances below keep a margin of about 5-10x (bf16 keeps 8 significant bits, fp16 11).
LOSS_TOLERANCE = {"16-mixed": 1e-3, "bf16-mixed": 1e-2, "bf16-true": 5e-2}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: threads only add contention on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _train(precision: str, steps: int = 30) -> tuple[float, ...]:
    torch.manual_seed(0)
    rt = Runtime(accelerator="cpu", precision=precision)
    model, opt = rt.setup(ws.BlockNet(), lambda p: torch.optim.SGD(p, lr=0.1))
    ds = ws.mlp_data(256)
    losses = []
    for i in range(steps):
        start = (i * 32) % 256
        x, y = rt.to_device(ds[start:start + 32])
        with rt.autocast():
            loss = F.cross_entropy(model(x), y)
        rt.backward(loss)
        rt.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    return tuple(v.item() for v in losses)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "bf16-true"])
def test_loss_within_tolerance_of_fp32(precision):
    reference, losses = _train("32-true"), _train(precision)
    assert reference[-1] < 0.7 * reference[0]  # it learns
    assert max(abs(a - b) for a, b in zip(reference, losses)) < LOSS_TOLERANCE[precision]
    assert losses != reference  # the precision changed the arithmetic


@pytest.mark.parametrize("precision, dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16),
                                              ("32-true", torch.float32)])
def test_autocast_runs_linear_layers_in_the_low_dtype(precision, dtype):
    rt = Runtime(accelerator="cpu", precision=precision)
    model, _ = rt.setup(ws.BlockNet())
    seen = {}
    model.blocks[0].fc1.register_forward_hook(lambda m, i, out: seen.update(fc1=out.dtype))
    x, y = rt.to_device(ws.mlp_data(8)[:8])
    with rt.autocast():
        loss = F.cross_entropy(model(x), y)
    assert seen["fc1"] == dtype
    assert loss.dtype == torch.float32  # cross_entropy autocasts to fp32
    assert model.head.weight.dtype == torch.float32  # mixed precision keeps fp32 weights


def test_bf16_true_casts_parameters_and_floating_inputs():
    rt = Runtime(accelerator="cpu", precision="bf16-true")
    model, _ = rt.setup(ws.BlockNet())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    x, y = rt.to_device((torch.randn(4, 16), torch.tensor([0, 1, 2, 3])))
    assert x.dtype == torch.bfloat16 and y.dtype == torch.int64
    assert model(x).dtype == torch.bfloat16


def _scaled_step(rt, model, opt, poison: bool = False):
    x, y = rt.to_device(ws.mlp_data(8)[:8])
    with rt.autocast():
        loss = F.cross_entropy(model(x), y)
    rt.backward(loss)
    if poison:  # an overflow: the scaler skips this step and halves its scale
        model.head.weight.grad[0, 0] = float("inf")
    rt.step(opt)
    opt.zero_grad(set_to_none=True)


def test_grad_scaler_state_is_saved_and_restored(tmp_path):
    rt = Runtime(accelerator="cpu", precision="16-mixed")
    model, opt = rt.setup(ws.BlockNet(), lambda p: torch.optim.SGD(p, lr=0.1))
    before = model.head.weight.detach().clone()
    _scaled_step(rt, model, opt, poison=True)
    assert torch.equal(model.head.weight, before)  # skipped
    _scaled_step(rt, model, opt)
    state = rt.precision.scaler.state_dict()
    assert state["scale"] == 2.0 ** 15 and state["_growth_tracker"] == 1  # default 2**16, halved, one good step
    rt.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt})
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["precision"]["scaler"]["scale"] == 2.0 ** 15

    fresh = Runtime(accelerator="cpu", precision="16-mixed")
    model2, opt2 = fresh.setup(ws.BlockNet(), lambda p: torch.optim.SGD(p, lr=0.1))
    assert fresh.precision.scaler.state_dict() != state
    fresh.load(tmp_path / "ckpt.pt", {"model": model2, "optimizer": opt2})
    assert fresh.precision.scaler.state_dict() == state


def test_clipping_under_16_mixed_unscales_once_per_step():
    """clip_gradients unscales before clipping, and a second clip in the same step does not unscale
    again (GradScaler.unscale_ would raise); the norm is the true one, as in fp32."""
    norms = {}
    for precision in ("32-true", "16-mixed"):
        torch.manual_seed(0)
        rt = Runtime(accelerator="cpu", precision=precision)
        model, opt = rt.setup(ws.BlockNet(), lambda p: torch.optim.SGD(p, lr=0.1))
        x, y = rt.to_device(ws.mlp_data(32)[:32])
        for _ in range(2):
            with rt.autocast():
                loss = F.cross_entropy(model(x), y)
            rt.backward(loss)
            first = rt.clip_gradients(model, opt, max_norm=1e6)  # no-op clip: returns the norm
            second = rt.clip_gradients(model, opt, max_norm=1e6)  # would raise if unscale_ ran twice
            rt.clip_gradients(model, opt, clip_val=1e6)
            rt.step(opt)  # scaler.step must not unscale again either
            opt.zero_grad(set_to_none=True)
            norms.setdefault(precision, []).append((first.item(), second.item()))
    for (f32, _), (f16, f16_again) in zip(norms["32-true"], norms["16-mixed"]):
        assert f16 == pytest.approx(f32, rel=1e-2) and f16_again == pytest.approx(f16, rel=1e-3)
    # the raw GradScaler behaviour this guards against
    scaler, opt = torch.amp.GradScaler("cpu"), torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    scaler.scale(opt.param_groups[0]["params"][0].sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)


def _count_constructions(monkeypatch) -> list:
    """Each ``Precision(...)`` built from now on, as its name (restored by monkeypatch)."""
    from trainscale.runtime import precision

    built, init = [], precision.Precision.__init__

    def counting(self, name, *args, **kwargs):
        built.append(name)
        init(self, name, *args, **kwargs)

    monkeypatch.setattr(precision.Precision, "__init__", counting)
    return built


def test_a_run_builds_one_precision_and_its_strategy_gets_that_object(monkeypatch, tmp_path):
    from trainscale.loop.trainer import Trainer

    built = _count_constructions(monkeypatch)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g))
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, precision="bf16-mixed", default_root_dir=tmp_path,
                      enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(torch.nn.Linear(4, 2), torch.utils.data.DataLoader(data, batch_size=8), loss_fn=F.cross_entropy,
                optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert built == ["bf16-mixed"]
    assert trainer.runtime.strategy.precision is trainer.runtime.precision


def test_pipeline_stages_run_under_the_runs_precision_without_building_another(monkeypatch):
    from trainscale.runtime.precision import Precision
    from trainscale.runtime.strategies.pipeline import PipelineStrategy
    from trainscale.runtime.world import World

    run_precision = Precision("bf16-mixed", "cpu")
    built = _count_constructions(monkeypatch)
    strategy = PipelineStrategy(torch.device("cpu"), World(world_size=2, local_world_size=2), precision=run_precision,
                                parallel={"pp": 2})
    assert strategy._autocast() == run_precision.autocast  # the run's object's autocast, no second Precision
    assert built == []
