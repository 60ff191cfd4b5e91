"""CUDA code paths checked on CPU with torch.cuda's calls faked: when the clocks of the bench cell's data probe are
read, whether each run's peak CUDA memory starts afresh, and a finished Trainer being freed (the bench cell drops
its warm-up run's). Nothing here needs a GPU; the same paths on a GPU are in benchmarks/gpu_check.py."""

import gc
import time
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainscale.bench import cell
from trainscale.telemetry import nvml
from trainscale.telemetry.processor import Telemetry


def test_the_data_probe_reads_its_clock_after_the_copies_have_landed(monkeypatch):
    """``to_device``'s copies to a CUDA device are asynchronous (pinned memory, ``non_blocking``): a clock read
    without a synchronize would time the issuing of the copies, not the copies."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    clock = time.perf_counter
    monkeypatch.setattr(cell.time, "perf_counter", lambda: events.append("clock") or clock())
    rt = SimpleNamespace(device=torch.device("cuda", 0), set_epoch=lambda loader, epoch: None,
                         to_device=lambda batch: events.append("copy"))
    assert cell._probe_data(rt, [1, 2, 3, 4], batches=3) > 0
    assert events == ["sync", "clock", "copy", "copy", "copy", "sync", "clock"]


def test_each_telemetry_starts_a_new_cuda_peak(monkeypatch):
    """A second fit in one process (the bench cell's timed run after its warm-up) reported the first's peak:
    ``max_memory_allocated`` counts from the process start until ``reset_peak_memory_stats``."""
    resets = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(nvml, "_nvml_reader", lambda index: None)
    rt = SimpleNamespace(device=torch.device("cuda", 0), is_rank_zero=True, world_size=1, data_parallel_size=1,
                         config=SimpleNamespace(compile=None, precision="bf16-mixed", devices_per_process=1),
                         print=print)
    for _ in range(2):
        Telemetry(rt).close()
    assert resets == [torch.device("cuda", 0)] * 2


def test_a_cuda_peak_is_not_reset_before_cuda_is_initialised(monkeypatch):
    """torch raises "Invalid device argument" from ``reset_peak_memory_stats`` while CUDA is not initialised (its
    allocator's statistics do not exist yet): a Telemetry made first in a process (seen on an H200) must not."""
    from trainscale.telemetry.memory import PeakMemory

    def refuse(device=None):
        raise RuntimeError("Invalid device argument ")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", refuse)
    PeakMemory(torch.device("cuda", 0)).reset()


def test_a_finished_trainer_is_freed_once_dropped(tmp_path):
    """The bench cell drops its warm-up Trainer before the timed run, so that the warm-up's model copy and optimizer
    state are not held (on a GPU: not in the timed run's memory). The model refers back to its trainer: a cycle,
    freed by the collector."""
    from trainscale import Trainer
    from trainscale.models import GPT, lm_loss

    data = TensorDataset(torch.randint(0, 256, (16, 8)), torch.randint(0, 256, (16, 8)))
    trainer = Trainer(accelerator="cpu", max_steps=2, enable_progress_bar=False, enable_checkpointing=False,
                      default_root_dir=tmp_path, logger=False)
    model = GPT("tiny")
    trainer.fit(model, DataLoader(data, batch_size=4), loss_fn=lm_loss, optimizer=torch.optim.AdamW)
    refs = [weakref.ref(trainer), weakref.ref(model), weakref.ref(trainer.optimizers[0])]
    del trainer, model
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_a_compiled_gpt_gets_its_mfu_from_its_declared_flops_per_token(tmp_path):
    """Under ``compile`` FLOPs are not counted (a dispatch mode would make dynamo skip the model), so the MFU was
    null; the model's own ``flops_per_token`` (``GPT``'s, at the batch's sequence length) gives it."""
    from trainscale import Trainer
    from trainscale.models import GPT, lm_loss
    from trainscale.telemetry.flops import DECLARED

    compiled = []

    def backend(gm, example_inputs):  # dynamo traces the model; the graph then runs as traced, uncompiled
        compiled.append(gm)
        return gm.forward

    T = 16
    data = TensorDataset(torch.randint(0, 256, (32, T)), torch.randint(0, 256, (32, T)))
    model = GPT("tiny")
    trainer = Trainer(accelerator="cpu", max_steps=4, enable_progress_bar=False, enable_checkpointing=False,
                      default_root_dir=tmp_path, logger=False, compile={"backend": backend}, peak_flops=1e12)
    tele = trainer.fit(model, DataLoader(data, batch_size=4), loss_fn=lm_loss,
                       optimizer=torch.optim.AdamW)["telemetry"]
    torch._dynamo.reset()
    assert compiled, "the model ran eagerly"
    assert tele["flops_method"] == DECLARED
    assert tele["flops_per_sample"] == pytest.approx(model.flops_per_token(T) * T)
    assert tele["mfu"] == pytest.approx(tele["flops_per_sample"] * tele["samples_per_s"] / 1e12)


def test_declared_flops_per_token_is_found_inside_wrappers():
    from torch import nn

    from trainscale.telemetry.flops import declared_flops_per_token

    class Fixed(nn.Linear):
        def flops_per_token(self):
            return 6.0 * 12

    assert declared_flops_per_token(nn.Sequential(nn.ReLU(), nn.Sequential(Fixed(3, 4))))(99) == 72.0
    assert declared_flops_per_token(nn.Sequential(nn.Linear(3, 4))) is None


@pytest.mark.gpu
def test_on_a_gpu_a_second_fit_reports_its_own_peak(tmp_path):
    from trainscale import Trainer
    from trainscale.models import MLP

    peaks = []
    for hidden in (8192, 16):
        data = TensorDataset(torch.randn(256, 784), torch.randint(0, 10, (256,)))
        trainer = Trainer(accelerator="cuda", devices=1, max_steps=2, enable_progress_bar=False,
                          enable_checkpointing=False, logger=False, default_root_dir=tmp_path / str(hidden))
        summary = trainer.fit(MLP(hidden=hidden), DataLoader(data, batch_size=128), optimizer=torch.optim.AdamW)
        peaks.append(summary["telemetry"]["peak_memory_bytes"][0])
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
    # What stays allocated after both fits: cuBLAS's workspaces (one per thread and stream, 32 MiB each on Hopper),
    # allocated through the caching allocator by the first matmul and kept for the process; each peak holds them.
    resident = torch.cuda.memory_allocated()
    # 8192 hidden units: ~100 MB of weights, gradients and AdamW state; 16 hidden units: ~0.2 MB
    assert peaks[1] - resident < (peaks[0] - resident) / 10, (peaks, resident)
