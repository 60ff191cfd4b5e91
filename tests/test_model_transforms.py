"""Transformations applied before the strategy wraps the model (runtime/apply.py): activation
checkpointing, SyncBatchNorm conversion, torch.compile — and their order against DDP."""

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from tests import workers_strategies as ws
from trainscale.models import ConvNet
from trainscale.runtime.apply import apply_activation_checkpointing, apply_sync_batchnorm, is_compiled
from trainscale.runtime.runtime import Runtime
from trainscale.loop.trainer import Trainer


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _grads(activation_checkpointing):
    torch.manual_seed(0)
    rt = Runtime(accelerator="cpu", activation_checkpointing=activation_checkpointing)
    model, opt = rt.setup(ws.BlockNet(), lambda p: torch.optim.SGD(p, lr=0.1))
    x, y = ws.mlp_data(32)[:32]
    for _ in range(2):  # two steps: the second starts from updated weights
        opt.zero_grad(set_to_none=True)
        rt.backward(F.cross_entropy(model(x), y))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        rt.step(opt)
    return model, grads


def test_activation_checkpointing_gives_the_same_gradients_and_recomputes():
    plain, plain_grads = _grads(None)
    ckpt, ckpt_grads = _grads({ws.Block})
    assert plain_grads.keys() == ckpt_grads.keys()  # parameter names unchanged (no wrapper module)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=0, atol=0)
    assert [b.calls for b in plain.blocks] == [2, 2]  # one forward per step
    assert [b.calls for b in ckpt.blocks] == [4, 4]  # plus one recomputation in each backward
    assert plain.state_dict().keys() == ckpt.state_dict().keys()


def test_activation_checkpointing_with_a_class_not_in_the_model():
    with pytest.raises(ValueError, match=r"matches no module of the model; its module classes are: .*Block.*Linear"):
        apply_activation_checkpointing(ws.BlockNet(), (nn.Conv2d,))
    with pytest.raises(ValueError, match="matches no module of the model"):
        apply_activation_checkpointing(ws.BlockNet(), ("Conv2d",))
    with pytest.raises(ValueError, match="nn.Module classes or class names"):
        Runtime(accelerator="cpu", activation_checkpointing={"Block", 3})


def test_activation_checkpointing_by_class_name():
    """A class name (Hugging Face's ``_no_split_modules`` style, e.g. "LlamaDecoderLayer") selects as the class does."""
    assert Runtime(accelerator="cpu", activation_checkpointing={"Block"}).config.activation_checkpointing == ("Block",)
    net = apply_activation_checkpointing(ws.BlockNet(), ("Block",))
    wrapped = [type(m).__name__ for m in net.modules() if "forward" in m.__dict__]
    assert wrapped and set(wrapped) == {"Block"}


def test_sync_batchnorm_conversion_keeps_weights_and_changes_types():
    torch.manual_seed(0)
    model = ConvNet(batchnorm=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = {type(m) for m in model.modules()}
    assert nn.BatchNorm2d in kinds and nn.SyncBatchNorm not in kinds
    converted = apply_sync_batchnorm(model)
    kinds = {type(m) for m in converted.modules()}
    assert nn.SyncBatchNorm in kinds and not any(issubclass(k, nn.modules.batchnorm._BatchNorm) and k is not
                                                 nn.SyncBatchNorm for k in kinds)
    assert converted.state_dict().keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(converted.state_dict()[key], value)


def _world_of_one(tmp_path):
    """A real gloo process group of one process in this process (no spawn): DDP and SyncBatchNorm need one.
    (The FileStore removes its file when the group is destroyed.)"""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)


def test_sync_batchnorm_on_cpu_fails_early_and_torch_refuses_cpu_tensors(tmp_path):
    with pytest.raises(ValueError, match=r"sync_batchnorm=True needs CUDA.*GroupNorm"):
        Trainer(accelerator="cpu", devices=2, sync_batchnorm=True)
    # Why: torch 2.13's SyncBatchNorm forward refuses CPU tensors once a process group exists.
    # If this starts to pass, torch supports CPU and the resolver's rule can go.
    _world_of_one(tmp_path)
    try:
        bn = nn.SyncBatchNorm(4)
        with pytest.raises(ValueError, match="expected input tensor to be on GPU"):
            bn(torch.randn(8, 4))
    finally:
        dist.destroy_process_group()


def test_compile_is_applied_inside_ddp_not_around_it(tmp_path):
    """torch.compile(DDP(model)) silently runs eager (torch 2.13, gloo); DDP(compiled model) compiles."""
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    _world_of_one(tmp_path)
    rt = model = None
    try:
        rt = Runtime(accelerator="cpu", strategy="ddp", compile={"backend": recording_backend})
        model, _ = rt.setup(ws.BlockNet())
        assert isinstance(model, nn.parallel.DistributedDataParallel) and is_compiled(model.module)
        x, y = ws.mlp_data(8)[:8]
        F.cross_entropy(model(x), y).backward()
        assert graphs, "the backend was never called: the model ran eagerly"
    finally:
        # Free DDP (its Reducer holds the process group) before destroying the group: freeing it after
        # deadlocked once in ~ProcessGroupGloo inside the pytest process (torch 2.13).
        model = None
        gc.collect()
        if rt is not None:
            rt.teardown()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch._dynamo.reset()


def test_bad_compile_arguments():
    with pytest.raises(ValueError, match=r"unknown torch.compile arguments \['mdoe'\]; valid ones: .*mode"):
        Runtime(accelerator="cpu", compile={"mdoe": "max-autotune"})
    with pytest.raises(ValueError, match="must be True, False or a dict"):
        Runtime(accelerator="cpu", compile="yes")


class _Probe(nn.Module):
    """Records whether its forward ran under torch.compile (``torch.compiler.is_compiling``)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(16, 4)  # the smallest graph: cold inductor time is mostly per kernel
        self.compiled_calls = 0

    def forward(self, x):
        if torch.compiler.is_compiling():
            self.compiled_calls += 1
        return self.net(x)


def test_compile_true_with_inductor_matches_eager(tmp_path_factory, request, monkeypatch):
    """One real inductor compile: forward and backward of Linear + cross-entropy (cold: tens of seconds
    on this machine; warm runs reuse the cache in .pytest_cache/d/torchinductor)."""
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    cache_dir = cache.mkdir("torchinductor") if cache is not None else tmp_path_factory.mktemp("torchinductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    losses = {}
    for compile in (False, True):
        torch.manual_seed(0)
        trainer = Trainer(accelerator="cpu", max_epochs=1, enable_progress_bar=False, enable_checkpointing=False,
                          default_root_dir=tmp_path_factory.mktemp("runs"), compile=compile, log_every_n_steps=1)
        model = _Probe()
        loader = torch.utils.data.DataLoader(ws.mlp_data(64), batch_size=16)
        trainer.fit(model, loader, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        losses[compile] = [h["train_loss"] for h in trainer.history]
        assert (model.compiled_calls > 0) == compile
    torch._dynamo.reset()
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_telemetry_does_not_turn_compile_off(tmp_path):
    """FLOP counting runs the first micro-batch under FlopCounterMode; under compile that made dynamo skip
    the model for the whole run (0 compiled calls). Telemetry must leave compile alone."""
    calls = []

    def recording_backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    torch.manual_seed(0)
    trainer = Trainer(accelerator="cpu", max_epochs=1, enable_progress_bar=False, enable_checkpointing=False,
                      default_root_dir=tmp_path, compile={"backend": recording_backend}, log_every_n_steps=1)
    summary = trainer.fit(_Probe(), torch.utils.data.DataLoader(ws.mlp_data(64), batch_size=16),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    torch._dynamo.reset()
    assert calls, "the model ran eagerly"
    assert summary["telemetry"]["flops_per_sample"] is None
