"""Gradient clipping by norm and by value: DDP on 2 gloo ranks == plain PyTorch on one process with
the double batch; the total norm is logged at log intervals."""

import json

import pytest
import torch

from tests import workers_strategies
from tests.helpers import run_distributed
from trainscale.runtime.runtime import Runtime


@pytest.mark.multiprocess
def test_clipping_under_ddp_equals_plain_pytorch(tmp_path):
    epochs, b, n, max_norm, clip_val = 1, 8, 64, 0.5, 0.01
    out = run_distributed(workers_strategies.clipping_body, str(tmp_path), b, epochs, max_norm, clip_val, n,
                          timeout=150)
    ref_norm = workers_strategies.clipped_reference(b, epochs, max_norm=max_norm, n=n, ranks=2)
    ref_value = workers_strategies.clipped_reference(b, epochs, clip_val=clip_val, n=n, ranks=2)
    assert min(ref_norm["norms"]) > max_norm  # clipping was active at every step
    assert max(ref_value["max_abs"]) > clip_val
    unclipped = workers_strategies.clipped_reference(b, epochs, n=n, ranks=2)["state"]
    for kind, ref in (("norm", ref_norm), ("value", ref_value)):
        for key, expected in ref["state"].items():
            torch.testing.assert_close(out[0][kind][key], expected, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out[1][kind][key], out[0][kind][key], rtol=0, atol=0)
        assert any(not torch.allclose(ref["state"][k], unclipped[k]) for k in unclipped)
    # the Trainer logs the total norm before clipping (global: after the all-reduce) at each log interval
    records = [json.loads(line) for line in (tmp_path / "norm" / "version_0" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["grad_norm"] for r in records if r["kind"] == "step"]
    assert logged == pytest.approx(ref_norm["norms"], rel=1e-4)
    value_records = (tmp_path / "value" / "version_0" / "metrics.jsonl").read_text()
    assert "grad_norm" not in value_records  # clipping by value computes no norm


@pytest.mark.parametrize("kwargs", [{"max_norm": 0.0}, {"clip_val": -1.0}, {}, {"max_norm": 1.0, "clip_val": 1.0}])
def test_bad_clip_values(kwargs):
    rt = Runtime(accelerator="cpu")
    model, opt = rt.setup(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(ValueError, match="must be > 0|exactly one of max_norm or clip_val"):
        rt.clip_gradients(model, opt, **kwargs)
