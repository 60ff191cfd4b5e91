"""The resolver's rules for dp, ddp_spawn, sync_batchnorm, activation checkpointing and compile
(pure logic: the machine's facts are arguments), and dp's wrapper logic."""

import pytest
import torch
from torch import nn

from trainscale.runtime.connector import resolve
from trainscale.runtime.strategies.dp import DataParallelModule, DataParallelStrategy
from trainscale.runtime.world import World
from trainscale.loop.trainer import Trainer


def test_dp_needs_two_cuda_gpus_and_recommends_ddp():
    for kwargs in ({}, {"accelerator": "cpu", "devices": 2}, {"cuda_count": 1}, {"cuda_count": 4, "devices": 1},
                   {"cuda_count": 4, "devices": 2, "num_nodes": 2}):
        with pytest.raises(ValueError, match=r"strategy='dp' \(nn.DataParallel\) drives 2 or more CUDA GPUs.*"
                                             r"pass strategy='ddp'"):
            resolve(strategy="dp", **kwargs)


def test_dp_is_one_process_over_all_gpus():
    c = resolve(strategy="dp", cuda_count=4)
    assert (c.accelerator, c.devices, c.strategy, c.world_size) == ("cuda", 4, "dp", 1)
    assert resolve(strategy="dp", devices=2, cuda_count=4).devices == 2


def test_dp_without_gpus_from_the_trainer():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has several GPUs")
    with pytest.raises(ValueError, match="pass strategy='ddp'"):
        Trainer(accelerator="cpu", strategy="dp")


def test_ddp_spawn_is_one_machine():
    assert resolve(strategy="ddp_spawn", devices=2).world_size == 2
    with pytest.raises(ValueError, match="ddp_spawn' starts processes on this machine only"):
        resolve(strategy="ddp_spawn", devices=2, num_nodes=2)


def test_sync_batchnorm_rules():
    assert resolve("cuda", 2, "ddp", sync_batchnorm=True, cuda_count=2).sync_batchnorm
    with pytest.raises(ValueError, match="needs CUDA: torch.nn.SyncBatchNorm refuses cpu tensors"):
        resolve("cpu", 2, "ddp", sync_batchnorm=True)
    with pytest.raises(ValueError, match="across ddp processes, but strategy='single'"):
        resolve(sync_batchnorm=True)
    with pytest.raises(ValueError, match="must be True or False"):
        resolve(sync_batchnorm="yes")


def test_activation_checkpointing_and_compile_values():
    assert resolve(activation_checkpointing=nn.Linear).activation_checkpointing == (nn.Linear,)
    assert resolve(activation_checkpointing={nn.Linear, nn.Conv2d}).activation_checkpointing
    assert resolve().activation_checkpointing == () and resolve().compile is None
    assert resolve(compile=True).compile == {} and resolve(compile={"mode": "reduce-overhead"}).compile
    for bad in (nn.Linear(2, 2), "Linear", [nn.Linear, 3]):
        with pytest.raises(ValueError, match="nn.Module classes"):
            resolve(activation_checkpointing=bad)


class _Loss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(x).mean()


def test_dataparallel_wrapper_plumbing_on_cpu():
    """Without CUDA, nn.DataParallel calls the module directly: this checks our wrapper's handling of a
    scalar loss (one per replica, averaged) and unwrapping, not the parallelism (GPU test below)."""
    torch.manual_seed(0)
    module = _Loss()
    wrapped = DataParallelModule(module, device_ids=[])
    x = torch.randn(8, 3)
    loss = wrapped(x)
    assert loss.ndim == 0 and torch.equal(loss, module(x))
    strategy = DataParallelStrategy(torch.device("cpu"), World(), device_ids=[])
    assert strategy.unwrap(wrapped) is module
    assert wrapped.state_dict().keys() != module.state_dict().keys()  # why checkpoints unwrap first


@pytest.mark.gpu
def test_dp_on_gpus_equals_one_gpu(tmp_path):
    """nn.DataParallel over 2 GPUs, batch 16 split 8+8 == one GPU with batch 16 (same samples)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from torch.utils.data import DataLoader

    from tests import workers_strategies as ws

    states = {}
    for strategy, devices in (("single", 1), ("dp", 2)):
        torch.manual_seed(0)
        model = ws.BlockNet()
        trainer = Trainer(accelerator="cuda", devices=devices, strategy=strategy, max_epochs=2, seed=0,
                          default_root_dir=tmp_path / strategy, enable_progress_bar=False)
        trainer.fit(model, DataLoader(ws.mlp_data(64), batch_size=16, shuffle=True),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        states[strategy] = {k: v.cpu() for k, v in model.state_dict().items()}
    for key, value in states["single"].items():
        torch.testing.assert_close(states["dp"][key], value, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_sync_batchnorm_trains_under_ddp_on_cuda():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from tests.helpers import run_distributed
    from tests.workers_strategies import sync_batchnorm_cuda_body

    out = run_distributed(sync_batchnorm_cuda_body, timeout=180)
    assert out[0]["converted"] and out[0]["running_mean"] == out[1]["running_mean"]


@pytest.mark.gpu
def test_16_mixed_with_grad_scaler_on_cuda():
    from tests import workers_strategies as ws
    from torch.nn import functional as F

    from trainscale.runtime.runtime import Runtime

    rt = Runtime(accelerator="cuda", devices=1, precision="16-mixed")
    model, opt = rt.setup(ws.BlockNet(), lambda p: torch.optim.SGD(p, lr=0.1))
    x, y = rt.to_device(ws.mlp_data(32)[:32])
    seen = {}
    model.blocks[0].fc1.register_forward_hook(lambda m, i, out: seen.update(dtype=out.dtype))
    with rt.autocast():
        loss = F.cross_entropy(model(x), y)
    rt.backward(loss)
    norm = rt.clip_gradients(model, opt, max_norm=1.0)
    rt.step(opt)
    assert seen["dtype"] == torch.float16 and torch.isfinite(norm) and rt.precision.scaler.get_scale() > 1


@pytest.mark.parametrize("precision", ["16-true", "fp16", "float16"])
def test_unsupported_precisions_list_the_valid_ones(precision):
    with pytest.raises(ValueError, match=rf"unknown precision='{precision}'; choose one of '32-true', '16-mixed', "
                                         r"'bf16-mixed', 'bf16-true'"):
        Trainer(accelerator="cpu", precision=precision)
