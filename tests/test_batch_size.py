"""The batch-size finder (trainscale.tune.find_batch_size, Trainer(batch_size="max")): the search logic with a
fake "fits", a real search on CPU under a memory budget, the Trainer rebuilding its loader, and 2 gloo ranks
with different budgets agreeing on the smaller rank's batch, which then trains within both budgets."""

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests import tune_workers
from tests.helpers import run_distributed
from trainscale.models import ConvNet
from trainscale.tune import BatchSizeError, find_batch_size, search


def _fake(threshold: int, calls: list):
    def fits(size: int) -> bool:
        calls.append(size)
        return size <= threshold
    return fits


@pytest.mark.parametrize("threshold", [1, 2, 3, 7, 8, 71, 500, 1023])
def test_search_finds_the_largest_size_that_fits(threshold):
    calls = []
    assert search(_fake(threshold, calls), start=1, limit=4096) == threshold
    assert calls[:3] == [1, 2, 4][:len(calls[:3])] and len(calls) == len(set(calls))  # no size tried twice
    grown = [c for c in calls if c & (c - 1) == 0]
    assert max(grown) <= 2 * threshold  # the growth stopped at the first failure


def test_search_path_is_powers_of_two_then_a_binary_search():
    calls = []
    assert search(_fake(71, calls)) == 71
    assert calls == [1, 2, 4, 8, 16, 32, 64, 128, 96, 80, 72, 68, 70, 71]


def test_search_respects_limit_start_and_trials():
    calls = []
    assert search(_fake(10**6, calls), start=3, limit=100) == 100 and calls == [3, 6, 12, 24, 48, 96, 100]
    assert search(_fake(10**6, []), start=1, limit=None, max_trials=5) == 16  # trials ran out: the largest fit
    assert search(_fake(5, []), start=1, limit=None, max_trials=4) == 4
    with pytest.raises(BatchSizeError, match="not even a batch of 4"):
        search(_fake(3, []), start=4)
    with pytest.raises(ValueError, match="start=0"):
        search(_fake(3, []), start=0)


def _data(n=256):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


BUDGET = 8 * 2**20


@pytest.fixture(scope="module")
def cpu_search() -> dict:
    """One real search on CPU within :data:`BUDGET`: the model searched with, its weights before, the size found
    and the trials (the Trainer's test expects the same size from its own search)."""
    model = ConvNet()
    before = [p.detach().clone() for p in model.parameters()]
    trials = []
    found = find_batch_size(model, F.cross_entropy, _data(), optimizer=tune_workers.adamw, accelerator="cpu",
                            devices=1, strategy="single", max_memory=BUDGET, trials=trials)
    return {"model": model, "before": before, "found": found, "trials": trials}


def test_cpu_search_stays_within_the_budget_and_leaves_the_model_unchanged(cpu_search):
    model, before, found, trials = (cpu_search[k] for k in ("model", "before", "found", "trials"))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    peaks = {t.batch_size: t.peak_bytes for t in trials}
    assert peaks[found] <= BUDGET < peaks[min(s for s in peaks if s > found)]  # the next size tried went over
    assert found + 1 in peaks and peaks[found + 1] > BUDGET  # the binary search ended next to the boundary
    assert all(t.fits_here == t.fits_all == (t.peak_bytes <= BUDGET) for t in trials)
    sizes = sorted(peaks)
    assert all(peaks[a] < peaks[b] for a, b in zip(sizes, sizes[1:]))  # bigger batches, more bytes


def test_bad_finder_input_names_the_fix():
    with pytest.raises(ValueError, match="max_memory=<bytes>"):
        find_batch_size(ConvNet(), F.cross_entropy, _data(), optimizer=tune_workers.adamw, accelerator="cpu",
                        devices=1, strategy="single")
    with pytest.raises(ValueError, match="max_memory=0"):
        find_batch_size(ConvNet(), F.cross_entropy, _data(), max_memory=0)
    with pytest.raises(ValueError, match="batch_size='maximum'; choose None or 'max'"):
        from trainscale.loop.trainer import Trainer

        Trainer(accelerator="cpu", devices=1, batch_size="maximum")


def test_trainer_batch_size_max_rebuilds_the_loader_with_the_found_size(tmp_path, cpu_search):
    from trainscale.loop.trainer import Trainer

    expected = cpu_search["found"]  # find_batch_size's answer for the same model, data and budget
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, batch_size="max", max_memory=BUDGET,
                      default_root_dir=tmp_path, enable_progress_bar=False, enable_checkpointing=False, logger=False)
    loader = DataLoader(_data(), batch_size=4, shuffle=True)
    summary = trainer.fit(ConvNet(), loader, loss_fn=F.cross_entropy, optimizer=tune_workers.adamw)
    assert expected > 4 and summary["global_batch_size"] == expected


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_ranks_with_different_budgets_agree_on_the_smaller_batch_which_then_trains_within_them(tmp_path):
    out = run_distributed(tune_workers.search_then_train, str(tmp_path), world_size=2, timeout=200)
    small, large = out
    assert small["found"] == large["found"] and small["unchanged"] and large["unchanged"]
    # rank 1 alone would have taken a larger batch: some size fit there but not on rank 0
    assert any(t["fits_here"] and not t["fits_all"] for t in large["trials"])
    assert not any(t["fits_here"] and not t["fits_all"] for t in small["trials"])
    for rank in out:
        assert rank["train_peak"] <= rank["budget"], rank
