"""What ``Runtime.setup_dataloader`` keeps from the user's loader and what it turns on (pinned memory on CUDA)."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainscale import Runtime

DATA = TensorDataset(torch.randn(16, 3), torch.arange(16))


def test_cpu_leaves_pin_memory_off_and_keeps_the_users_choices():
    rt = Runtime(accelerator="cpu", devices=1)
    out = rt.setup_dataloader(DataLoader(DATA, batch_size=4, shuffle=True))
    assert out.pin_memory is False
    kept = rt.setup_dataloader(DataLoader(DATA, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True,
                                          prefetch_factor=3))
    assert (kept.num_workers, kept.persistent_workers, kept.prefetch_factor) == (2, True, 3)  # never overridden
    assert rt.setup_dataloader(DataLoader(DATA, batch_size=4), pin_memory=True).pin_memory is True


def test_a_loader_returned_as_given_is_not_mutated():
    rt = Runtime(accelerator="cpu", devices=1)
    loader = DataLoader(DATA, batch_size=4, sampler=torch.utils.data.DistributedSampler(DATA, num_replicas=1, rank=0))
    assert rt.setup_dataloader(loader, pin_memory=True) is loader and loader.pin_memory is False


@pytest.mark.gpu
def test_cuda_pins_batches_by_default_and_can_opt_out():
    rt = Runtime(accelerator="cuda", devices=1)
    x, _ = next(iter(rt.setup_dataloader(DataLoader(DATA, batch_size=4, shuffle=True))))
    assert x.is_pinned()
    x, _ = next(iter(rt.setup_dataloader(DataLoader(DATA, batch_size=4), pin_memory=False)))
    assert not x.is_pinned()
