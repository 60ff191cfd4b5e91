"""ResumableDistributedSampler: DistributedSampler's order at position 0, and no sample lost or
repeated when an epoch is resumed on another world size. Also the stack-dump watchdog."""

import time
from collections import Counter

import pytest
from torch.utils.data import DistributedSampler

from trainscale.runtime.hangs import Watchdog
from trainscale.runtime.sampling import ResumableDistributedSampler


@pytest.mark.parametrize("n", [10, 11, 96])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_from_the_start_equals_distributed_sampler(n, world, shuffle):
    data = range(n)
    for rank in range(world):
        ours = ResumableDistributedSampler(data, world, rank, shuffle=shuffle, seed=4)
        ref = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=4)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref) and len(ours) == len(ref)


def _take(world: int, n: int, epoch: int, consumed: int, batches: int, batch: int) -> tuple[list[int], int]:
    """Ids trained on by all ranks in ``batches`` micro-batches from ``consumed``, and the new position."""
    samplers = [ResumableDistributedSampler(range(n), world, r, seed=1) for r in range(world)]
    ids = []
    for s in samplers:
        s.set_epoch(epoch, consumed)
        ids += list(s)[: batches * batch]
    return ids, samplers[0].consumed_after(batches, batch)


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 3), (4, 2)])
def test_resume_on_another_world_size_sees_every_sample_once(before, after):
    n, batch = 96, 4
    first, position = _take(before, n, 5, 0, 3, batch)
    assert position == 3 * batch * before
    rest, end = _take(after, n, 5, position, 10**6, batch)
    assert end == n
    counts = Counter(first + rest)
    assert sorted(counts) == list(range(n)) and set(counts.values()) == {1}


def test_padding_only_at_the_end_of_the_epoch():
    """7 samples left on 2 ranks: one sample of the epoch's start is repeated, last."""
    s0, s1 = (ResumableDistributedSampler(range(10), 2, r, shuffle=False) for r in (0, 1))
    for s in (s0, s1):
        s.set_epoch(0, consumed=3)
    assert list(s0) == [3, 5, 7, 9] and list(s1) == [4, 6, 8, 0] and len(s0) == 4


def test_bad_position():
    s = ResumableDistributedSampler(range(10), 2, 0)
    with pytest.raises(ValueError, match="consumed=11"):
        s.set_epoch(0, consumed=11)
    assert s.consumed_after(100, 4) == 10


def test_watchdog_dumps_stacks_after_a_stall(tmp_path):
    dog = Watchdog(tmp_path / "stacks" / "rank0.txt", after_s=0.2).start()
    time.sleep(1.0)  # a stall: no pet()
    dog.stop()
    text = (tmp_path / "stacks" / "rank0.txt").read_text()
    assert "Timeout (0:00:00.200000)!" in text and "test_watchdog_dumps_stacks_after_a_stall" in text


def test_watchdog_leaves_no_file_without_a_stall(tmp_path):
    dog = Watchdog(tmp_path / "rank0.txt", after_s=60).start()
    dog.pet()
    dog.stop()
    assert not (tmp_path / "rank0.txt").exists()
