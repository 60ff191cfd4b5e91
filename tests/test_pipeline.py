"""Pipeline parallelism (strategy "pp"): GPipe and 1F1B over 2 ranks against one process (parity),
memory per rank, checkpoints resumed and read in one process, the split, and the resolver's refusals."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import run_distributed, run_python
from tests.pipeline_workers import PP_CONFIG, Net, fit_gpt, net_plan, pp_dp_runs, pp_hsdp_run, pp_runs, pp_tp_runs
from trainscale.runtime.connector import resolve
from trainscale.runtime.strategies.apply_pp import gpt_split_points, keep_stage, shared_parameters, stage_names, units
from trainscale.runtime.strategies.parallel_dims import ParallelDims
from trainscale.runtime.strategies.pipeline import bubble_fraction

STEPS = 2  # exact parity needs no more: the second step already applies the first one's momentum
DOCS = Path(__file__).resolve().parents[1] / "docs" / "strategies.md"


def _assert_same(got: dict, want: dict) -> None:
    """rtol 1e-5 in fp32 (atol 1e-7 for elements near zero)."""
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def _stages_cover(results: list, want: dict) -> None:
    """Every parameter of the model is on some stage, and each stage's copy equals ``want``."""
    assert set().union(*(r["weights"] for r in results)) == set(want)
    for r in results:
        _assert_same(r["weights"], want)


def _planned_bytes(strategy: str, devices: int, rank: int, parallel: dict | None = None, net: bool = False,
                   **options) -> int:
    """Parameters + gradients + optimizer state that ``trainscale.plan`` predicts for the test's GPT (or, with
    ``net``, its ``Net``) and SGD on ``rank`` of ``devices`` (under "pp", mesh sizes ``parallel``; None: one
    stage per rank; ``options``: ``exact_bytes``'s ``split_points``, ``tp_plan``)."""
    from trainscale.models import GPT
    from trainscale.plan.memory import build_meta_model, exact_bytes, optimizer_layout

    meta = build_meta_model(lambda: Net() if net else GPT(PP_CONFIG))
    layout = optimizer_layout(meta, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), "32-true")
    predicted = exact_bytes(meta, layout, strategy, devices, rank, "32-true", parallel=parallel, **options)
    return predicted["parameters"] + predicted["gradients"] + predicted["optimizer"]


# -- parity with one process, memory (gloo, real processes) --------------------------------------
@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict:
    """The 2-stage runs (``pp_runs``: those of the fp16 and plan-error tests too), one start of 2 processes for
    all, and the one-process runs."""
    root = tmp_path_factory.mktemp("pp2")
    return {"root": root, "reference": fit_gpt(0, str(root / "single"), "single", steps=STEPS),
            "accumulated": fit_gpt(0, str(root / "single_acc"), "single", steps=2, accumulate=2),
            "bf16": fit_gpt(0, str(root / "single_bf16"), "single", steps=STEPS, precision="bf16-mixed"),
            "results": run_distributed(pp_runs, str(root), STEPS, world_size=2, timeout=280)}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_gpipe_and_1f1b_over_two_stages_match_one_process_with_clipping_and_use_about_half_the_memory(two_rank_runs):
    reference, accumulated, bf16 = (two_rank_runs[k] for k in ("reference", "accumulated", "bf16"))
    results = two_rank_runs["results"]
    for schedule in ("gpipe", "1f1b"):
        runs = [r[schedule] for r in results]
        _stages_cover(runs, reference["weights"])
        assert runs[0]["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert min(reference["norms"]) > 0.5  # clipping at 0.5 was active at every step
        for r in runs:  # the loss is the last stage's, broadcast: every rank logs the same
            assert r["losses"] == pytest.approx(reference["losses"], rel=1e-5)
            assert r["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
            # parameters + gradients + momentum: each stage holds 2 of the 4 blocks and one copy of the tied embedding
            assert r["bytes"] <= 0.55 * reference["bytes"]
    # every batch has one shape: the gradients are taken aside at the first step only (a new schedule's shape inference)
    assert [r["gpipe"]["takes"] for r in results] == [1, 1]
    _stages_cover([r["accumulate"] for r in results], accumulated["weights"])
    _bf16_close([r["bf16"] for r in results], bf16, pipelines=1)
    # trainscale.plan predicts each stage's bytes exactly (the 1F1B run: the same stages)
    for rank, r in enumerate(results):
        assert _planned_bytes("pp", 2, rank) == r["1f1b"]["bytes"] == r["gpipe"]["bytes"]
    assert _planned_bytes("single", 1, 0) == reference["bytes"]
    summary = results[0]["gpipe"]["summary"]
    assert summary["strategy"] == "pp" and summary["global_batch_size"] == 8
    assert summary["pipeline"] == {"stages": 2, "schedule": "gpipe", "microbatches": 8,
                                   "bubble_fraction": pytest.approx(1 / 9),
                                   "param_bytes_per_rank": [r["gpipe"]["bytes"] // 3 for r in results]}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_compile_compiles_each_stages_blocks_and_matches_one_process(two_rank_runs):
    runs = [r["compiled"] for r in two_rank_runs["results"]]
    assert all(r["graphs"] > 0 for r in runs), "a stage ran eagerly: compile did not reach the blocks it keeps"
    _stages_cover(runs, two_rank_runs["reference"]["weights"])
    assert runs[0]["losses"] == pytest.approx(two_rank_runs["reference"]["losses"], rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_meta_device_gpt_is_materialised_stage_by_stage_and_trains(two_rank_runs):
    runs = [r["meta"] for r in two_rank_runs["results"]]
    # each rank allocated its own stage only: exactly the bytes of the stage built on the CPU
    assert [r["bytes"] for r in runs] == [r["1f1b"]["bytes"] for r in two_rank_runs["results"]]
    # the two copies of the tied embedding started equal (broadcast from the first stage; each stage draws
    # from its own seed) and so stayed equal
    torch.testing.assert_close(runs[0]["weights"]["wte.weight"], runs[1]["weights"]["wte.weight"], rtol=0, atol=0)
    for r in runs:
        assert all(bool(torch.isfinite(w).all()) for w in r["weights"].values())
        assert r["weights"]["blocks.0.attn.q.weight" if "blocks.0.attn.q.weight" in r["weights"]
                            else "blocks.2.attn.q.weight"].std() == pytest.approx(0.02, rel=0.1)  # GPT-2's init
    assert runs[0]["losses"][-1] < runs[0]["losses"][0] - 0.2  # from ~ln 256 = 5.5
    # the stages were not drawn from one stream: the blocks of stage 1 are not those of stage 0
    q0, q1 = runs[0]["weights"]["blocks.0.attn.q.weight"], runs[1]["weights"]["blocks.2.attn.q.weight"]
    assert not torch.allclose(q0, q1)


def _bf16_close(runs: list, reference: dict, pipelines: int) -> None:
    """A "bf16-mixed" pipeline run computes its logits in bf16, trains, and ends near the 1-process
    "bf16-mixed" run: losses to 1e-3, norms to 2e-3 (relative), weights to 1e-3 (absolute); its micro-batches
    round in bf16 differently from one whole batch (measured: 8.1e-5 at most on the weights)."""
    assert reference["logit_dtypes"] == {"torch.bfloat16"}
    assert [r["logit_dtypes"] for r in runs[-pipelines:]] == [{"torch.bfloat16"}] * pipelines  # the last stages
    losses = _pipeline_means(runs, "losses") if pipelines == 2 else runs[0]["losses"]
    assert losses == pytest.approx(reference["losses"], rel=1e-3)
    assert runs[0]["norms"] == pytest.approx(reference["norms"], rel=2e-3)
    assert losses[-1] < losses[0]
    for r in runs:
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, reference["weights"][name], rtol=0, atol=1e-3)


def _pipeline_means(runs: list, key: str) -> list:
    """Per step, the mean over the 2 pipelines (ranks 0 and 1 run the first stage of each) of ``key``: each
    pipeline's loss is its data-parallel share's mean, and the shares are equal."""
    return [(a + b) / 2 for a, b in zip(runs[0][key], runs[1][key])]


@pytest.fixture(scope="module")
def four_rank_references(tmp_path_factory) -> dict:
    """The one-process runs the 4-rank layouts are compared with: 16 samples per step (2 stages × 2
    data-parallel ranks reading batches of 8, or 2 stages × 2 tensor-parallel ranks reading the same batches
    of 16)."""
    root = tmp_path_factory.mktemp("pp4_single")
    return {"reference": fit_gpt(0, str(root / "single"), "single", steps=STEPS, val=20, batch_size=16),
            "bf16": fit_gpt(0, str(root / "single_bf16"), "single", steps=STEPS, val=20, batch_size=16,
                            precision="bf16-mixed"),
            "accumulated": fit_gpt(0, str(root / "single_acc"), "single", train=56, val=20, batch_size=16,
                                   accumulate=2)}


@pytest.fixture(scope="module")
def four_rank_tp_runs(tmp_path_factory, four_rank_references) -> dict:
    """The 2 stages × 2 tensor-parallel layouts (``pp_tp_runs``): one start of 4 processes for all."""
    root = tmp_path_factory.mktemp("pp4_tp")
    return {**four_rank_references, "root": root,
            "results": run_distributed(pp_tp_runs, str(root), STEPS, world_size=4, timeout=580)}


@pytest.fixture(scope="module")
def four_rank_dp_runs(tmp_path_factory, four_rank_references) -> dict:
    """The 2 stages × 2 data-parallel layouts (``pp_dp_runs``): one start of 4 processes for all."""
    root = tmp_path_factory.mktemp("pp4_dp")
    return {**four_rank_references, "root": root,
            "results": run_distributed(pp_dp_runs, str(root), STEPS, world_size=4, timeout=580)}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_pp_composes_with_tp_with_and_without_sequence_parallelism_and_matches_one_process(four_rank_tp_runs):
    import torch.distributed.checkpoint as dcp

    from trainscale.models import GPT

    reference, results = four_rank_tp_runs["reference"], four_rank_tp_runs["results"]
    # each stage's blocks and tied embedding split over its 2 tp ranks (ranks 0, 1: stage 0; 2, 3: stage 1)
    stage_bytes = [_planned_bytes("pp", 4, rank, {"pp": 2, "tp": 2}) for rank in range(4)]
    for layout in ("tp", "tp_gpipe"):
        runs = [r[layout] for r in results]
        _stages_cover(runs, reference["weights"])
        for r in runs:  # the tp ranks and stages of the one pipeline log the same loss and clipped norm
            assert r["losses"] == pytest.approx(reference["losses"], rel=1e-5)
            assert r["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
        assert runs[0]["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert min(reference["norms"]) > 0.5  # clipping at 0.5 was active at every step
        assert runs[0]["summary"]["global_batch_size"] == 16
        assert [r["bytes"] for r in runs] == stage_bytes
        print(f"pp 2 x {layout}: state bytes per rank {[r['bytes'] for r in runs]} of {reference['bytes']} "
              f"({max(r['bytes'] for r in runs) / reference['bytes']:.3f}), max |weight difference| "
              f"{max(_max_diff(r['weights'], reference['weights']) for r in runs):.2e}")
    # "bf16-mixed": logits in bf16 on the last stage (ranks 2, 3), near the one-process bf16 run
    _bf16_close([r["tp_bf16"] for r in results], four_rank_tp_runs["bf16"], pipelines=1)  # one pipeline
    # a quarter, plus the tied embedding's second copy and the whole norms on every rank
    assert max(stage_bytes) <= 0.28 * reference["bytes"]
    # the checkpoint of the 2 × 2 tensor-parallel stages loads into a plain model in one process
    last = max((four_rank_tp_runs["root"] / "tp").glob(f"version_*/checkpoints/epoch=*-step={STEPS}.ckpt"))
    state = {"model": GPT(PP_CONFIG).state_dict()}
    dcp.load(state, checkpoint_id=str(last))
    _assert_same(state["model"], reference["weights"])


def _max_diff(got: dict, want: dict) -> float:
    return max((got[name] - want[name]).abs().max().item() for name in got)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_pp_composes_with_fsdp_and_with_replication_on_four_ranks_and_matches_one_process(four_rank_dp_runs):
    reference, bf16, accumulated = (four_rank_dp_runs[k] for k in ("reference", "bf16", "accumulated"))
    results = four_rank_dp_runs["results"]
    # the last step's second micro-batch has a new shape: a new schedule, whose set-up must keep the gradients
    _stages_cover([r["accumulate"] for r in results], accumulated["weights"])
    for layout, dp in (("shard", "dp_shard"), ("replicate", "dp_replicate")):
        runs = [r[layout] for r in results]
        _stages_cover(runs, reference["weights"])
        assert runs[0]["norms"] == pytest.approx(reference["norms"], rel=1e-5)  # across stages and shards
        assert min(reference["norms"]) > 0.5  # clipping at 0.5 was active at every step
        assert _pipeline_means(runs, "losses") == pytest.approx(reference["losses"], rel=1e-5)
        assert [r["val_loss"] for r in runs] == pytest.approx([reference["val_loss"]] * 4, rel=1e-5)
        assert runs[0]["summary"]["global_batch_size"] == 16
        assert runs[0]["summary"]["pipeline"]["param_bytes_per_rank"] == [r["bytes"] // 3 for r in runs]
        # exact bytes: the stage's parameters, gradients and momentum, divided over the FSDP shards
        assert [r["bytes"] for r in runs] == [_planned_bytes("pp", 4, rank, {"pp": 2, dp: 2}) for rank in range(4)]
        if layout == "shard":  # rank r runs stage r // 2
            assert [r["bytes"] for r in runs] == [_planned_bytes("pp", 2, rank // 2) // 2 for rank in range(4)]
    assert max(r["shard"]["bytes"] for r in results) <= 0.28 * reference["bytes"]
    # bf16-mixed with FSDP: autocast in each stage's forward and the loss, and FSDP's bf16 policy
    _bf16_close([r["bf16"] for r in results], bf16, pipelines=2)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_pp_composes_with_hsdp_on_eight_ranks_and_matches_one_process(tmp_path):
    # 2 stages × 2 replicas × 2 shards: 4 data-parallel ranks reading 8 each, one process reads 32 per step
    reference = fit_gpt(0, str(tmp_path / "single"), "single", steps=STEPS, val=20, batch_size=32)
    runs = run_distributed(pp_hsdp_run, str(tmp_path / "pp_hsdp"), STEPS, world_size=8, timeout=280)
    _stages_cover(runs, reference["weights"])
    assert runs[0]["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    assert [r["val_loss"] for r in runs] == pytest.approx([reference["val_loss"]] * 8, rel=1e-5)
    assert runs[0]["summary"]["global_batch_size"] == 32
    stage_bytes = [_planned_bytes("pp", 2, stage) for stage in (0, 1)]  # rank r runs stage r // 4
    assert [r["bytes"] for r in runs] == [stage_bytes[rank // 4] // 2 for rank in range(8)]  # 2 shards per replica


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_pp_composes_with_a_users_tp_plan_and_parallelize_fn_and_matches_one_process(tmp_path, four_rank_tp_runs):
    # 2 stages × 2 tp ranks of a user's Net (not a GPT) cut at layers.2; every rank reads the same batches of 16
    reference = fit_gpt(0, str(tmp_path / "single"), "single", steps=STEPS, val=16, batch_size=16, net=True)
    results = [r["user"] for r in four_rank_tp_runs["results"]]  # pp_tp_user_runs
    # tp_plan={...}, each stage taking its entries; parallelize=fn(stage, mesh); a plan of the blocks only
    for way in ("plan", "fn", "blocks"):
        runs = [r[way] for r in results]
        _stages_cover(runs, reference["weights"])
        assert [sorted(r["weights"])[0] for r in runs] == ["embed.bias"] * 2 + ["head.bias"] * 2  # ranks 0, 1: stage 0
        for r in runs:
            assert r["losses"] == pytest.approx(reference["losses"], rel=1e-5)
            assert r["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
        assert runs[0]["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert min(reference["norms"]) > 0.5  # clipping at 0.5 was active at every step
        print(f"pp 2 x tp 2, {way}: state bytes per rank {[r['bytes'] for r in runs]} of {reference['bytes']}, "
              f"max |weight difference| {max(_max_diff(r['weights'], reference['weights']) for r in runs):.2e}")
        if way == "blocks":  # the embedding and the head whole on both tp ranks: more than a quarter
            continue
        # every weight split over 2 tp ranks on 2 stages: the 4 ranks together hold one process's bytes exactly
        assert sum(r["bytes"] for r in runs) == reference["bytes"]
        assert max(r["bytes"] for r in runs) <= 0.251 * reference["bytes"]
        planned = [_planned_bytes("pp", 4, rank, {"pp": 2, "tp": 2}, net=True, tp_plan=net_plan(),
                                  split_points=["layers.2"]) for rank in range(4)]
        assert [r["bytes"] for r in runs] == planned  # trainscale.plan predicts each rank's bytes exactly
    # "16-mixed" with a stage that mixes tp-split and plain parameters: refused at set-up on every rank, the
    # stage 1 ranks (plain head) as the stage 0 ranks (plain embedding)
    assert [re.search(r"plain on this rank: \['(\w+)", r["fp16_error"]).group(1) for r in results] == \
        ["embed", "embed", "head", "head"]


def test_a_tp_plan_key_that_names_no_module_of_the_whole_model_is_refused_before_the_cut():
    from torch.distributed.tensor.parallel import ColwiseParallel

    from trainscale.runtime.strategies.pipeline import PipelineStrategy
    from trainscale.runtime.world import World

    # no process group exists here: the keys are checked against the whole model, the same on every rank
    strategy = PipelineStrategy(torch.device("cpu"), World(world_size=4, local_world_size=4),
                                parallel={"pp": 2, "tp": 2}, pp_split_points=["layers.2"],
                                tp_plan={**net_plan(), "blocks.*.fc": ColwiseParallel()})
    model = Net()
    with pytest.raises(ValueError, match=r"tp_plan key\(s\) \['blocks.\*.fc'\] name no submodule"):
        strategy.setup_module(model)
    assert len(model.layers) == 4 and model.head is not None  # refused before the cut


def test_a_tp_plan_that_leaves_the_last_stages_output_sharded_is_refused_before_the_cut():
    from torch.distributed.tensor.parallel import ColwiseParallel

    from trainscale.runtime.strategies.pipeline import PipelineStrategy
    from trainscale.runtime.world import World

    strategy = PipelineStrategy(torch.device("cpu"), World(world_size=4, local_world_size=4),
                                parallel={"pp": 2, "tp": 2}, pp_split_points=["layers.2"],
                                tp_plan={**net_plan(), "head": ColwiseParallel()})
    model = Net()
    with pytest.raises(ValueError, match=r"leaves the model's output sharded: its output comes from 'head'.*"
                                         r"ColwiseParallel\(output_layouts=Replicate\(\)\)"):
        strategy.setup_module(model)
    assert model.embed is not None and model.head is not None  # refused before the cut, the same on every rank


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_plan_errors_are_raised_on_every_rank_before_the_first_step(two_rank_runs):
    results = [r["plan_errors"] for r in two_rank_runs["results"]]  # pipeline_workers.plan_errors
    assert results[0] == results[1]  # every rank raises, the same error
    errors = results[0]
    assert "leave stage 0 without a unit; 'embed' is the model's first unit" in errors["empty_stage"]
    assert "e.g. pp_split_points=['layers.2']" in errors["empty_stage"]
    assert "pp_microbatches=8 is more than the batch of 4 samples" in errors["microbatches"]
    assert "use pp_microbatches <= 4" in errors["microbatches"]
    assert "tp_plan leaves the model's output sharded: its output comes from 'head'" in errors["sharded_output"]


def test_a_stage_forward_that_calls_a_module_the_stage_does_not_hold_is_explained():
    from trainscale.runtime.strategies.apply_pp import StageForwardError, _unwrapped, explain_missing_modules

    class Unguarded(Net):  # calls the embedding and the head on every stage
        def forward(self, x):
            x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    model = Unguarded()
    names = stage_names(model, ["layers.2"], 2)
    keep_stage(model, names[1])
    explain_missing_modules(model, 1, names[1])
    with pytest.raises(StageForwardError, match=r"stage 1 holds only the units \['layers.2', 'layers.3', 'head'\].*"
                                                r"'NoneType' object is not callable.*skips a module that is None") as info:
        model(torch.randn(2, 16))
    assert isinstance(info.value.__cause__, TypeError)
    wrapped = RuntimeError("[Stage 1] failed to run forward")  # as torch's PipelineStage re-raises it
    wrapped.__cause__ = info.value
    assert _unwrapped(wrapped) is info.value
    assert getattr(model.layers, "2")(torch.randn(2, 32)).shape == (2, 32)  # a held module is called unchanged


def test_a_parallelize_fn_must_act_on_the_stage_in_place():
    from trainscale.runtime.strategies.pipeline import PipelineStrategy
    from trainscale.runtime.world import World

    strategy = PipelineStrategy(torch.device("cpu"), World(world_size=4, local_world_size=4),
                                parallel={"pp": 2, "tp": 2}, parallelize=lambda stage, mesh: nn.Linear(2, 2))
    with pytest.raises(ValueError, match="parallelize=fn must parallelise the stage it is given in place.*Linear"):
        strategy._tensor_parallel(Net())


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory, two_rank_runs) -> dict:
    """``pp_fp16_runs`` on 2 ranks (run by ``pp_runs``), and the one-process "16-mixed" and "32-true" runs of the
    same Net."""
    root = tmp_path_factory.mktemp("pp_fp16")
    flags = dict(steps=STEPS, val=16, batch_size=16, net=True)
    return {"reference": fit_gpt(0, str(root / "single"), "single", precision="16-mixed", **flags),
            "fp32": fit_gpt(0, str(root / "single32"), "single", **flags),
            "results": [r["fp16"] for r in two_rank_runs["results"]]}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_16_mixed_on_two_stages_ends_near_one_16_mixed_process(fp16_runs):
    reference, runs = fp16_runs["reference"], [r["fit"] for r in fp16_runs["results"]]
    assert reference["logit_dtypes"] == runs[1]["logit_dtypes"] == {"torch.float16"}  # the last stage's logits
    # micro-batches of 2 round in fp16 differently from one batch of 16 (measured: 8.1e-6 at most on the
    # weights), far closer than "32-true" is to "16-mixed" (measured 5.1e-4)
    for r in runs:
        assert _max_diff(r["weights"], reference["weights"]) < 5e-5
        assert r["losses"] == pytest.approx(reference["losses"], rel=5e-5)  # reported unscaled
    assert runs[0]["norms"] == pytest.approx(reference["norms"], rel=5e-5)
    worst, fp32 = (max(_max_diff(r["weights"], reference["weights"]) for r in runs),
                   _max_diff(fp16_runs["fp32"]["weights"], reference["weights"]))
    assert worst < fp32 / 5
    print(f"pp 2, 16-mixed: max |weight difference| {worst:.2e} (32-true against 16-mixed in one process: {fp32:.2e})")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_an_inf_gradient_on_one_stage_makes_every_stage_skip_the_step_and_halve_the_scale(fp16_runs):
    agreed = [r["agreed"] for r in fp16_runs["results"]]
    for r in agreed:  # step 1 poisoned stage 0's gradient: both stages skipped it and halved the scale
        assert [s["changed"] for s in r["steps"]] == [True, False, True]
        assert [s["scale"] for s in r["steps"]] == [65536.0, 65536.0, 32768.0]
        assert r["resumed_scale"] == 32768.0  # the scaler's state is saved with the checkpoint and loaded back
    assert agreed[0]["steps"] == agreed[1]["steps"]
    # torch's plain GradScaler checks each stage's own gradients only: stage 0 skips, stage 1 steps, and the
    # two stages' weights and scales part (what the cross-stage agreement prevents)
    plain = [r["plain"] for r in fp16_runs["results"]]
    assert [s["changed"] for s in plain[0]["steps"]] == [True, False, True]
    assert [s["changed"] for s in plain[1]["steps"]] == [True, True, True]
    assert (plain[0]["scale"], plain[1]["scale"]) == (32768.0, 65536.0)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("runs, steps", [("two_rank_runs", 4), ("four_rank_dp_runs", 2), ("four_rank_tp_runs", 4)],
                         ids=["pp2", "pp2xfsdp2", "pp2xtp2"])
def test_a_pp_checkpoint_resumes_where_it_stopped_and_loads_into_one_process(request, runs, steps):
    """``pp_resume`` (one stage per rank, 2 stages × 2 FSDP shards, 2 stages × 2 tp ranks), run at the end of
    the processes of the other tests of that layout (one start of the processes for all)."""
    import torch.distributed.checkpoint as dcp

    from trainscale.models import GPT

    fixture = request.getfixturevalue(runs)
    results = [r["resume"] for r in fixture["results"]]
    for r in results:
        _assert_same(r["resumed"]["weights"], r["full"]["weights"])
        assert r["resumed"]["val_loss"] == pytest.approx(r["full"]["val_loss"], rel=1e-5)
        assert r["resumed"]["summary"]["resumed_from"] is not None and r["resumed"]["summary"]["steps"] == steps
    # the checkpoint of the stages (and their shards) is one of the whole model, keyed by its own names
    last = max((fixture["root"] / "resume" / "stopped").glob(f"version_*/checkpoints/epoch=*-step={steps}.ckpt"))
    state = {"model": GPT(PP_CONFIG).state_dict()}
    dcp.load(state, checkpoint_id=str(last))
    _stages_cover([r["resumed"] for r in results], state["model"])


def _docs_example() -> str:
    """The code of docs/strategies.md, "Writing a pipeline split for your own model"."""
    text = DOCS.read_text()
    block = text[text.index("### Writing a pipeline split for your own model"):]
    start = block.index("```python\n") + len("```python\n")
    return block[start:block.index("```\n", start)]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_docs_split_of_a_users_model_runs_as_a_script_and_matches_one_process(tmp_path):
    code = _docs_example()
    (tmp_path / "tower.py").write_text(code)
    out, _ = run_python(["tower.py"], tmp_path, timeout=280)  # devices=2: relaunched under torchrun
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"train_loss (\d+\.\d{8})", out.stdout)]  # both ranks print, maybe interleaved
    names = {"__name__": "docs_example"}
    exec(compile(code, str(DOCS), "exec"), names)
    torch.manual_seed(0)
    reference = names["fit"](names["Tower"](), devices=1, strategy="single", default_root_dir=str(tmp_path / "one"))
    assert losses and losses == pytest.approx([reference["train_loss"]] * len(losses), rel=1e-5)


# -- the split: pure logic ----------------------------------------------------------------------
def test_the_gpt_split_spreads_its_blocks_and_keeps_the_names_of_the_whole_model():
    from trainscale.models import GPT

    gpt = GPT(PP_CONFIG)
    assert units(gpt) == ["wte", "wpe", "drop", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f"]
    assert gpt_split_points(gpt, 2) == ["blocks.2"] and gpt_split_points(gpt, 3) == ["blocks.2", "blocks.3"]
    names = stage_names(gpt, ["blocks.2"], 2)
    assert names == [["wte", "wpe", "drop", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f"]]
    names[1].append("wte")  # the tied output projection
    assert list(shared_parameters(gpt, names).values()) == [[0, 1]]
    keep_stage(gpt, names[1])
    assert gpt.wpe is None and len(gpt.blocks) == 2
    assert sorted({k.split(".")[0] + "." + k.split(".")[1] for k in gpt.state_dict() if k.startswith("blocks")}) == \
        ["blocks.2", "blocks.3"]
    hidden = torch.randn(3, 8, PP_CONFIG.n_embd)
    assert gpt(hidden).shape == (3, 8, PP_CONFIG.vocab_size)  # the last stage: hidden states in, logits out


def test_bad_split_points_name_the_units():
    from trainscale.models import GPT

    gpt = GPT(PP_CONFIG)
    with pytest.raises(ValueError, match=r"need 1 split point.*units of GPT, in order: wte, wpe"):
        stage_names(gpt, [], 2)
    with pytest.raises(ValueError, match=r"\['layers.2'\] name no unit"):
        stage_names(gpt, ["layers.2"], 2)
    with pytest.raises(ValueError, match="in the model's order"):
        stage_names(gpt, ["blocks.3", "blocks.1"], 3)
    with pytest.raises(ValueError, match=r"leave stage 0 without a unit; 'wte' is the model's first unit.*"
                                         r"e.g. pp_split_points=\['blocks.1'\]"):
        stage_names(gpt, ["wte"], 2)
    with pytest.raises(ValueError, match="n_layer=4"):
        gpt_split_points(gpt, 5)


def test_a_batch_is_cut_into_the_most_micro_batches_that_divide_it():
    from trainscale.runtime.strategies.apply_pp import micro_batches_for

    assert [micro_batches_for(b, 8) for b in (8, 16, 6, 5, 43, 3)] == [8, 8, 6, 5, 1, 3]
    assert [micro_batches_for(b, 2) for b in (8, 5)] == [2, 1]


def test_a_stage_under_autocast_computes_in_bf16_and_leaves_autocast_off_after_its_forward():
    from trainscale.runtime.precision import Precision
    from trainscale.runtime.strategies.apply_pp import autocast_forward

    stage = nn.Linear(4, 4)
    autocast_forward(stage, Precision("bf16-mixed", "cpu").autocast)
    out = stage(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16 and not torch.is_autocast_enabled("cpu")  # backward runs outside it
    out.float().sum().backward()
    assert stage.weight.grad.dtype == torch.float32


def test_bubble_fraction_is_gpipes():
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(1, 1) == 0


# -- the resolver: pure logic ---------------------------------------------------------------------
def test_pp_layouts_and_flags():
    cfg = resolve("cpu", 2, "pp")
    assert cfg.strategy == "pp" and cfg.parallel == ParallelDims(pp=2)
    assert (cfg.pp_schedule, cfg.pp_microbatches) == ("1f1b", 8)
    cfg = resolve("cpu", 4, "model_parallel", parallel={"pp": 4}, pp_schedule="gpipe", pp_microbatches=2)
    assert (cfg.strategy, cfg.pp_schedule, cfg.pp_microbatches) == ("pp", "gpipe", 2)
    assert resolve("cpu", 4, "tp").pp_schedule is None
    cfg = resolve("cpu", 4, "pp", parallel={"pp": 2, "dp_shard": 2}, precision="bf16-mixed")
    assert (cfg.strategy, cfg.parallel.dp_size, cfg.pp_microbatches) == ("pp", 2, 8)
    assert resolve("cpu", 4, "model_parallel", parallel={"pp": 2, "dp_replicate": 2}).strategy == "pp"
    cfg = resolve("cpu", 8, "model_parallel", parallel={"pp": 2, "dp_shard": 2, "tp": 2})
    assert (cfg.strategy, cfg.parallel.dp_size) == ("pp", 2)
    # a user's tensor-parallel plan or function per stage, and "16-mixed" (its loss scaled inside the schedule)
    assert resolve("cpu", 4, "pp", parallel={"pp": 2, "tp": 2}, tp_plan={"layers.*.up": None}).strategy == "pp"
    assert resolve("cpu", 4, "pp", parallel={"pp": 2, "tp": 2}, parallelize=lambda m, mesh: m).strategy == "pp"
    assert resolve("cpu", 2, "pp", precision="16-mixed").precision == "16-mixed"
    dims = ParallelDims(pp=2, dp_shard=2, tp=2)  # the mesh (pp, dp_replicate, dp_shard, tp), row-major
    assert [dims.pp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]  # both stages read the same data


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="pp", devices=1), "pp ≥ 2 pipeline stages"),
    (dict(strategy="pp", tp_plan={"blocks.0.mlp.fc": None}), "tp_plan splits layers over the tp ranks.*tp=1"),
    (dict(strategy="pp", pp_schedule="interleaved"), "unknown pp_schedule='interleaved'"),
    (dict(strategy="pp", pp_microbatches=0), "pp_microbatches=0 must be an int >= 1"),
    (dict(strategy="pp", pp_microbatches=2), "1f1b' needs at least one micro-batch per stage"),
    (dict(strategy="pp", pp_split_points="blocks.2"), "must be a list of submodule names"),
    (dict(strategy="pp", parallel={"pp": 2, "tp": 2}, tp_plan={"layers.*.up": "colwise"}),
     r"are strings \(Hugging Face's tp_plan names\).*'colwise' -> ColwiseParallel\(\)"),
    (dict(strategy="pp", parallel={"pp": 2, "tp": 2}, tp_plan={"h": None}, parallelize=lambda m, mesh: m),
     "pass tp_plan or parallelize, not both"),
    (dict(strategy="ddp", pp_microbatches=4), "pp_microbatches configure.*no"),
    (dict(strategy="tp", pp_split_points=["blocks.2"]), "pp_split_points configure"),
])
def test_what_pp_does_not_support_is_refused_before_any_process_group(kwargs, message):
    kwargs = {"devices": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        resolve("cpu", **kwargs)


def test_a_model_with_its_own_training_step_or_no_split_is_refused_at_setup():
    from trainscale.runtime.strategies.pipeline import PipelineStrategy
    from trainscale.runtime.world import World

    strategy = PipelineStrategy(torch.device("cpu"), World(world_size=2, local_world_size=2), parallel={"pp": 2})
    stepper = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    stepper.training_step = lambda batch: None
    with pytest.raises(ValueError, match="defines training_step"):
        strategy.setup_module(stepper)
    with pytest.raises(ValueError, match=r"built-in split for trainscale.models.GPT only.*pp_split_points"):
        strategy.setup_module(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    with_tp = PipelineStrategy(torch.device("cpu"), World(world_size=4, local_world_size=4), parallel={"pp": 2, "tp": 2})
    with pytest.raises(ValueError, match=r"plan of trainscale.models.GPT, and the model is a Sequential; pass tp_plan"):
        with_tp.setup_module(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))


def test_a_meta_device_model_under_pp_with_tp_on_cpu_is_refused_at_setup_before_any_process_group():
    from trainscale.models import GPT
    from trainscale.runtime.strategies.pipeline import PipelineStrategy
    from trainscale.runtime.world import World

    strategy = PipelineStrategy(torch.device("cpu"), World(world_size=4, local_world_size=4),
                                parallel={"pp": 2, "tp": 2})
    with torch.device("meta"):
        model = GPT(PP_CONFIG)
    with pytest.raises(ValueError, match="meta-device model under tensor parallelism needs a CUDA mesh"):
        strategy.setup_module(model)
