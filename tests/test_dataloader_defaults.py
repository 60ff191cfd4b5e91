"""What ``Runtime.setup_dataloader`` keeps from the user's loader and what it turns on (pinned memory on CUDA)."""

import dataclasses

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
    assert rt.setup_dataloader(loader) is loader
    pinned = rt.setup_dataloader(loader, pin_memory=True)  # a copy that pins, with the same sampler
    assert pinned is not loader and pinned.pin_memory and pinned.sampler is loader.sampler
    assert loader.pin_memory is False


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(DATA)


def test_loaders_returned_as_given_are_pinned_on_cuda():
    """An IterableDataset at world size 1, a custom batch sampler, a DistributedSampler: no new sampler, so the loader
    was returned as given, and on CUDA its batches stayed in pageable memory (the non_blocking copies then wait for
    the host). The device is faked: only its type is read."""
    rt = Runtime(accelerator="cpu", devices=1).launch()
    rt.device = torch.device("cuda", 0)
    batches = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(DATA), batch_size=5, drop_last=False)
    loaders = [DataLoader(Stream(), batch_size=4), DataLoader(DATA, batch_sampler=batches),
               DataLoader(DATA, batch_size=4, sampler=torch.utils.data.DistributedSampler(DATA, 1, 0, shuffle=False))]
    for loader in loaders:
        out = rt.setup_dataloader(loader)
        assert out.pin_memory and not loader.pin_memory
        out.pin_memory = False  # the same batches (pinning itself needs a GPU)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(out, loader)) and len(list(out)) == len(list(loader))


def test_a_dataloader_subclass_is_never_rebuilt():
    class Mine(DataLoader):
        pass

    rt = Runtime(accelerator="cpu", devices=1)
    loader = Mine(Stream(), batch_size=4)
    assert rt.setup_dataloader(loader, pin_memory=True) is loader


def test_recommended_workers_split_this_processs_cpus_across_the_ranks_of_the_node(monkeypatch):
    rt = Runtime(accelerator="cpu", devices=1)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert rt.dataloader_kwargs() == {"num_workers": 7, "persistent_workers": True, "pin_memory": False}
    rt.world = dataclasses.replace(rt.world, local_world_size=4)  # 8 CPUs, 4 ranks on the node: 2 each, one trains
    assert rt.dataloader_kwargs()["num_workers"] == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})  # 2 CPUs, 4 ranks: no worker
    assert rt.dataloader_kwargs() == {"num_workers": 0, "persistent_workers": False, "pin_memory": False}
    loader = DataLoader(DATA, batch_size=4, **rt.dataloader_kwargs())  # DataLoader accepts them
    assert len(list(loader)) == 4


@pytest.mark.gpu
def test_cuda_pins_batches_by_default_and_can_opt_out():
    rt = Runtime(accelerator="cuda", devices=1)
    x, _ = next(iter(rt.setup_dataloader(DataLoader(DATA, batch_size=4, shuffle=True))))
    assert x.is_pinned()
    x, _ = next(iter(rt.setup_dataloader(DataLoader(DATA, batch_size=4), pin_memory=False)))
    assert not x.is_pinned()
    x, _ = next(iter(rt.setup_dataloader(DataLoader(Stream(), batch_size=4))))  # returned as given before
    assert x.is_pinned()


def test_prefetch_is_the_batches_themselves_off_cuda():
    rt = Runtime(accelerator="cpu", devices=1)
    loader = rt.setup_dataloader(DataLoader(DATA, batch_size=4))
    assert rt.prefetch(loader) is loader  # nothing to overlap on a CPU: no wrapper, no frame per batch


@pytest.mark.gpu
def test_prefetch_copies_every_batch_to_cuda_in_order():
    rt = Runtime(accelerator="cuda", devices=1)
    loader = rt.setup_dataloader(DataLoader(DATA, batch_size=4))  # pinned on CUDA: the copies overlap
    got = [rt.to_device(batch) for batch in rt.prefetch(loader)]
    want = list(loader)
    assert len(got) == len(want) == 4
    for moved, original in zip(got, want):
        assert all(t.is_cuda for t in moved)
        assert all(torch.equal(t.cpu(), w) for t, w in zip(moved, original))
