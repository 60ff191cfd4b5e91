"""Meta-device construction: shard first, then allocate and initialise only this rank's shards."""

import pytest
import torch
from torch import nn

from tests.helpers import run_distributed
from tests.parallel_workers import fsdp_meta_gpt
from trainscale.runtime import meta_init


class _RawParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_materialise_initialises_through_reset_parameters():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
    assert meta_init.on_meta(model)
    meta_init.check_initialisable(model)
    meta_init.materialise(model, torch.device("cpu"))
    assert not meta_init.on_meta(model)
    assert torch.equal(model[1].weight, torch.ones(16)) and torch.isfinite(model[0].weight).all()
    assert 0.05 < model[0].weight.std() < 0.3  # kaiming-uniform with fan-in 8: U(-1/√8, 1/√8), std 0.204


def test_seed_offset_separates_shards_and_moves_the_generator_by_one_draw():
    def build(offset):
        torch.manual_seed(0)
        with torch.device("meta"):
            layer = nn.Linear(8, 8)
        meta_init.materialise(layer, torch.device("cpu"), seed_offset=offset)
        return layer.weight.detach().clone(), torch.rand(())

    (w0, after0), (w0_again, _), (w1, after1) = build(0), build(0), build(1)
    assert torch.equal(w0, w0_again) and not torch.equal(w0, w1)
    torch.manual_seed(0)
    torch.randint(0, 2 ** 31, ())
    assert after0 == after1 == torch.rand(())  # the caller's stream continues the same on every rank


def test_uninitialisable_and_partly_meta_models_are_refused():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), _RawParameter())
    with pytest.raises(ValueError, match=r"1 \(_RawParameter\) own parameters or buffers with no init_weights"):
        meta_init.check_initialisable(model)
    model.init_weights = lambda: None  # an init_weights on the root covers every submodule
    meta_init.check_initialisable(model)
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to("meta"))
    with pytest.raises(ValueError, match="some parameters or buffers on the meta device and some not"):
        meta_init.on_meta(mixed)


def test_strategies_that_cannot_materialise_refuse_a_meta_model():
    from trainscale.runtime.runtime import Runtime

    rt = Runtime(accelerator="cpu", devices=1)
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device.*strategy='single' cannot materialise.*strategy='fsdp'"):
        rt.setup(model)
    rt.teardown()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_fsdp_meta_built_gpt_trains_with_half_the_parameter_bytes_per_rank():
    results = run_distributed(fsdp_meta_gpt, 25, world_size=2, timeout=150)
    full = results[0]["full_bytes"]
    for r in results:
        assert r["finite"]
        assert r["param_bytes"] <= 0.55 * full, (r["param_bytes"], full)
        assert r["losses"][-1] < r["losses"][0] - 1.0, r["losses"]  # from ~ln 256 = 5.5
    assert sum(r["param_bytes"] for r in results) >= full  # the shards cover the model (plus padding)
    assert results[0]["losses"] == results[1]["losses"]
    assert not torch.equal(results[0]["shard"], results[1]["shard"])  # not one shard's values repeated
