"""CUDA paths the first GPU lease runs (benchmarks/gpu_check.py's gpu_tests stage runs every `gpu` test): the
batch-size finder through real CUDA out-of-memory errors, NVML utilisation while the GPU computes, and DDP's
all-reduce timed with CUDA events on a one-rank NCCL group. Where a CPU can play the same path, a CPU test does
it with a fake (the finder's out-of-memory path); the rest are skipped without CUDA, and their CPU counterparts
are named in docs/gpu-results.md."""

import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from trainscale.tune import find_batch_size

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none on this machine")
FEATURES = 65536  # one sample: 256 KiB of float32 inputs


def _search_until_out_of_memory(batch, accelerator: str, max_memory: int | None) -> tuple[int, list]:
    trials = []
    found = find_batch_size(nn.Linear(FEATURES if accelerator == "cuda" else 32, 4), F.cross_entropy, batch,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.01), accelerator=accelerator, devices=1,
                            max_memory=max_memory, start=8, trials=trials)
    return found, trials


def test_the_finder_treats_an_out_of_memory_error_as_does_not_fit_on_cpu():
    """The finder's except path, with the error a CUDA allocation raises, thrown where the batch is allocated."""
    def batch(size: int):
        if size > 40:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} samples")
        return torch.randn(size, 32), torch.zeros(size, dtype=torch.long)

    found, trials = _search_until_out_of_memory(batch, "cpu", max_memory=2**30)
    assert found == 40
    failed = [t for t in trials if not t.fits_here]
    assert failed and all(t.peak_bytes is None and t.batch_size > 40 for t in failed)


@pytest.mark.gpu
@needs_cuda
def test_the_finder_stops_at_real_cuda_out_of_memory_errors():
    """The caching allocator capped at 1 GiB (``set_per_process_memory_fraction``): batches of 256 KiB samples
    grow until a real ``torch.OutOfMemoryError``; the size found fits, and the search frees what it allocated."""
    limit = 2**30
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(0)
    torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory, 0)
    try:
        def batch(size: int):
            return (torch.empty(size, FEATURES, device="cuda").normal_(),
                    torch.zeros(size, dtype=torch.long, device="cuda"))

        found, trials = _search_until_out_of_memory(batch, "cuda", max_memory=None)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
    failed = [t for t in trials if not t.fits_here]
    assert failed and all(t.peak_bytes is None for t in failed)  # real out-of-memory errors, caught
    assert 8 <= found and found * FEATURES * 4 <= limit
    assert all(t.fits_here for t in trials if t.batch_size <= found)
    assert torch.cuda.memory_allocated(0) - before < 2**20


@pytest.mark.gpu
@needs_cuda
def test_nvml_sees_the_gpu_busy():
    pytest.importorskip("pynvml", reason="NVML sampling needs nvidia-ml-py (pip install 'trainscale[gpu]')")
    from trainscale.telemetry.nvml import GpuSampler

    sampler = GpuSampler(0, interval_s=0.05)
    assert sampler.available
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    sampler.start()
    started = time.monotonic()
    while time.monotonic() - started < 2.0:  # back-to-back GEMMs: the GPU is never idle for long
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
    sampler.stop()
    samples = sampler.take()
    assert len(samples) >= 5
    assert max(util for _, util, _ in samples) >= 50 and all(used > 0 for _, _, used in samples)


@pytest.mark.gpu
@needs_cuda
def test_ddp_allreduce_timed_with_cuda_events_on_one_gpu():
    """DDP on a one-rank NCCL group still hands every bucket to its communication hook: the (ready, done) CUDA
    events of telemetry's hook fall inside backward, and the exposed part inside the communication time."""
    from trainscale import Runtime
    from trainscale.telemetry.timers import StepTimer

    rt = Runtime(accelerator="cuda", devices=1, strategy="ddp", timeout=60).launch()
    try:
        model, opt = rt.setup(nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)),
                              lambda p: torch.optim.SGD(p, lr=0.01))
        timer = StepTimer(rt.device, time_comm=True)
        assert rt.strategy.time_allreduce(model, timer.clock, timer.record_comm)
        x = torch.randn(256, 1024, device=rt.device)
        for _ in range(3):
            timer.start()
            loss = model(x).square().mean()
            timer.mark("forward")
            rt.backward(loss)
            timer.mark("backward")
            rt.step(opt)
            opt.zero_grad(set_to_none=True)
            timer.end_step("optimizer")
        steps = timer.collect()
    finally:
        rt.teardown()
    assert len(steps) == 3
    for step in steps:
        assert step.comm_s is not None and 0 < step.comm_s <= step.phase_s["backward"] * 1.05
        assert 0 <= step.exposed_comm_s <= step.comm_s


_TIMEOUT_SCRIPT = """
import torch, torch.distributed as dist
from trainscale import Runtime
rt = Runtime(accelerator="cuda", devices=1, strategy="ddp", timeout=5).launch()
x = torch.ones(1 << 20, device=rt.device)
dist.all_reduce(x)  # completes: the recorder holds one finished collective
torch.cuda.synchronize()
torch.cuda._sleep(30 * 2_000_000_000)  # ~30 s of spinning at ~2 GHz: the next all-reduce waits behind it
dist.all_reduce(x)
torch.cuda.synchronize()  # NCCL's watchdog times the all-reduce out after 5 s and writes the dump
print("the all-reduce was not timed out")
"""


@pytest.mark.gpu
@needs_cuda
def test_an_nccl_timeout_writes_the_flight_recorder_dump(tmp_path):
    """The Runtime switches on PyTorch's flight recorder and its dump on timeout before an NCCL group (the user
    sets nothing): a collective stuck behind a long kernel times out, and the dump (a pickle, what
    ``torchfrtrace`` reads) names the all-reduce that did not complete, after the one that did. The process is
    not waited for: on an H200 with torch 2.11 it was still alive 50 s after the dump (its CUDA calls wait for
    the spinning kernel); on a real hang NCCL's heartbeat monitor ends it."""
    import os
    import pickle
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCH_NCCL_", "TORCH_FR_", "NCCL_ASYNC")) and k not in ("RANK", "WORLD_SIZE")}
    env["TORCH_FR_DUMP_TEMP_FILE"] = str(tmp_path / "nccl_trace_rank_")
    dump_path = tmp_path / "nccl_trace_rank_0"
    proc = subprocess.Popen([sys.executable, "-c", _TIMEOUT_SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 40  # start-up ~10 s, timeout 5 s, dump ~5 s after it
        while not dump_path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(1.0)  # the file is written in one go; let a write that just began finish
    finally:
        os.killpg(proc.pid, 9)
        output = proc.communicate()[0]
    assert dump_path.exists(), output[-3000:]
    dump = pickle.loads(dump_path.read_bytes())
    collectives = [e for e in dump["entries"] if "all_reduce" in e["profiling_name"]]
    assert [(e["collective_seq_id"], e["state"]) for e in collectives] == [(1, "completed"), (2, "scheduled")], \
        dump["entries"]
    assert collectives[-1]["input_sizes"] == [[1 << 20]], collectives[-1]
    assert "Watchdog caught collective operation timeout" in output, output[-3000:]
