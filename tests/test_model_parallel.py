"""Model parallelism on one device mesh: tensor parallel and HSDP against one process (parity), the
flag resolver, and DCP checkpoints read back on another layout."""

import functools

import pytest
import torch

from tests.helpers import run_distributed
from tests.pipeline_workers import fit_then_evaluate
from tests.parallel_workers import CONFIG, predict_gpt, tp_fp16_setup_error, train_gpt, train_gpt_layouts
from trainscale.runtime.connector import resolve
from trainscale.runtime.strategies.parallel_dims import ParallelDims

STEPS = 2  # exact parity needs no more: the second step already applies the first one's momentum


def _assert_same_weights(got: dict, want: dict) -> float:
    """rtol 1e-5 in fp32 (atol 1e-7 for elements near zero); returns the largest absolute difference."""
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    return max((got[n] - want[n]).abs().max().item() for n in want)


@functools.lru_cache(maxsize=None)
def _reference(batch_size: int) -> dict:
    """One process over the global batch (shared by the tests that need the same one)."""
    return train_gpt(0, "single", None, batch_size, STEPS)


def _check_parity(results: list, reference: dict, label: str, max_state_ratio: float) -> None:
    """Every rank ends at the one-process weights, losses and clipped norms (clipping active at every
    step) and holds at most ``max_state_ratio`` of its training-state bytes (parameters, gradients,
    momentum); prints the largest weight difference and the state ratio of each rank."""
    for r in results:
        diff = _assert_same_weights(r["weights"], reference["weights"])
        assert r["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert r["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert min(r["norms"]) > 0.5  # clipping was active at every step
        ratio = r["state_bytes"] / reference["state_bytes"]
        print(f"{label}: max |weight difference| {diff:.2e}, state bytes {r['state_bytes']} of "
              f"{reference['state_bytes']} ({ratio:.3f})")
        assert ratio <= max_state_ratio, (r["state_bytes"], reference["state_bytes"])
        # gradients and momentum sharded like their parameters (a whole gradient of a split parameter
        # would make its momentum whole too: the row-split position embedding did)
        assert r["state_bytes"] == 3 * r["param_bytes"]
        # gradients are laid out as their parameters: the sequence-parallel norms' partial sums are reduced
        assert r["partial"] == []


# -- the resolver: pure logic ------------------------------------------------------------------
def test_parallel_layouts_and_shorthands():
    cfg = resolve("cpu", 4, "model_parallel", parallel={"dp_shard": 2, "tp": 2})
    assert cfg.parallel == ParallelDims(dp_replicate=1, dp_shard=2, tp=2) and cfg.world_size == 4
    assert resolve("cpu", 2, "tp").parallel == ParallelDims(tp=2)
    assert resolve("cpu", 4, "tp", num_nodes=2).parallel == ParallelDims(dp_shard=2, tp=4)
    assert resolve("cpu", 4, "hsdp", num_nodes=2).parallel == ParallelDims(dp_replicate=2, dp_shard=4)
    assert resolve("cpu", 4, "hsdp", parallel={"dp_replicate": 2, "dp_shard": 2}).parallel.dp_size == 4
    assert resolve("cpu", 2, "ddp").parallel is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="model_parallel"), r"needs parallel=\{'dp_replicate'"),
    (dict(strategy="model_parallel", parallel={"dp_shard": 2, "tp": 4}), "multiplies to 8 ranks"),
    (dict(strategy="model_parallel", parallel={"tp": 2, "cp": 2}), "context parallelism .* is not supported"),
    (dict(strategy="model_parallel", parallel={"tp": 4, "sp": 1}), "unknown parallel dimension 'sp'"),
    (dict(strategy="model_parallel", parallel={"tp": 4.0}), "must be an int >= 1"),
    (dict(strategy="hsdp"), "strategy='hsdp' .* dp_replicate ≥ 2"),
    (dict(strategy="tp", parallel={"dp_shard": 4}), "strategy='tp' splits layers over tp ≥ 2"),
    (dict(strategy="model_parallel", parallel={"dp_replicate": 4}), "replicates without sharding"),
    (dict(strategy="ddp", parallel={"tp": 4}), "parallel describe.*strategy='ddp'"),
    (dict(strategy="fsdp", tp_plan={"fc": None}), "tp_plan describe.*strategy='fsdp'"),
    (dict(strategy="model_parallel", parallel={"dp_shard": 4}, tp_plan={"fc": None}), "has tp=1"),
    (dict(strategy="tp", tp_plan={"fc": None}, parallelize=lambda m, mesh: m), "not both"),
    (dict(strategy="tp", parallelize="fn"), "must be a function fn"),
])
def test_bad_layouts_are_refused_before_any_process_group(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve("cpu", 4, **kwargs)


def test_mesh_coordinates_are_row_major():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2)
    assert [dims.coordinates(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # tp neighbours share data


# -- parity with one process (gloo, real processes) -------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_tp_over_two_ranks_matches_one_process_and_its_checkpoint_loads_in_one_process(tmp_path):
    import torch.distributed.checkpoint as dcp

    reference = _reference(8)
    results = run_distributed(train_gpt, "tp", None, 8, STEPS, str(tmp_path / "ckpt"), world_size=2, timeout=200)
    # every matrix split, the tied embedding included; only the norms (0.1 % here) stay whole
    _check_parity(results, reference, "tp 2", max_state_ratio=0.55)
    # the DCP checkpoint written by the 2 tensor-parallel ranks loads into a plain model in this process
    from trainscale.models import GPT

    state = {"model": GPT(CONFIG).state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    _assert_same_weights(state["model"], reference["weights"])


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_tp_without_sequence_parallelism_matches_one_process():
    results = run_distributed(train_gpt, "tp", None, 8, STEPS, None, {"sequence_parallel": False}, world_size=2,
                              timeout=200)
    _check_parity(results, _reference(8), "tp 2 without sequence parallelism", max_state_ratio=0.55)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy, parallel, world_size", [("tp", None, 2), ("pp", {"pp": 2}, 2),
                                                           ("model_parallel", {"pp": 2, "dp_shard": 2}, 4)])
def test_predict_under_tp_and_pp_returns_each_sample_once_in_dataset_order(strategy, parallel, world_size):
    """The ranks that read the same batches (tp ranks, pipeline stages) give one copy of their predictions, not
    one each interleaved (before the fix, tp: 20 rows for 10 sequences, each twice); under pp the last stage's
    outputs of a forward-only schedule step without loss, on every rank (before: refused)."""
    from trainscale.models import GPT

    n = 10  # batches of 4, 4, 2 (over 2 data-parallel ranks: uneven)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    ids = torch.randint(0, CONFIG.vocab_size, (n, CONFIG.context_length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids)
    for out in run_distributed(predict_gpt, n, strategy, parallel, world_size=world_size, timeout=200):
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_tp_under_16_mixed_trains_with_the_built_in_plan_and_refuses_plain_norms_on_every_rank():
    """torch's GradScaler unscales a rank's gradients in one call, which DTensor refuses for a mix of DTensors and
    plain tensors: the built-in plan with sequence parallelism (every parameter a DTensor) trains and ends near one
    "16-mixed" process; a user's plan that leaves the norms plain is refused at set-up on both ranks, naming them
    (before the fix: a deep DTensor RuntimeError at the first optimizer step). The built-in plan without sequence
    parallelism is refused when the strategy is built
    (test_sequence_parallel_flag_is_checked_when_the_strategy_is_built)."""
    reference = train_gpt(0, "single", None, 8, STEPS, precision="16-mixed")
    for r in run_distributed(train_gpt, "tp", None, 8, STEPS, None, True, None, "16-mixed", world_size=2, timeout=200):
        for name, want in reference["weights"].items():
            torch.testing.assert_close(r["weights"][name], want, rtol=0, atol=5e-5)
        assert r["losses"] == pytest.approx(reference["losses"], rel=5e-5)
    errors = run_distributed(tp_fp16_setup_error, world_size=2, timeout=200)
    for err in errors:
        assert "precision='16-mixed' under tensor parallelism" in err
        assert "plain on this rank: ['wte.weight', 'wpe.weight', 'blocks.0.ln_1.weight'" in err


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_sequence_parallelism_keeps_the_norms_inputs_for_half_the_tokens_and_the_same_logits():
    from tests.parallel_workers import saved_activation_bytes

    B, T, C, L, tp = 8, CONFIG.context_length, CONFIG.n_embd, CONFIG.n_layer, 2
    for r in run_distributed(saved_activation_bytes, B, world_size=tp, timeout=200):
        for label in ("tp", "tp+sp"):
            torch.testing.assert_close(r[f"{label} logits"], r["single logits"], rtol=1e-5, atol=1e-6)
        # each LayerNorm (2 per block, and ln_f) saves its input (B, T, C) and mean and rstd (B, T, 1) in fp32;
        # under sequence parallelism for T/tp tokens. The all-gathered inputs of q/k/v and mlp.fc stay whole.
        norms = (2 * L + 1) * B * T * (C + 2) * 4
        print(f"saved for backward per rank: one process {r['single']}, tp {r['tp']}, tp+sp {r['tp+sp']} bytes")
        assert r["tp"] - r["tp+sp"] == norms * (tp - 1) // tp
        assert r["tp+sp"] < r["tp"] < r["single"]



# The three 4-rank layouts train one after the other in the same 4 processes (one start of 4 Python
# processes instead of three; each layout builds its own Runtime and mesh on the one process group).
FOUR_RANK_LAYOUTS = {"hsdp 2x2": ("hsdp", {"dp_replicate": 2, "dp_shard": 2}),
                     "fsdp 2 x tp 2": ("model_parallel", {"dp_shard": 2, "tp": 2}),
                     "fsdp 4": ("fsdp", None)}


@pytest.fixture(scope="module")
def four_rank_runs() -> dict:
    """Each layout's results on each of the 4 ranks: ``{label: [rank 0, ..., rank 3]}``."""
    results = run_distributed(train_gpt_layouts, tuple((label, strategy, parallel, 4, STEPS)
                                                       for label, (strategy, parallel) in FOUR_RANK_LAYOUTS.items()),
                              world_size=4, timeout=400)
    return {label: [rank[label] for rank in results] for label in FOUR_RANK_LAYOUTS}


@pytest.mark.multiprocess
@pytest.mark.timeout(450)
def test_hsdp_2x2_matches_one_process_with_the_global_batch(four_rank_runs):
    _check_parity(four_rank_runs["hsdp 2x2"], _reference(4 * 4), "hsdp 2x2",
                  max_state_ratio=0.55)  # sharded over a replica's 2 ranks


@pytest.mark.multiprocess
@pytest.mark.timeout(450)
def test_fsdp_tp_2x2_matches_one_process_with_the_data_parallel_batch(four_rank_runs):
    # 2 data-parallel groups of 2 tensor-parallel ranks: each tp pair reads one batch of 4, so the
    # reference is one process over 2 × 4 samples per step
    _check_parity(four_rank_runs["fsdp 2 x tp 2"], _reference(2 * 4), "fsdp 2 x tp 2", max_state_ratio=0.27)


@pytest.mark.multiprocess
@pytest.mark.timeout(450)
def test_fsdp_over_four_ranks_holds_a_quarter_of_the_training_state(four_rank_runs):
    _check_parity(four_rank_runs["fsdp 4"], _reference(4 * 4), "fsdp 4", max_state_ratio=0.27)


# -- helpers that need no process group --------------------------------------------------------
def test_a_users_plan_is_matched_against_the_model_or_the_trainers_loop_module_around_it():
    from torch import nn

    from trainscale.runtime.strategies.apply_tp import plan_target

    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 8))
    model.add_module("proj", nn.Linear(8, 4))
    loop = nn.Module()
    loop.model = model  # what the Trainer hands the strategy
    plan = {"fc": "colwise", "p*": "rowwise"}
    assert plan_target(model, plan) is model and plan_target(loop, plan) is model
    with pytest.raises(ValueError, match=r"tp_plan key\(s\) \['mlp.fc'\] name no submodule"):
        plan_target(loop, {"mlp.fc": "colwise"})


def test_clipping_plain_gradients_equals_torch():
    from trainscale.runtime.strategies.dtensor_clip import clip_grad_norm

    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    a(torch.randn(7, 5)).square().sum().backward()
    for p, q in zip(a.parameters(), b.parameters()):
        q.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)
    got = clip_grad_norm(b.parameters(), 0.1)
    assert got == want and want > 0.1
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_tp_ranks_share_their_batches_so_global_batch_and_throughput_count_them_once(tmp_path):
    from tests.parallel_workers import fit_gpt

    results = run_distributed(fit_gpt, "tp", str(tmp_path), 4, 3, world_size=2, timeout=200)
    summary, records = results[0]["summary"], results[0]["records"]
    assert summary["global_batch_size"] == 4  # one data-parallel rank × batch 4 (not × the 2 tp ranks)
    steps = [r for r in records if r.get("kind") == "step"]
    epoch = next(r for r in records if r.get("kind") == "epoch")
    assert [r["samples"] for r in steps] == [4, 4, 4]
    assert epoch["samples_per_s"] * epoch["epoch_time_s"] == pytest.approx(12)  # 3 steps × 4 samples
    assert epoch["tokens_per_s"] * epoch["epoch_time_s"] == pytest.approx(12 * CONFIG.context_length)
    assert summary["samples_per_s"] * sum(summary["epoch_time_s"]) == pytest.approx(12)


@pytest.mark.parametrize("options, message", [
    (dict(sequence_parallel="yes"), "must be True, False or None"),
    (dict(sequence_parallel=True, tp_plan={"fc": None}), "applies to the built-in GPT tensor-parallel plan"),
    (dict(sequence_parallel=True, parallel={"dp_shard": 2}), "applies to the built-in GPT tensor-parallel plan"),
    (dict(sequence_parallel=False, precision="16-mixed"), r"16-mixed' under tp with .*'sequence_parallel': False"),
])
def test_sequence_parallel_flag_is_checked_when_the_strategy_is_built(options, message):
    from trainscale.runtime.precision import Precision
    from trainscale.runtime.strategies.model_parallel import ModelParallelStrategy
    from trainscale.runtime.world import World

    options = {"parallel": {"tp": 2}, **options}
    if "precision" in options:  # the run's Precision, as the Runtime passes it
        options["precision"] = Precision(options["precision"], "cpu")
    with pytest.raises(ValueError, match=message):
        ModelParallelStrategy(torch.device("cpu"), World(world_size=2, local_world_size=2), **options)


def test_sequence_parallel_is_on_by_default_with_the_built_in_plan_only():
    from trainscale.runtime.strategies.model_parallel import ModelParallelStrategy
    from trainscale.runtime.world import World

    world = World(world_size=2, local_world_size=2)
    on = ModelParallelStrategy(torch.device("cpu"), world, parallel={"tp": 2})
    users = ModelParallelStrategy(torch.device("cpu"), world, parallel={"tp": 2}, tp_plan={"fc": None})
    hsdp = ModelParallelStrategy(torch.device("cpu"), world, parallel={"dp_shard": 2})
    assert (on.sequence_parallel, users.sequence_parallel, hsdp.sequence_parallel) == (True, False, False)


def test_sequence_parallelism_refuses_dropout_and_an_uneven_sequence():
    from trainscale.models import GPT, GPTConfig
    from trainscale.runtime.strategies.apply_tp import _check_sequence_length, apply_tp

    class Mesh:  # apply_tp refuses before it splits anything: only the size is read
        def size(self):
            return 2

    with pytest.raises(ValueError, match=r"dropout=0.1: .*strategy_options=\{'sequence_parallel': False\}"):
        apply_tp(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, dropout=0.1)), Mesh(), sequence_parallel=True)
    with pytest.raises(ValueError, match="T=7 tokens: use a context length divisible by 2"):
        _check_sequence_length(2)(None, (torch.zeros(3, 7, dtype=torch.long),))
    _check_sequence_length(2)(None, (torch.zeros(3, 8, dtype=torch.long),))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["tp", "pp"])
def test_the_fitted_model_validates_on_the_same_trainer_without_being_parallelized_twice(tmp_path, strategy):
    """Lightning's ``trainer.fit(model)`` then ``trainer.validate(model)``: the model the fit parallelized in place is
    reused as it was set up (before the fix: tp raised DTensor's "distribute_module should only be called once",
    pp a ValueError about split points, as the model had been cut; fsdp: tests/test_training_module.py)."""
    for r in run_distributed(fit_then_evaluate, str(tmp_path), strategy, timeout=240):
        assert r["validate"] == pytest.approx(r["fit"], rel=1e-6) and r["last"] == pytest.approx(r["fit"], rel=1e-6)


def test_model_parallel_on_one_process_starts_its_own_process_group(tmp_path):
    """parallel={"dp_shard": 1} is a valid one-device layout; outside a launcher its device mesh needed a process
    group that nothing started (init_device_mesh fell back to env://: "environment variable RANK expected")."""
    from trainscale import Runtime
    from trainscale.models import GPT, lm_loss

    rt = Runtime(accelerator="cpu", devices=1, strategy="model_parallel", parallel={"dp_shard": 1})
    try:
        model, opt = rt.setup(GPT("tiny"), torch.optim.AdamW)
        x = torch.randint(0, 256, (2, 16))
        rt.backward(lm_loss(model(x), x))
        rt.step(opt)
        rt.save(tmp_path / "ckpt", {"model": model, "optimizer": opt, "step": 1})
        assert rt.load(tmp_path / "ckpt", {"model": model, "optimizer": opt}) == {"step": 1}
    finally:
        rt.teardown()


def test_a_users_parallelize_fn_keeps_tied_weights_one_parameter():
    """``parallelize_module`` inside the user's ``parallelize=fn`` replaces the head's and the embedding's weight
    by two DTensor parameters; the strategy ties them again, as it does after a ``tp_plan``, so the head trains
    with the embedding (one parameter, one optimizer entry). A function that splits them differently is refused."""
    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from trainscale import Runtime

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.emb(x))

    def split_both_by_vocabulary(model, mesh):
        return parallelize_module(model, mesh["dp_shard"], {"emb": RowwiseParallel(), "head": ColwiseParallel()})

    def split_one(model, mesh):
        return parallelize_module(model, mesh["dp_shard"], {"head": ColwiseParallel()})

    rt = Runtime(accelerator="cpu", devices=1, strategy="model_parallel", parallel={"dp_shard": 1},
                 parallelize=split_both_by_vocabulary)
    try:
        model, optimizer = rt.setup(Tied(), torch.optim.SGD)
        assert isinstance(model.emb.weight, DTensor) and model.head.weight is model.emb.weight
        assert len(list(model.parameters())) == len(optimizer.param_groups[0]["params"]) == 1
    finally:
        rt.teardown()
    rt = Runtime(accelerator="cpu", devices=1, strategy="model_parallel", parallel={"dp_shard": 1},
                 parallelize=split_one)
    try:
        with pytest.raises(ValueError, match=r"parallelize=fn splits the tied weights emb.weight, head.weight"):
            rt.setup(Tied(), torch.optim.SGD)
    finally:
        rt.teardown()
