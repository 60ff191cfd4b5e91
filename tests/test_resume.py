"""Stop after epoch 1, resume with ckpt_path="last": the same weights as an uninterrupted run."""

import json

import pytest
import torch

from tests import workers
from tests.helpers import run_distributed


@pytest.mark.multiprocess
def test_resume_after_epoch_matches_uninterrupted_ddp(tmp_path):
    results = run_distributed(workers.resume_body, str(tmp_path), timeout=180)
    for rank in results:
        assert rank["first"]["summary"]["epochs"] == 1
        assert rank["resumed"]["summary"]["epochs"] == 3  # the history continues
        for key, value in rank["full"]["state"].items():
            torch.testing.assert_close(rank["resumed"]["state"][key], value, rtol=0, atol=0)
    run_dir = results[0]["resumed"]["summary"]["run_dir"]
    assert run_dir == results[0]["first"]["summary"]["run_dir"]  # resumed in place
    epochs = [json.loads(l)["epoch"] for l in open(f"{run_dir}/metrics.jsonl") if '"kind": "epoch"' in l]
    assert epochs == [0, 1, 2]


def test_resume_single_process(tmp_path):
    n = 32  # two steps an epoch: enough for an exact comparison
    full = workers.trainer_fit(0, str(tmp_path / "a"), 16, 3, n=n)
    workers.trainer_fit(0, str(tmp_path / "b"), 16, 2, n=n)
    resumed = workers.trainer_fit(0, str(tmp_path / "b"), 16, 3, ckpt_path="last", n=n)
    for key, value in full["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=0, atol=0)
    assert resumed["summary"]["epoch_time_s"][:2] != []
