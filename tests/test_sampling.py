import os
import warnings

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


# --- IterableDataset and uneven ranks -------------------------------------------------------------

from pathlib import Path  # noqa: E402

from torch.utils.data import DistributedSampler, IterableDataset  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "strategies.md"


def _docs_iterable_example() -> dict:
    """Run the IterableDataset example of docs/strategies.md; return its names (Lines, loader, ...)."""
    text = DOCS.read_text()
    block = text[text.index("**Iterable datasets.**"):]
    code = block[block.index("```python\n") + len("```python\n"):block.index("```\n", block.index("```python"))]
    names: dict = {"__name__": "docs_example"}
    exec(compile(code, str(DOCS), "exec"), names)
    return names


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_an_iterable_dataset_on_two_ranks_is_shared_by_batches_and_said_once():
    """Rank r of 2 keeps batches r, r + 2, ... of the 5 batches every rank reads; training drops the last, incomplete
    round (the same 2 steps on each rank), evaluation keeps it (each batch on one rank); rank 0 says so in a warning,
    rank 1 says nothing; world size 1 and a loader of a data set that shards itself are left alone."""
    loader = DataLoader(_Stream(), batch_size=2)  # batches [0, 1], [2, 3], ..., [8, 9]
    assert distribute_dataloader(loader, World()) is loader
    worlds = [World(world_size=2, rank=r, local_world_size=2, local_rank=r) for r in (0, 1)]
    with pytest.warns(UserWarning, match=r"_Stream is an IterableDataset: every rank reads it whole and rank r of 2 "
                                         r"keeps batches r, r \+ 2, .*last round .* dropped.*shards_by_rank = True"):
        train0 = distribute_dataloader(loader, worlds[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rank 1 is silent
        train1 = distribute_dataloader(loader, worlds[1])
        eval1 = distribute_dataloader(loader, worlds[1], even=False)
    with pytest.warns(UserWarning, match="none is dropped"):
        eval0 = distribute_dataloader(loader, worlds[0], even=False)
    assert [b.tolist() for b in train0] == [[0, 1], [4, 5]] and [b.tolist() for b in train1] == [[2, 3], [6, 7]]
    assert [b.tolist() for b in eval0] == [[0, 1], [4, 5], [8, 9]] and [b.tolist() for b in eval1] == [[2, 3], [6, 7]]
    assert train0.dataset is loader.dataset and train0.batch_size == 2
    with pytest.raises(TypeError):
        len(train0)  # an iterable's epoch ends when its iterator does

    _Stream.shards_by_rank = True
    try:
        assert distribute_dataloader(loader, worlds[1]) is loader
    finally:
        del _Stream.shards_by_rank


def test_a_shared_iterable_resumes_from_its_loaders_state_at_a_round_boundary():
    """A StatefulDataLoader shared by batches: its state after a batch is the end of that batch's round, so a loader
    given that state continues with the rank's next batch, none read twice or skipped."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is the stream extra")
    from trainscale.runtime.iterable_shard import ShardedIterableLoader

    shared = ShardedIterableLoader(stateful.StatefulDataLoader(list(range(12)), batch_size=2), 1, 2)
    batches = iter(shared)
    assert next(batches).tolist() == [2, 3]
    state = shared.state_dict()
    resumed = ShardedIterableLoader(stateful.StatefulDataLoader(list(range(12)), batch_size=2), 1, 2)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [[6, 7], [10, 11]] == [b.tolist() for b in batches]


def test_the_documented_sharded_iterable_dataset_splits_ranks_and_workers(monkeypatch):
    lines = _docs_iterable_example()["Lines"]
    seen = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        loader = DataLoader(lines(22), batch_size=4, num_workers=2, multiprocessing_context="fork")
        assert distribute_dataloader(loader, World(world_size=2, rank=rank, local_world_size=2, local_rank=rank)) \
            is loader
        mine = sorted(int(x[0].item()) for xb, _ in loader for x in xb)
        assert len(mine) == 11 == len(loader.dataset)
        seen.append(mine)
    assert sorted(seen[0] + seen[1]) == list(range(22))  # each sample on one rank and one worker only


class _UnevenSampler(DistributedSampler):
    """A user's sampler that does not pad: with 9 samples rank 0 gets 5, rank 1 gets 4."""

    def __iter__(self):
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self):
        return len(range(self.rank, len(self.dataset), self.num_replicas))


class _UnevenShards(IterableDataset):
    shards_by_rank = True

    def __iter__(self):
        return iter(range(int(os.environ["RANK"]), 9, 2))

    def __len__(self):
        return len(range(int(os.environ["RANK"]), 9, 2))


def _uneven_body(rank: int) -> list:
    from trainscale import Runtime

    rt = Runtime(accelerator="cpu", timeout=60)
    ds = TensorDataset(torch.arange(9.0))
    out = []
    for loader in (DataLoader(ds, batch_size=1, sampler=_UnevenSampler(ds, num_replicas=2, rank=rank)),
                   DataLoader(_UnevenShards(), batch_size=1)):
        try:
            rt.setup_dataloader(loader)
            out.append(None)
        except ValueError as err:
            out.append(str(err))
    even = DataLoader(ds, batch_size=1, sampler=DistributedSampler(ds, num_replicas=2, rank=rank))
    out.append(rt.setup_dataloader(even) is even)  # padded: equal lengths pass
    out.append(len(rt.setup_dataloader(DataLoader(ds, batch_size=1), even=False)))  # evaluation may differ
    rt.teardown()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ranks_with_different_numbers_of_batches_are_named_before_the_first_step():
    from tests.helpers import run_distributed

    results = run_distributed(_uneven_body, timeout=110)
    for uneven_sampler, uneven_shards, even_ok, eval_len in results:  # the same error on every rank
        assert uneven_sampler == results[0][0] and uneven_shards == results[0][1]
        assert "rank 0: 5, rank 1: 4" in uneven_sampler and "DistributedSampler" in uneven_sampler
        assert "drop_last=True" in uneven_sampler
        assert "rank 0: 5, rank 1: 4" in uneven_shards and "shards_by_rank" in uneven_shards
        assert even_ok
    assert [r[3] for r in results] == [5, 4]
