"""precision="64-true" (Lightning's ``DoublePrecision``): float64 parameters and floating inputs, float64 the default
dtype inside the forward and module init; the Trainer and the Runtime against a plain PyTorch loop in float64 (the
model ``.double()``, the samples cast) on one process, on 2 ddp ranks, 2 fsdp ranks and 2 × 2 hsdp ranks (real gloo
processes).

Tolerance: the hand loop and the Trainer run the same float64 operations; ranks average their gradients where one
process takes the mean over the double batch, a difference of float64 rounding (~1e-16 relative per step). The
tolerance 1e-12 is far below what float32 gives (the tests check that a float32 run misses it)."""

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests import workers
from tests.helpers import run_distributed
from trainscale.runtime.precision import Precision
from trainscale.runtime.runtime import Runtime

N = 32  # samples: 2 steps an epoch at the double batch
FLOAT64 = {"rtol": 1e-12, "atol": 1e-12}


class _RecordsDefaultDtype(nn.Module):
    """A model whose forward makes a tensor without a dtype (as position tables and masks often are)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.seen: list = []

    def forward(self, x):
        bias = torch.ones(3)  # the default dtype
        self.seen.append((torch.get_default_dtype(), bias.dtype))
        return self.fc(x) + bias


def test_runtime_casts_parameters_and_floating_inputs_and_sets_the_default_dtype_in_the_forward_only():
    rt = Runtime(accelerator="cpu", precision="64-true")
    model, opt = rt.setup(_RecordsDefaultDtype(), lambda p: torch.optim.SGD(p, lr=0.1))
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert {p.dtype for g in opt.param_groups for p in g["params"]} == {torch.float64}  # built after the cast
    x, y = rt.to_device((torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])))
    assert x.dtype == torch.float64 and y.dtype == torch.int64
    with rt.autocast():
        loss = F.cross_entropy(model(x), y)
    assert model.seen == [(torch.float64, torch.float64)] and loss.dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32  # restored on leaving
    rt.backward(loss)
    rt.step(opt)
    assert {p.grad.dtype for p in model.parameters()} == {torch.float64}


def test_the_forward_context_restores_the_default_dtype_after_an_error():
    prec = Precision("64-true", "cpu")
    with pytest.raises(RuntimeError, match="boom"):
        with prec.autocast():
            assert torch.get_default_dtype() == torch.float64
            raise RuntimeError("boom")
    assert torch.get_default_dtype() == torch.float32


def test_runtime_init_module_builds_the_model_in_float64():
    with Runtime(accelerator="cpu", precision="64-true").init_module():
        model = nn.Linear(2, 2)
    assert model.weight.dtype == torch.float64 and torch.get_default_dtype() == torch.float32


def test_module_init_context_builds_float64_parameters_under_64_true_only():
    with Precision("64-true", "cpu").module_init_context():
        double = nn.Linear(2, 2)
    with Precision("32-true", "cpu").module_init_context():
        single = nn.Linear(2, 2)
    assert double.weight.dtype == torch.float64 and single.weight.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32


def test_other_precisions_neither_cast_inputs_nor_change_the_default_dtype():
    for name in ("32-true", "16-mixed", "bf16-mixed"):
        prec = Precision(name, "cpu")
        assert not prec.casts_input
        with prec.autocast():
            assert torch.get_default_dtype() == torch.float32


def _state_distance(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def test_one_process_trainer_equals_a_plain_float64_loop(tmp_path):
    epochs, b = 2, 16
    out = workers.trainer_fit(0, str(tmp_path / "d"), b, epochs, {"precision": "64-true"}, n=N)
    reference = workers.plain_pytorch_reference(b, epochs, n=N, dtype=torch.float64)
    assert {v.dtype for v in out["state"].values()} == {torch.float64}
    for key, ref in reference.items():
        torch.testing.assert_close(out["state"][key], ref, **FLOAT64)
    single = workers.plain_pytorch_reference(b, epochs, n=N)  # float32: the tolerance tells them apart
    assert _state_distance(single, reference) > 1e3 * FLOAT64["atol"]


def test_lightnings_alias_64_is_taken_by_the_trainer(tmp_path):
    out = workers.trainer_fit(0, str(tmp_path / "d"), 16, 1, {"precision": 64}, n=16)
    assert {v.dtype for v in out["state"].values()} == {torch.float64}
    assert out["summary"]["precision"] == "64-true"


def _sharded_fit(rank: int, root: str, batch_size: int, epochs: int, strategy: str, parallel: dict | None) -> dict:
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", strategy=strategy, parallel=parallel, precision="64-true",
                      max_epochs=epochs, seed=0, default_root_dir=root, enable_progress_bar=False, timeout=60)
    model = workers.make_model(0)
    trainer.fit(model, torch.utils.data.DataLoader(workers.tiny_dataset(N), batch_size=batch_size, shuffle=True),
                optimizer=workers.sgd)
    types = sorted({f"{type(p).__name__}:{p.dtype}" for p in model.parameters()})
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in model.state_dict().items()}
    trainer.runtime.teardown()
    return {"state": state, "types": types}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("strategy", "ranks"), [("ddp", 2), ("fsdp", 2), ("hsdp", 4)])
def test_ranks_equal_a_plain_float64_loop_of_the_global_batch(tmp_path, strategy, ranks):
    epochs, b = 2, 16 // ranks  # the global batch of 16 on every layout
    if strategy == "ddp":
        results = run_distributed(workers.trainer_fit, str(tmp_path / "r"), b, epochs, {"precision": "64-true"},
                                  None, N, timeout=120)
    else:
        parallel = {"dp_replicate": 2, "dp_shard": 2} if strategy == "hsdp" else None
        results = run_distributed(_sharded_fit, str(tmp_path / "r"), b, epochs, strategy, parallel,
                                  world_size=ranks, timeout=150)
        assert results[0]["types"] == ["DTensor:torch.float64"]  # sharded, in float64
    reference = workers.plain_pytorch_reference(16, epochs, n=N, dtype=torch.float64)
    for key, ref in reference.items():
        torch.testing.assert_close(results[0]["state"][key], ref, **FLOAT64)
        for other in results[1:]:
            torch.testing.assert_close(other["state"][key], results[0]["state"][key], rtol=0, atol=0)


def test_the_planner_counts_8_bytes_a_gradient_and_refuses_a_gpu_it_has_no_float64_rate_for():
    from trainscale.models import ConvNet
    from trainscale.plan import planner

    sample = (torch.zeros(1, 28, 28), torch.tensor(0))
    plain = functools.partial(ConvNet, batchnorm=False)  # no buffers: the all-reduce carries gradients only
    rows = {precision: planner.plan(plain, sample=sample, devices=[2], batch_sizes=[16], strategies=["ddp"],
                                    precision=precision, link="10GB/s,latency=0us", device_flops=1e12).rows
            for precision in ("32-true", "64-true")}
    single, double = (rows[p][0] for p in ("32-true", "64-true"))
    assert double.comm_s == pytest.approx(2 * single.comm_s)  # the gradient all-reduce carries float64
    assert double.memory.parameters == 2 * single.memory.parameters
    assert double.memory.activations > single.memory.activations  # traced in float64
    with pytest.raises(ValueError, match="not the float64 ones of precision='64-true'; plan without gpu="):
        planner.plan(ConvNet, sample=sample, devices=[8], batch_sizes=[16], strategies=["ddp"], gpu="h100-sxm",
                     precision="64-true")


def test_telemetry_has_no_peak_and_so_no_mfu_for_float64():
    from trainscale.telemetry.flops import peak_flops_per_s

    assert peak_flops_per_s("NVIDIA H100 80GB HBM3", "32-true") > 0
    assert peak_flops_per_s("NVIDIA H100 80GB HBM3", "64-true") is None  # not fp32's peak


def test_the_model_summary_estimates_8_bytes_a_parameter(tmp_path, capsys):
    from trainscale.callbacks.model_summary import summarize

    net = nn.Linear(10, 20)  # 220 parameters
    assert [summarize(net, precision=p).size_mb for p in ("32-true", "bf16-mixed", "bf16-true", "64-true")] == \
        [220 * 4 / 1e6, 220 * 4 / 1e6, 220 * 2 / 1e6, 220 * 8 / 1e6]
    workers.trainer_fit(0, str(tmp_path / "d"), 16, 1, {"precision": "64-true", "enable_model_summary": True}, n=16)
    params = sum(p.numel() for p in workers.make_model().parameters())
    assert f"{params * 8 / 1e6:<10.3f}Total estimated model params size (MB)" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_tensor_parallelism_on_two_ranks_equals_one_float64_process():
    """The GPT of tests/parallel_workers.py under the built-in tp plan (float64 DTensors) against one process of
    the Runtime, itself held equal to plain PyTorch above; 4 SGD steps with clipping."""
    from tests import parallel_workers

    reference = parallel_workers.train_gpt(0, "single", None, 8, 4, precision="64-true")
    results = run_distributed(parallel_workers.train_gpt, "tp", None, 8, 4, None, True, None, "64-true", timeout=150)
    assert {v.dtype for v in results[0]["weights"].values()} == {torch.float64}
    for key, ref in reference["weights"].items():
        torch.testing.assert_close(results[0]["weights"][key], ref, **FLOAT64)
    assert results[0]["losses"] == pytest.approx(reference["losses"], rel=1e-12)


def _pp_fit(rank: int, root: str) -> dict:
    from tests import pipeline_workers

    return pipeline_workers.fit_gpt(rank, root, "pp", steps=2, precision="64-true", destroy=True)


@pytest.mark.multiprocess
def test_two_pipeline_stages_equal_one_float64_process(tmp_path):
    """The GPT of tests/pipeline_workers.py on 2 stages (1F1B) through the Trainer against one process: every
    stage's weights and the step's loss (float64 on every stage) after 2 steps with clipping."""
    from tests import pipeline_workers

    reference = pipeline_workers.fit_gpt(0, str(tmp_path / "single"), "single", steps=2, precision="64-true")
    results = run_distributed(_pp_fit, str(tmp_path / "pp"), timeout=150)
    for stage in results:
        assert {v.dtype for v in stage["weights"].values()} == {torch.float64}
        for key, value in stage["weights"].items():
            torch.testing.assert_close(value, reference["weights"][key], **FLOAT64)
        assert stage["losses"] == pytest.approx(reference["losses"], rel=1e-12)  # not rounded to float32
