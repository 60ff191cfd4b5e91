"""FSDP2 on 2 real gloo processes: parity with DDP, one gradient reduction per optimizer step
under accumulation (DDP and FSDP), half the memory of DDP, sharded checkpoints, bad options.

The multi-process bodies (tests/fsdp_workers.py) run several Trainer/Runtime runs in one pair of
processes (process start-up costs ~5-9 s); each test below checks one part of the result."""

from pathlib import Path

import pytest
import torch
from torch import nn

from tests import fsdp_workers, workers
from tests.helpers import run_distributed
from trainscale.runtime.checkpoint_io import CheckpointError
from trainscale.runtime.world import World
from trainscale.checkpointing import run_dirs as ckpt
from trainscale.loop.trainer import Trainer

PARAMS_BYTES = sum(p.numel() * 4 for p in workers.make_model().parameters())  # fp32 ConvNet


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(fsdp_workers.parity_counts_memory_body, str(tmp_path_factory.mktemp("fsdp")), timeout=150)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return run_distributed(fsdp_workers.resume_body, str(tmp_path_factory.mktemp("fsdp_resume")), timeout=150)


@pytest.mark.multiprocess
def test_fsdp_equals_ddp_through_the_trainer(runs):
    """fsdp(2×b) == ddp(2×b): same seed and samples, SGD with momentum, gradient clipping by norm
    active (max_norm 0.05), 3 FSDP units; full weights after 12 steps, rtol 1e-5."""
    for rank in runs:
        assert rank["fsdp_param_types"] == ["DTensor"]  # really sharded
        assert rank["fsdp_summary"]["strategy"] == "fsdp" and rank["fsdp_summary"]["steps"] == 12
        for key, ref in rank["ddp_state"].items():
            torch.testing.assert_close(rank["fsdp_state"][key], ref, rtol=1e-5, atol=1e-7)
        for name in ("train_loss", "val_loss", "val_accuracy"):  # evaluation: 49 samples, uneven batches
            assert rank["fsdp_summary"][name] == pytest.approx(rank["ddp_summary"][name], rel=1e-5)
    export = runs[0]["fsdp_rank0_export"]  # full state dict on rank zero only, user's keys
    assert set(export) == set(runs[0]["ddp_state"]) and runs[1]["fsdp_rank0_export"] == {}
    for key, value in export.items():
        torch.testing.assert_close(value, runs[0]["fsdp_state"][key], rtol=0, atol=0)


@pytest.mark.multiprocess
def test_ddp_all_reduces_once_per_optimizer_step(runs):
    """A counting DDP comm hook: 11 micro-batches per rank; accumulation 4 → 3 steps (4+4+3),
    3 bucket all-reduces (the model fits one bucket); accumulation 1 → 11 and 11."""
    for rank in runs:
        assert rank["ddp_counts"][4] == (3, 3)
        assert rank["ddp_counts"][1] == (11, 11)


@pytest.mark.multiprocess
def test_fsdp_reduce_scatters_once_per_optimizer_step(runs):
    """Counted calls of the reduce-scatter FSDP2 issues: with the whole model as one unit, one
    reduce-scatter of the full gradient per optimizer step; with 3 units, 3 per step.
    11 micro-batches per rank: accumulation 4 → 3 steps (4+4+3), accumulation 1 → 11."""
    for rank in runs:
        calls, nbytes, steps, _ = rank["fsdp_counts"][4]
        assert (calls, steps) == (3, 3) and nbytes == 3 * PARAMS_BYTES
        calls, nbytes, steps, _ = rank["fsdp_counts"][1]
        assert (calls, steps) == (11, 11) and nbytes == 11 * PARAMS_BYTES
        calls, nbytes, steps, loss = rank["fsdp_counts_3_units"]  # + cpu_offload (a no-op on a CPU mesh)
        assert (calls, steps) == (9, 3) and nbytes == 3 * PARAMS_BYTES
        assert loss == pytest.approx(rank["fsdp_counts"][4][3], rel=1e-5)


@pytest.mark.multiprocess
def test_a_training_step_that_calls_the_model_gathers_each_unit_as_often_as_a_plain_model(runs):
    """A model of 2 Linear blocks and a head, trained one epoch (4 micro-batches per rank, no accumulation) and
    validated (2 batches per rank), as a plain model with a loss function and as a TrainingModule whose
    training_step and validation_step call ``self(x)`` (the step runs as the FSDP root's forward, the call nested
    in it): the same collectives the structure needs, the same weights, callable after fit.

    Per micro-batch each unit's parameters are all-gathered once in forward, and once more in backward for the
    units other than the root (which keeps its parameters gathered from forward to backward); per optimizer step
    each unit's gradients are reduce-scattered once. In validation each unit is all-gathered per batch, the root
    only on the first."""
    block, head = 72 * 4 // 2, 36 * 4 // 2  # bytes of one rank's shard: Linear(8, 8), Linear(8, 4) in fp32
    structures = {False: ([block + block + head], []),  # the root alone: one unit of everything
                  True: ([head, block, block], [block, block])}  # auto_wrap_policy={Block}: root, 2 units
    steps, val_batches = 4, 2
    for rank in runs:
        counts = rank["step_collectives"]
        for name, run in counts.items():
            units, regathered = structures[name.endswith("_units")]
            step = units + regathered
            validation = units + units[1:] * (val_batches - 1)
            assert run["steps"] == steps
            assert sorted(run["all_gather"]) == sorted(step * steps + validation), name
            assert sorted(run["reduce_scatter"]) == sorted([2 * b for b in units] * steps), name  # unsharded grads
        for name in ("training_step", "plain_units", "training_step_units"):
            for key, ref in counts["plain"]["state"].items():
                torch.testing.assert_close(counts[name]["state"][key], ref, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(counts[name]["after_fit"], counts["plain"]["after_fit"], rtol=1e-6, atol=1e-7)


@pytest.mark.multiprocess
def test_fsdp_holds_half_the_parameter_and_optimizer_bytes_of_ddp(runs):
    for rank in runs:
        ddp = rank["ddp_bytes"]["params"] + rank["ddp_bytes"]["optimizer"]
        fsdp = rank["fsdp_bytes"]["params"] + rank["fsdp_bytes"]["optimizer"]
        assert ddp == PARAMS_BYTES * 3 + 6 * 4  # weights, exp_avg, exp_avg_sq + one fp32 step per tensor
        assert 0.45 <= fsdp / ddp <= 0.6, (fsdp, ddp)
    assert runs[0]["fsdp_bytes"]["params"] + runs[1]["fsdp_bytes"]["params"] == PARAMS_BYTES  # shards partition


@pytest.mark.multiprocess
def test_model_summary_counts_fsdp_shards_by_their_global_shapes(runs):
    full = PARAMS_BYTES // 4
    for rank in runs:  # a DTensor's shape is global: every rank counts the whole model, as under ddp
        assert rank["summary_params"]["ddp"] == rank["summary_params"]["fsdp"] == full
        assert rank["summary_params"]["fsdp_local"] < full
    assert sum(rank["summary_params"]["fsdp_local"] for rank in runs) == full


@pytest.mark.multiprocess
def test_runtime_clip_gradients_returns_the_global_norm_under_fsdp(runs):
    """Runtime.clip_gradients under fsdp: the norm of the whole gradient (all shards), as a plain
    tensor, equal to DDP's for the same step."""
    for rank in runs:
        assert rank["fsdp_bytes"]["norm_type"] == "Tensor"
        torch.testing.assert_close(rank["fsdp_bytes"]["norm"], rank["ddp_bytes"]["norm"], rtol=1e-5, atol=0)
    torch.testing.assert_close(runs[0]["fsdp_bytes"]["norm"], runs[1]["fsdp_bytes"]["norm"], rtol=0, atol=0)


@pytest.mark.multiprocess
def test_fsdp_sharded_checkpoint_resume_equals_uninterrupted(resumed):
    for rank in resumed:
        assert rank["first_summary"]["epochs"] == 1 and rank["resumed_summary"]["epochs"] == 2
        assert rank["resumed_summary"]["steps"] == rank["full_summary"]["steps"] == 12
        for key, value in rank["full"].items():
            torch.testing.assert_close(rank["resumed"][key], value, rtol=0, atol=0)
    ckpt_dir = Path(resumed[0]["full_summary"]["run_dir"]) / "checkpoints"
    kept = sorted(p.name for p in ckpt_dir.iterdir())
    assert kept == ["epoch=1-step=12.ckpt", "last"]  # keep_last=1 removed the epoch-0 directory
    assert (ckpt_dir / "last").read_text().strip() == "epoch=1-step=12.ckpt"  # a directory, named as Lightning's
    assert sorted(p.name for p in (ckpt_dir / "epoch=1-step=12.ckpt").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "shards.sha256", "trainscale_extra.pt"]  # its digest inside
    from torch.distributed.checkpoint import FileSystemReader

    stored = set(FileSystemReader(str(ckpt_dir / "epoch=1-step=12.ckpt")).read_metadata().state_dict_metadata)
    user_keys = set(resumed[0]["full"])  # the user's model's own parameter names, no wrapper prefix
    assert {f"model.{k}" for k in user_keys} <= stored
    assert {f"optimizer.state.{k}.momentum_buffer" for k in user_keys} <= stored


@pytest.mark.multiprocess
def test_full_state_dict_export_loads_into_a_plain_module(resumed):
    plain = workers.make_model(seed=1)  # different initial weights
    plain.load_state_dict(torch.load(resumed[0]["export"], weights_only=True))
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(value, resumed[0]["full"][key], rtol=0, atol=0)
    for rank in resumed:  # and back into a freshly sharded model (broadcast from rank zero)
        for key, value in rank["reimported"].items():
            torch.testing.assert_close(value, resumed[0]["full"][key], rtol=0, atol=0)


# -- bad input (raised before any collective) ---------------------------------------------------
def test_unknown_fsdp_option_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"strategy='fsdp' does not accept option\(s\) 'wrap_policy'; its options "
                                         r"are: auto_wrap_policy, reshard_after_forward, cpu_offload"):
        Trainer(accelerator="cpu", strategy="fsdp", devices=1, strategy_options={"wrap_policy": {nn.Linear}})


def test_fsdp_on_one_process():
    with pytest.raises(ValueError, match="needs a world size >= 2; with one device pass strategy='single'"):
        Trainer(accelerator="cpu", strategy="fsdp", devices=1)


@pytest.mark.parametrize("options, message", [
    ({"auto_wrap_policy": nn.Linear}, "must be a set of nn.Module classes"),
    ({"auto_wrap_policy": "Linear"}, "must be a set of nn.Module classes or class names"),
    ({"auto_wrap_policy": {"Linear", 3}}, "takes nn.Module classes or class names"),
    ({"reshard_after_forward": 2}, "reshard_after_forward=2 must be None, True, False, or an int"),
    ({"cpu_offload": "yes"}, "cpu_offload='yes' must be True or False"),
])
def test_bad_fsdp_option_values(options, message):
    from trainscale.runtime.strategies.fsdp import FSDPStrategy

    with pytest.raises(ValueError, match=message):
        FSDPStrategy(torch.device("cpu"), World(world_size=2, local_world_size=2), **options)


@pytest.mark.parametrize("precision, param_dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16),
                                                    ("32-true", None), ("bf16-true", None)])
def test_mixed_precision_policy_follows_the_precision_flag(precision, param_dtype):
    from trainscale.runtime.strategies.fsdp import _mixed_precision_policy

    policy = _mixed_precision_policy(precision)
    assert policy.param_dtype == param_dtype
    assert policy.reduce_dtype == (torch.float32 if param_dtype else None)  # gradients reduced in fp32


def test_fsdp_model_without_parameters_or_with_a_policy_class_not_in_it():
    from trainscale.runtime.strategies.fsdp import FSDPStrategy

    strategy = FSDPStrategy(torch.device("cpu"), World(world_size=2, local_world_size=2))
    with pytest.raises(ValueError, match="model with no parameters.*nothing to shard"):
        strategy.setup_module(nn.Sequential(nn.ReLU()))
    strategy = FSDPStrategy(torch.device("cpu"), World(world_size=2, local_world_size=2),
                            auto_wrap_policy={nn.TransformerEncoderLayer})
    with pytest.raises(ValueError, match="TransformerEncoderLayer do not occur in the model; its module classes "
                                         "are: .*Conv2d"):
        strategy.setup_module(workers.make_model())


def test_last_pointer_and_rotation_with_checkpoint_directories(tmp_path):
    """``last``/``find_last``/removal treat a sharded checkpoint directory like a file."""
    ckpt_dir = tmp_path / "version_0" / "checkpoints"
    for epoch in (1, 2, 3):
        path = ckpt_dir / ckpt.checkpoint_name(epoch, 6 * epoch)
        (path / "sub").mkdir(parents=True)
        (path / ".metadata").write_text("x")
        ckpt.mark_last(path, ckpt_dir)
    ckpt.remove_checkpoint(ckpt_dir / ckpt.checkpoint_name(1, 6))
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["epoch=2-step=12.ckpt", "epoch=3-step=18.ckpt", "last"]
    assert ckpt.find_last(tmp_path) == ckpt_dir / "epoch=3-step=18.ckpt"


def test_ddp_refuses_a_sharded_checkpoint_directory_clearly(tmp_path):
    from trainscale.runtime.checkpoint_io import load_file

    (tmp_path / ".metadata").write_bytes(b"x")  # what DCP writes
    with pytest.raises(CheckpointError, match="is a directory.*strategy='fsdp'"):
        load_file(tmp_path)


def test_a_directory_that_is_not_a_checkpoint_is_named_as_such(tmp_path):
    from trainscale.runtime.checkpoint_io import load_file
    from trainscale.runtime.strategies.fsdp import FSDPStrategy

    (tmp_path / "notes.txt").write_text("x")  # e.g. ckpt_path=<run dir> instead of a checkpoint in it
    with pytest.raises(CheckpointError, match="is a directory, not a checkpoint; pass a checkpoint file"):
        load_file(tmp_path)
    strategy = FSDPStrategy(torch.device("cpu"), World(world_size=2, local_world_size=2))
    with pytest.raises(CheckpointError, match="is a directory but not a sharded checkpoint \\(no .metadata"):
        strategy.load_checkpoint(tmp_path, {})


def test_fsdp_refuses_a_checkpoint_file_clearly(tmp_path):
    from trainscale.runtime.strategies.fsdp import FSDPStrategy

    strategy = FSDPStrategy(torch.device("cpu"), World(world_size=2, local_world_size=2))
    (tmp_path / "epoch=1-step=6.ckpt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a sharded \\(DCP\\) checkpoint directory.*'single'/'ddp'"):
        strategy.load_checkpoint(tmp_path / "epoch=1-step=6.ckpt", {})
    with pytest.raises(FileNotFoundError):
        strategy.load_checkpoint(tmp_path / "missing", {})


def test_fsdp_refuses_an_optimizer_built_before_sharding():
    from trainscale.runtime.strategies.fsdp import FSDPStrategy

    strategy = FSDPStrategy(torch.device("cpu"), World(world_size=2, local_world_size=2))
    with pytest.raises(ValueError, match="optimizer must be built after sharding: pass a factory"):
        strategy.setup_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


@pytest.mark.parametrize("inject", [True, False])
def test_fp16_loss_scaling_agrees_across_shards(inject):
    results = run_distributed(fsdp_workers.fp16_skip_body, inject, timeout=90)
    if inject:  # an inf in one rank's shard: every rank skips and backs off the scale
        assert [changed for changed, _ in results] == [False, False]
        assert results[0][1] == results[1][1] == 2.0 ** 15
    else:
        assert [changed for changed, _ in results] == [True, True]
        assert results[0][1] == results[1][1] == 2.0 ** 16


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_batchnorm_under_fsdp_bf16_mixed_stays_in_fp32_and_trains_like_ddp():
    # before: "expected scalar type BFloat16 but found Float" in batch_norm (bf16 parameters, fp32 statistics)
    results = run_distributed(fsdp_workers.batchnorm_bf16_mixed, 6, timeout=150)
    for rank, r in enumerate(results):
        assert r["bn_param_dtype"] == torch.float32 and r["bn_running_mean_dtype"] == torch.float32
        # the same numerics as ddp's autocast (bf16 convolution and linear layers, fp32 batch norm)
        assert r["fsdp"]["losses"] == pytest.approx(r["ddp"]["losses"], rel=1e-5)
        for name, want in r["ddp"]["weights"].items():
            if rank == 0 or "running" not in name:  # ddp broadcasts rank 0's statistics; fsdp keeps each rank's
                torch.testing.assert_close(r["fsdp"]["weights"][name], want, rtol=1e-5, atol=1e-6, msg=name)
        assert r["fsdp"]["weights"]["1.running_mean"].abs().sum() > 0  # statistics were updated


def test_only_batchnorm_layers_with_state_become_full_precision_units():
    from trainscale.runtime.strategies.apply_fsdp import full_precision_norms

    model = fsdp_workers._bn_net()
    model.append(nn.BatchNorm1d(3, affine=False, track_running_stats=False))  # nothing to keep in fp32
    assert full_precision_norms(model, "bf16-mixed") == [model[1], model[5]]
    assert full_precision_norms(model, "16-mixed") == [model[1], model[5]]
    assert full_precision_norms(model, "32-true") == [] and full_precision_norms(model, "bf16-true") == []
