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


# -- Lightning's strategy objects: the flags they stand for (connector.strategy_object_flags) -------------------------
def _flags_of(strategy, **flags):
    from trainscale.runtime.connector import strategy_object_flags
    from trainscale.runtime.flags import RuntimeFlags

    return strategy_object_flags(RuntimeFlags(strategy=strategy, **flags))


def test_a_ddp_strategy_object_is_its_name_and_options_with_lightnings_keywords_as_flags():
    from datetime import timedelta

    from trainscale.strategies import DDPStrategy

    hook = lambda state, bucket: None  # noqa: E731
    flags, backend = _flags_of(DDPStrategy(find_unused_parameters=True, static_graph=True, gradient_as_bucket_view=True,
                                           bucket_cap_mb=50, ddp_comm_hook=hook, ddp_comm_state="state",
                                           timeout=timedelta(minutes=5), process_group_backend="gloo"))
    assert (flags.strategy, flags.timeout, backend) == ("ddp", 300.0, "gloo")
    assert flags.strategy_options == {"find_unused_parameters": True, "static_graph": True,
                                      "gradient_as_bucket_view": True, "bucket_cap_mb": 50, "ddp_comm_hook": hook,
                                      "ddp_comm_state": "state"}
    for method, name in [("popen", "ddp"), ("spawn", "ddp_spawn"), ("fork", "ddp_fork")]:
        assert _flags_of(DDPStrategy(start_method=method))[0].strategy == name
    assert _flags_of(DDPStrategy()) == (_flags_of("ddp")[0], None)  # nothing given: the plain name, no options
    assert _flags_of(DDPStrategy(timeout=None)) == (_flags_of("ddp")[0], None)  # Lightning's None: the default


def test_an_fsdp_strategy_object_maps_lightnings_sharding_and_checkpointing_keywords():
    from trainscale.strategies import FSDPStrategy

    flags, _ = _flags_of(FSDPStrategy(auto_wrap_policy={nn.Linear}, cpu_offload=True, sharding_strategy="SHARD_GRAD_OP",
                                      activation_checkpointing_policy={nn.Linear}, state_dict_type="sharded"))
    assert (flags.strategy, flags.activation_checkpointing) == ("fsdp", {nn.Linear})
    assert flags.strategy_options == {"auto_wrap_policy": {nn.Linear}, "cpu_offload": True,
                                      "reshard_after_forward": False}
    full_shard = _flags_of(FSDPStrategy(sharding_strategy="FULL_SHARD"))[0]
    assert full_shard.strategy_options == {"reshard_after_forward": True}


@pytest.mark.parametrize("make, message", [
    (lambda s: s.DDPStrategy(accelerator="gpu"), r"DDPStrategy\(accelerator=...\): pass the accelerator flag"),
    (lambda s: s.DDPStrategy(parallel_devices=[torch.device("cpu")] * 2), r"Trainer\(accelerator=..., devices=N\)"),
    (lambda s: s.DDPStrategy(precision_plugin=object()), r"precision_plugin=...\): pass the precision flag"),
    (lambda s: s.DDPStrategy(cluster_environment=object()), "cluster_environment=...\\): unsupported"),
    (lambda s: s.DDPStrategy(checkpoint_io=object()), "checkpoint_io=...\\): unsupported"),
    (lambda s: s.DDPStrategy(ddp_comm_wrapper=print), "ddp_comm_wrapper=...\\): unsupported: wrap your hook"),
    (lambda s: s.DDPStrategy(model_averaging_period=4), "model_averaging_period=...\\): unsupported"),
    (lambda s: s.DDPStrategy(broadcast_buffers=False), "strategy='ddp' does not accept option\\(s\\) "
                                                       "'broadcast_buffers'; its options are: find_unused_parameters"),
    (lambda s: s.DDPStrategy(start_method="forkserver"), "start_method='forkserver'\\): choose 'popen'"),
    (lambda s: s.FSDPStrategy(start_method="spawn"), "for DDPStrategy only"),
    (lambda s: s.DDPStrategy(timeout=60), r"must be a datetime.timedelta .*Trainer\(timeout=1800\)"),
    (lambda s: s.FSDPStrategy(sharding_strategy="NO_SHARD"), "pass strategy='ddp'"),
    (lambda s: s.FSDPStrategy(sharding_strategy="HYBRID_SHARD"), "pass strategy='hsdp'"),
    (lambda s: s.FSDPStrategy(state_dict_type="full"), "checkpoints of fsdp are sharded"),
    (lambda s: s.FSDPStrategy(mixed_precision=object()), "pass the precision flag"),
    (lambda s: s.FSDPStrategy(device_mesh=(2, 4)), "pass strategy='hsdp'"),
    (lambda s: s.ModelParallelStrategy(tensor_parallel_size=2), r"Trainer\(parallel=\{'dp_shard': D, 'tp': T\}\)"),
    (lambda s: s.ModelParallelStrategy(parallel={"tp": 2}), r"pass it as the flag: Trainer\(parallel=...\)"),
    (lambda s: s.SingleDeviceStrategy(device="cpu"), "built for a run"),
])
def test_lightnings_keywords_that_trainscale_takes_elsewhere_or_lacks_are_refused_naming_what_to_do(make, message):
    import trainscale.strategies as strategies

    with pytest.raises(ValueError, match=message):
        _flags_of(make(strategies))


def test_a_strategy_object_with_strategy_options_or_a_flag_given_twice_is_refused():
    from datetime import timedelta

    from trainscale.strategies import DDPStrategy, FSDPStrategy

    with pytest.raises(ValueError, match="pass them to it, not in strategy_options"):
        _flags_of(DDPStrategy(static_graph=True), strategy_options={"static_graph": True})
    with pytest.raises(ValueError, match=r"timeout is given twice: as timeout=60 and by strategy=DDPStrategy"):
        _flags_of(DDPStrategy(timeout=timedelta(minutes=5)), timeout=60)
    with pytest.raises(ValueError, match="activation_checkpointing is given twice"):
        _flags_of(FSDPStrategy(activation_checkpointing={nn.Linear}), activation_checkpointing={nn.ReLU})


def test_the_runtime_builds_its_own_strategy_from_an_object_and_checks_its_backend():
    from trainscale.runtime.runtime import Runtime
    from trainscale.strategies import DDPStrategy

    rt = Runtime(accelerator="cpu", devices=1, strategy=DDPStrategy(static_graph=True, process_group_backend="gloo"))
    assert (rt.flags.strategy, rt.strategy_options, rt.config.strategy) == ("ddp", {"static_graph": True}, "ddp")
    with pytest.raises(ValueError, match="process_group_backend='nccl', but with accelerator='cpu' the backend is "
                                         "'gloo'.*drop process_group_backend"):
        Runtime(accelerator="cpu", devices=1, strategy=DDPStrategy(process_group_backend="nccl"))
    with pytest.raises(TypeError, match=r"DDPStrategy\(\) got unexpected keyword argument\(s\) timeout"):
        DDPStrategy(torch.device("cpu"), World(), timeout=5)  # a bound strategy takes its own options only
