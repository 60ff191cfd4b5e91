"""Mid-epoch resume through a loader that keeps its own position (torchdata's StatefulDataLoader): the resumed
run reads no consumed sample again, trains on exactly the samples the uninterrupted run did after that point
(the loop's read-ahead is not counted as trained), and ends with the same weights; on one process and 2-rank ddp."""

import os
import re
import warnings

import pytest
import torch
from torch.utils.data import IterableDataset

from tests import test_iterable_data as iterable_tests
from tests.helpers import run_distributed
from trainscale.checkpointing.loader_state import LoaderPositions
from trainscale.loop.trainer import Trainer

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is the stream extra")


class Counter(IterableDataset):
    """``n`` samples per rank per epoch (rank r of W: r, r + W, ...), its read position kept as its own state
    (torchdata restores it instead of re-reading); ``reads`` records every sample read. ``whole``: every rank yields
    the same ``n`` samples 0, 1, ... (no ``shards_by_rank``: the Trainer shares its batches among the ranks)."""

    shards_by_rank = True

    def __init__(self, n: int, whole: bool = False):
        self.n, self.pos, self.reads = n, 0, []
        self.shards_by_rank = not whole

    def __iter__(self):
        rank, world = (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))) if self.shards_by_rank \
            else (0, 1)
        while self.pos < self.n:
            i = rank + world * self.pos
            self.pos += 1
            self.reads.append(i)
            yield torch.tensor([float(i), 1.0]), torch.tensor(i % 2)
        self.pos = 0  # the next epoch starts anew

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class Seen(iterable_tests.Seen):
    """Records every training sample; the same initial weights in every run."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__()


def _fit(root, ckpt_path=None, teardown=False, n=6, whole=False, **flags):
    model, data = Seen(), Counter(n, whole)  # 6: 3 batches of 2 per epoch
    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=2, enable_progress_bar=False,
                      default_root_dir=root, timeout=60, **flags)
    trainer.fit(model, stateful_dataloader.StatefulDataLoader(data, batch_size=2), ckpt_path=ckpt_path)
    if teardown:
        trainer.runtime.teardown()
    return {"seen": model.seen, "reads": data.reads, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def stop_and_resume_body(rank: int, root: str, teardown: bool = True, saved_elsewhere: str | None = None,
                         **data) -> dict:
    """The uninterrupted run; a run stopped after step 2 (mid-epoch 0) with a checkpoint there; its resume.
    ``saved_elsewhere``: a mid-epoch checkpoint of another world size, resumed first ("refused": its error)."""
    whole = _fit(os.path.join(root, "whole"), **data)
    cut = _fit(os.path.join(root, "cut"), checkpoint_every_n_steps=2, max_steps=2, **data)
    out = {"whole": whole, "cut": cut}
    if saved_elsewhere is not None:
        with pytest.raises(ValueError) as refused:
            _fit(os.path.join(root, "elsewhere"), ckpt_path=saved_elsewhere, **data)
        out["refused"] = str(refused.value)
    out["resumed"] = _fit(os.path.join(root, "cut"), ckpt_path="last", teardown=teardown, **data)
    return out


def own_and_shared_body(rank: int, root: str, saved_elsewhere: str) -> dict:
    """``stop_and_resume_body`` with a data set that shards itself (and a checkpoint of another world size refused),
    then with one every rank reads whole (12 samples: 6 batches, 3 per rank), with the warning rank 0 gives about
    it."""
    own = stop_and_resume_body(rank, os.path.join(root, "own"), teardown=False, saved_elsewhere=saved_elsewhere)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shared = stop_and_resume_body(rank, os.path.join(root, "shared"), n=12, whole=True)
    return {"own": own, "shared": shared, "said": [str(w.message) for w in caught if "IterableDataset" in str(w.message)]}


def _check_exact(run: dict, per_rank: list) -> None:
    whole, cut, resumed = run["whole"], run["cut"], run["resumed"]
    assert whole["seen"] == per_rank * 2 and cut["seen"] == per_rank[:4]
    assert cut["seen"] + resumed["seen"] == whole["seen"]  # no sample skipped or repeated
    # the stopped run read one sample ahead of training (the loop reads one batch ahead): not counted as consumed
    assert cut["reads"] == per_rank
    assert resumed["reads"] == per_rank[4:] + per_rank  # the consumed samples are not read again
    for key, value in whole["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_a_stateful_dataloader_resumes_an_iterable_mid_epoch_exactly(tmp_path):
    _check_exact(stop_and_resume_body(0, str(tmp_path)), list(range(6)))


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_under_ddp_each_rank_resumes_its_own_loader_state_and_another_world_size_is_refused(tmp_path):
    """Each rank's loader state resumed exactly: of a data set that shards itself, and of one every rank reads whole,
    which the Trainer shares by batches (rank r keeps batches r, r + 2, ...; rank 0 says so once): the resumed run
    reads from the round after the last trained batch and ends with the uninterrupted run's weights. A mid-epoch
    checkpoint of 2 ranks resumed on 1, or of 1 resumed on 2, is refused before the first step naming both fixes."""
    _fit(str(tmp_path / "one"), checkpoint_every_n_steps=2, max_steps=2)  # one process, stopped mid-epoch 0
    saved_on_one = next((tmp_path / "one").glob("version_0/checkpoints/epoch=0-step=2.ckpt"))
    results = run_distributed(own_and_shared_body, str(tmp_path), str(saved_on_one), timeout=50)
    for rank, run in enumerate(results):
        _check_exact(run["own"], [rank + 2 * k for k in range(6)])
        assert re.search(r"saved for each of its 1 ranks.*over 2 ranks\. Resume on 1 ranks, or use a map-style",
                         run["own"]["refused"]), run["own"]["refused"]
        shared, mine = run["shared"], [i for b in (rank, rank + 2, rank + 4) for i in (2 * b, 2 * b + 1)]
        assert shared["whole"]["seen"] == mine * 2 and shared["cut"]["seen"] == mine[:4]
        assert shared["cut"]["seen"] + shared["resumed"]["seen"] == shared["whole"]["seen"]
        assert shared["resumed"]["reads"] == list(range(8, 12)) + list(range(12))  # from round 2 of epoch 0 on
        for key, value in shared["whole"]["state"].items():
            torch.testing.assert_close(shared["resumed"]["state"][key], value, rtol=0, atol=0)
    assert len(results[0]["said"]) == 3 and "rank r of 2 keeps batches r, r + 2" in results[0]["said"][0]
    assert results[1]["said"] == []
    mid_epoch = next((tmp_path / "own" / "cut").glob("version_0/checkpoints/epoch=0-step=2.ckpt"))
    with pytest.raises(ValueError, match=r"saved for each of its 2 ranks.*Resume on 2 ranks, or use a map-style"):
        _fit(str(tmp_path / "one-from-two"), ckpt_path=mid_epoch)


def test_loader_positions_give_the_state_after_the_batches_trained_not_those_read_ahead():
    loader = stateful_dataloader.StatefulDataLoader(list(range(10)), batch_size=2)
    positions = LoaderPositions(loader)
    for _ in range(3):  # read 3 batches, as a loop two batches ahead of training on the first
        next(positions)
    assert positions.state_after(1)["_num_yielded"] == 1 and positions.state_after(3)["_num_yielded"] == 3
    loader.load_state_dict(positions.state_after(1))
    assert [b.tolist() for b in loader] == [[2, 3], [4, 5], [6, 7], [8, 9]]
    with pytest.raises(RuntimeError, match="not kept"):
        positions.state_after(5)
