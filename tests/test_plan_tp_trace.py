"""trainscale.plan's traced tensor-parallel step: the collectives DTensor issues for the built-in GPT plan,
logged on a fake process group (no process started, nothing sent), against Megatron-LM's count (Shoeybi et
al. 2019), and the arithmetic that times them (trainscale.plan.comm)."""

import collections
import functools

import pytest
import torch

from tests import plan_workers
from tests.parallel_workers import CONFIG
from trainscale.models import GPT
from trainscale.models.gpt import lm_loss
from trainscale.plan import comm, memory
from trainscale.plan.collectives import Collective, per_step

BATCH = 4
SAMPLE = (torch.zeros(CONFIG.context_length, dtype=torch.long), torch.zeros(CONFIG.context_length, dtype=torch.long))


@functools.cache
def _traced(strategy: str, devices: int, sequence_parallel: bool | None = None) -> dict:
    """The traced step of ``strategy`` on ``devices`` (traced once per module: three of the tests share each trace;
    the callers only read it)."""
    meta = memory.build_meta_model(lambda: GPT(CONFIG))
    return memory.traced_memory(meta, SAMPLE, BATCH, lm_loss, plan_workers.adamw, strategy, devices,
                                sequence_parallel=sequence_parallel)


def test_a_tp_step_issues_megatrons_collectives():
    traced = _traced("tp", 2, sequence_parallel=False)
    kinds = collections.Counter(c.kind for c in traced["collectives"])
    layers = CONFIG.n_layer
    # all-reduces: the row-split token embedding's output (1); per block the outputs of the two row-parallel
    # projections in forward (2) and the input gradients of the four column-parallel layers q, k, v, fc in
    # backward (4); the input gradient of the tied output projection (1). All-gathers: the column-split
    # position embedding's output and the vocabulary-sharded logits.
    assert kinds == {"all_reduce": 6 * layers + 2, "all_gather": 2}, kinds
    activation = BATCH * CONFIG.context_length * CONFIG.n_embd * 4  # (B, T, C) float32
    reduces = [c.nbytes for c in traced["collectives"] if c.kind == "all_reduce"]
    assert reduces == [activation] * len(reduces)
    gathers = sorted(c.nbytes for c in traced["collectives"] if c.kind == "all_gather")
    assert gathers == [CONFIG.context_length * CONFIG.n_embd // 2 * 4,  # one rank's half of the (T, C) positions
                       BATCH * CONFIG.context_length * CONFIG.vocab_size // 2 * 4]  # half the (B, T, V) logits
    assert _traced("single", 1)["collectives"] == []


def test_with_sequence_parallelism_the_all_reduces_become_all_gathers_and_reduce_scatters():
    traced = _traced("tp", 2)  # the default with the built-in plan, as the strategy applies it
    kinds = collections.Counter(c.kind for c in traced["collectives"])
    layers, B, T, C = CONFIG.n_layer, BATCH, CONFIG.context_length, CONFIG.n_embd
    # Korthikanti et al. 2022: per block an all-gather before attention and before the MLP and a reduce-scatter
    # after each row-parallel projection in forward, and their conjugates in backward (4 + 4); the token
    # embedding's reduce-scatter and the final norm's all-gather for the tied projection (each with its
    # conjugate); the position embedding's gather and its gradient's; the logits; the norms' weight gradients,
    # partial sums over each rank's tokens, all-reduced (2 per block and the final norm)
    assert kinds == {"reduce_scatter": 4 * layers + 2, "all_gather": 4 * layers + 2 + 3,
                     "all_reduce": 2 * layers + 1}, kinds
    assert {c.nbytes for c in traced["collectives"] if c.kind == "reduce_scatter"} == {B * T * C * 4}
    assert {c.nbytes for c in traced["collectives"] if c.kind == "all_reduce"} == {C * 4}  # a LayerNorm's weight
    assert traced["peak"] < _traced("tp", 2, sequence_parallel=False)["peak"]  # the norms' inputs split by sequence


def test_tp_halves_the_traced_peak_of_the_weights_and_states():
    single, tp = _traced("single", 1), _traced("tp", 2)
    assert tp["peak"] < single["peak"]  # each rank holds half the matrices, their gradients and AdamW states
    assert tp["activations"] < single["activations"]


def test_collectives_are_timed_by_the_ring_formulas():
    link = comm.Link(1e9, 1e-5)
    log = [Collective("all_reduce", 1000), Collective("all_gather", 500), Collective("reduce_scatter", 1000)]
    expected = comm.all_reduce_s(1000, 4, link) + comm.all_gather_s(2000, 4, link) + comm.all_gather_s(1000, 4, link)
    assert comm.collectives_s(log, 4, link) == pytest.approx(expected)
    assert comm.collectives_s(log, 1, link) == 0.0
    with pytest.raises(ValueError, match="no time model"):
        comm.collectives_s([Collective("broadcast", 8)], 2, link)


def test_hsdp_is_fsdp_in_the_shard_group_then_an_all_reduce_of_a_shard_across_replicas():
    link = comm.Link(1e9, 1e-5)
    fsdp_part = comm.fsdp_comm_s(400, 400, 800, 4, link)
    assert comm.hsdp_comm_s(400, 400, 800, 4, 2, link) == pytest.approx(fsdp_part + comm.all_reduce_s(200, 2, link))
    assert comm.hsdp_comm_s(400, 400, 800, 4, 1, link) == pytest.approx(fsdp_part)


def test_per_step_keeps_one_of_identical_steps():
    log = [Collective("all_reduce", 1), Collective("all_gather", 2)] * 2
    assert per_step(log, 2) == log[:2]
    with pytest.raises(ValueError, match="identical steps"):
        per_step(log[:3], 2)
