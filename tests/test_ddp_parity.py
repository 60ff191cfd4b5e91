"""DDP over 2 real gloo processes against plain PyTorch in one process (DESIGN: parity is the
main correctness check). Same seed, same samples: per-rank batch b on 2 ranks == batch 2b. N samples: two steps
an epoch are enough for a parity check (each step of the small ConvNet is most of a test's time on CPU)."""

import pytest
import torch

from tests import workers
from tests.helpers import run_distributed

pytestmark = pytest.mark.multiprocess
N = 32


def test_ddp_two_ranks_equals_single_process_double_batch(tmp_path):
    epochs, b = 2, 8
    results = run_distributed(workers.trainer_fit, str(tmp_path / "ddp"), b, epochs, None, None, N, timeout=120)
    reference = workers.plain_pytorch_reference(2 * b, epochs, n=N)
    assert results[0]["summary"]["world_size"] == 2 and results[0]["summary"]["strategy"] == "ddp"
    assert results[0]["summary"]["global_batch_size"] == 2 * b
    for key, ref in reference.items():
        torch.testing.assert_close(results[0]["state"][key], ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(results[1]["state"][key], results[0]["state"][key], rtol=0, atol=0)


def test_single_process_trainer_equals_plain_loop(tmp_path):
    out = workers.trainer_fit(0, str(tmp_path), 16, 2, n=N)
    for key, ref in workers.plain_pytorch_reference(16, 2, n=N).items():
        torch.testing.assert_close(out["state"][key], ref, rtol=1e-5, atol=1e-6)


def test_accumulation_equals_larger_batch(tmp_path):
    """4 micro-batches of 4 with accumulation == one batch of 16 (a mean over the same samples)."""
    out = workers.trainer_fit(0, str(tmp_path), 4, 2, extra={"accumulate_grad_batches": 4}, n=N)
    assert out["summary"]["steps"] == 2 * N // 16
    for key, ref in workers.plain_pytorch_reference(16, 2, n=N).items():
        torch.testing.assert_close(out["state"][key], ref, rtol=1e-5, atol=1e-6)
