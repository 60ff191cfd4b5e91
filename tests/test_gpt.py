"""The reference GPT: shapes, causality, meta-device construction, sizes."""

import math

import pytest
import torch

from trainscale.models import GPT, PRESETS, GPTConfig, lm_loss

TINY = GPTConfig(vocab_size=64, context_length=16, n_layer=2, n_head=2, n_embd=32)


def test_forward_shape_and_loss():
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, 64, (3, 10))
    logits = model(idx)
    assert logits.shape == (3, 10, 64) and logits.dtype == torch.float32
    targets = torch.randint(0, 64, (3, 10))
    expected = torch.nn.functional.cross_entropy(logits.reshape(30, 64), targets.reshape(30))
    assert torch.equal(lm_loss(logits, targets), expected)
    assert abs(lm_loss(logits, targets).item() - math.log(64)) < 0.1  # small init: near-uniform predictions


def test_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    idx = torch.randint(0, 64, (2, 12))
    changed = idx.clone()
    changed[:, 7:] = torch.randint(0, 64, (2, 5))
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-3  # the later positions do see the change


def test_output_projection_is_tied_to_the_token_embedding():
    model = GPT(TINY)
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and not any("head" in n for n in names)
    with torch.no_grad():
        model.wte.weight.zero_()
    assert model(torch.zeros(1, 4, dtype=torch.long)).abs().max() == 0  # logits = x @ wte.weight.T


def test_meta_construction_then_init_weights_gives_finite_gpt2_initialisation():
    with torch.device("meta"):
        model = GPT(TINY)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert abs(model.wte.weight.std().item() - 0.02) < 0.002
    proj_std = 0.02 / math.sqrt(2 * TINY.n_layer)
    assert abs(model.blocks[0].mlp.proj.weight.std().item() - proj_std) < 0.1 * proj_std
    assert torch.equal(model.ln_f.weight, torch.ones(32))
    loss = lm_loss(model(torch.randint(0, 64, (2, 8))), torch.randint(0, 64, (2, 8)))
    loss.backward()
    assert torch.isfinite(loss)


def test_preset_sizes_follow_the_parameter_formula():
    """12·L·C² (attention 4C², MLP 8C²) + V·C (tied) + T·C + LayerNorm weights (2L + 1)·C."""
    for name, c in PRESETS.items():
        with torch.device("meta"):
            model = GPT(name)
        expected = 12 * c.n_layer * c.n_embd ** 2 + (c.vocab_size + c.context_length) * c.n_embd \
            + (2 * c.n_layer + 1) * c.n_embd
        assert model.num_parameters() == expected, name


def test_bad_config_and_sequence_length_raise():
    with pytest.raises(ValueError, match="n_head=3 must divide n_embd=32"):
        GPTConfig(n_head=3, n_embd=32)
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'"):
        GPT("huge")
    with pytest.raises(ValueError, match="exceeds context_length=16"):
        GPT(TINY)(torch.zeros(1, 17, dtype=torch.long))


def test_flops_per_token_matches_torchs_flop_counter():
    """PaLM's 6·N + 12·L·C·T against FlopCounterMode over forward and backward, attention computed by
    the math kernel (matrix products the counter sees); the estimate also counts the norms' parameters
    (elementwise, 6 FLOPs each, which the counter leaves out: 0.3 % here)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    config = GPTConfig(vocab_size=256, context_length=32, n_layer=2, n_head=4, n_embd=64)
    model = GPT(config)
    x = torch.randint(0, 256, (2, 32))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        lm_loss(model(x), x).backward()
    counted = counter.get_total_flops() / x.numel()
    assert model.flops_per_token() == pytest.approx(counted, rel=5e-3)
    assert model.flops_per_token(16) < model.flops_per_token(32)  # attention grows with the context
