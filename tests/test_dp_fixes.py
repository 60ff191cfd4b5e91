"""DataParallel: the replicas run at the caller's autocast dtype, compiled modules are
refused, and MFU counts every GPU. nn.DataParallel needs CUDA; its thread behaviour is reproduced on CPU."""

import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from trainscale.runtime.connector import RunConfig, resolve
from trainscale.runtime.strategies.dp import DataParallelStrategy, _ScalarsAsVectors
from trainscale.runtime.world import World
from trainscale.telemetry.processor import _IDX, Telemetry


def _in_a_replica_thread(replica, x):
    """What torch.nn.parallel.parallel_apply does per replica: a new thread, autocast re-entered with the
    enabled flag only (its dtype is thread-local and so lost)."""
    out = {}

    def run():
        with torch.autocast("cpu", enabled=True):  # autocast's default dtype on CPU: bfloat16
            out["y"] = replica(x)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out["y"]


def test_replicas_run_at_the_callers_autocast_dtype():
    replica = _ScalarsAsVectors(nn.Linear(4, 4), device_type="cpu")
    replica.autocast_dtype = torch.float16  # set by DataParallelModule.forward from the caller's autocast
    assert _in_a_replica_thread(replica, torch.randn(2, 4)).dtype == torch.float16
    replica.autocast_dtype = None
    assert _in_a_replica_thread(replica, torch.randn(2, 4)).dtype == torch.bfloat16  # parallel_apply's own


def test_data_parallel_module_passes_the_autocast_dtype_to_its_replicas():
    from trainscale.runtime.strategies.dp import DataParallelModule

    wrapped = DataParallelModule(nn.Linear(4, 4), device_ids=[])  # without CUDA: calls the module directly
    wrapped.parallel.module.device_type = "cpu"
    with torch.autocast("cpu", dtype=torch.float16):
        assert wrapped(torch.randn(2, 4)).dtype == torch.float16
    assert wrapped.parallel.module.autocast_dtype == torch.float16
    wrapped(torch.randn(2, 4))
    assert wrapped.parallel.module.autocast_dtype is None


def test_dp_refuses_compile():
    with pytest.raises(ValueError, match="strategy='dp' cannot run a compiled module.*strategy='ddp'"):
        resolve(strategy="dp", cuda_count=2, compile=True)
    strategy = DataParallelStrategy(device=torch.device("cpu"), world=World(), device_ids=[0, 1])
    module = nn.Linear(2, 2)
    module.compile()  # lazy: nothing compiles until the first call
    with pytest.raises(ValueError, match="GPU 0's weights"):
        strategy.setup_module(module)


def test_mfu_and_per_device_throughput_count_every_gpu_under_dp():
    assert RunConfig("cuda", 4, 1, "dp", "bf16-mixed").devices_per_process == 4
    assert RunConfig("cuda", 4, 2, "ddp", "bf16-mixed").devices_per_process == 1
    config = RunConfig("cuda", 4, 1, "dp", "bf16-mixed")
    rt = SimpleNamespace(device=torch.device("cpu"), config=config, is_rank_zero=True, world_size=1,
                         data_parallel_size=1, strategy=None)
    tele = Telemetry(rt, peak_flops=100e12)
    tele.flops.value = 1e9
    fields = {"steps": 10.0, "wall": 1.0, "samples": 4000.0, "loss": float("nan"), "gpu_util": float("nan")}
    row = [fields.get(name, 0.0) for name in _IDX]  # one rank: 10 steps, 4000 samples in 1 s
    numbers = tele._numbers([row], per_rank=False)
    assert numbers["samples_per_s"] == 4000.0 and numbers["samples_per_s_per_device"] == 1000.0
    assert numbers["mfu"] == pytest.approx(4000 * 1e9 / (4 * 100e12))


@pytest.mark.gpu
def test_dp_bf16_mixed_runs_bfloat16_in_every_replica():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from trainscale.runtime.runtime import Runtime

    rt = Runtime(accelerator="cuda", devices=2, strategy="dp", precision="bf16-mixed")
    model, _ = rt.setup(nn.Linear(8, 8))
    seen = []
    model.module.register_forward_hook(lambda m, i, out: seen.append((out.device.index, out.dtype)))
    with rt.autocast():
        model(torch.randn(8, 8, device=rt.device))
    assert sorted(seen) == [(0, torch.bfloat16), (1, torch.bfloat16)]
