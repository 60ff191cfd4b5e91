import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainscale.runtime.sampling import UnpaddedDistributedSampler, distribute_dataloader
from trainscale.runtime.world import World


@pytest.mark.parametrize("n, world", [(10, 3), (1001, 2), (5, 8), (4, 2)])
def test_unpadded_covers_each_sample_once(n, world):
    ds = list(range(n))
    seen = []
    for r in range(world):
        s = UnpaddedDistributedSampler(ds, world, r, shuffle=True, seed=1)
        s.set_epoch(3)
        got = list(s)
        assert len(got) == len(s)
        seen += got
    assert sorted(seen) == list(range(n))


def test_ranks_together_take_the_single_process_batches():
    """Micro-batch i of W ranks with batch b == batch i of one process with batch W*b (parity basis)."""
    ds = TensorDataset(torch.arange(64))
    world, b = 2, 4
    single = distribute_dataloader(DataLoader(ds, batch_size=world * b, shuffle=True), World(), seed=5)
    single.sampler.set_epoch(2)
    per_rank = []
    for r in range(world):
        loader = distribute_dataloader(DataLoader(ds, batch_size=b, shuffle=True), World(world_size=world, rank=r,
                                                                                         local_world_size=world,
                                                                                         local_rank=r), seed=5)
        loader.sampler.set_epoch(2)
        per_rank.append([batch[0] for batch in loader])
    for i, (batch,) in enumerate(single):
        union = torch.cat([per_rank[r][i] for r in range(world)])
        assert sorted(union.tolist()) == sorted(batch.tolist())


def test_loader_settings_are_kept():
    ds = TensorDataset(torch.arange(10))
    out = distribute_dataloader(DataLoader(ds, batch_size=3, drop_last=True), World())
    assert out.batch_size == 3 and out.drop_last and len(out) == 3


def test_unsplittable_loader_is_refused_when_distributed():
    ds = TensorDataset(torch.arange(10))
    loader = DataLoader(ds, batch_sampler=[[0, 1], [2, 3]])
    assert distribute_dataloader(loader, World()) is loader
    with pytest.raises(ValueError, match="DistributedSampler yourself"):
        distribute_dataloader(loader, World(world_size=2, local_world_size=2))
