"""A reference decoder-only transformer (GPT-2 shaped, pre-norm), for language-model workloads.

The architecture follows GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners") as written in karpathy/nanoGPT ``model.py``: learned token and position embeddings,
``n_layer`` pre-norm blocks ``x + attn(ln(x))``, ``x + mlp(ln(x))``, a final LayerNorm and an output
projection that reuses the token embedding matrix (tied embeddings; Press & Wolf 2017). Attention
runs through ``F.scaled_dot_product_attention(is_causal=True)`` (FlashAttention kernels on GPUs).

Two choices make the model easy to parallelise from outside without touching this file:
- query, key and value are three ``nn.Linear`` (not one fused matrix) and every reshape to heads uses
  ``-1`` for the head count, so a column-wise tensor-parallel split of ``q``/``k``/``v`` gives each
  rank whole heads (torchtitan's Llama does the same);
- the output projection is ``F.linear(x, wte.weight)``, not a second module sharing the parameter, so
  the tie survives meta-device construction, ``to_empty`` and sharding (there is one parameter).

Nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`GPT`.

    Attributes:
        vocab_size: tokens in the vocabulary (256 for byte-level text).
        context_length: the longest sequence ``T`` the position embedding covers.
        n_layer: transformer blocks.
        n_head: attention heads; must divide ``n_embd``.
        n_embd: model width ``C``.
        dropout: dropout probability on attention weights and residual branches (0 for parity tests).
        bias: biases in the linear layers and LayerNorms.
    """

    vocab_size: int = 256
    context_length: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} must be an int >= 1")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_head={self.n_head} must divide n_embd={self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r} must be in [0, 1)")


# Named sizes. "tiny"/"mini" are for CPU tests and demos; the others are GPT-2's shapes (vocabulary
# 50304 = 50257 padded to a multiple of 64, nanoGPT's choice) and a ~1.3B model of GPT-3's table
# (Brown et al. 2020, Table 2.1: 24 layers, width 2048). Parameter counts: docs/strategies.md.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, context_length=64, n_layer=2, n_head=2, n_embd=32),
    "mini": GPTConfig(vocab_size=256, context_length=128, n_layer=4, n_head=4, n_embd=128),
    "gpt2-124m": GPTConfig(vocab_size=50304, context_length=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-350m": GPTConfig(vocab_size=50304, context_length=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-774m": GPTConfig(vocab_size=50304, context_length=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt3-1.3b": GPTConfig(vocab_size=50304, context_length=2048, n_layer=24, n_head=16, n_embd=2048),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config.n_embd
        self.head_dim = c // config.n_head
        self.q = nn.Linear(c, c, bias=config.bias)
        self.k = nn.Linear(c, c, bias=config.bias)
        self.v = nn.Linear(c, c, bias=config.bias)
        self.proj = nn.Linear(c, c, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under a column-wise tensor-parallel split each rank holds n_head / tp whole heads
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C) (C / tp under tensor parallelism)
        return self.resid_dropout(self.proj(y))  # (B, T, C)


class MLP(nn.Module):
    """``Linear(C, 4C)`` → GELU → ``Linear(4C, C)``: ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))  # (B, T, 4C) inside, (B, T, C) out


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Input: token ids ``(B, T)`` int64 with ``T <= config.context_length``; output: next-token logits
    ``(B, T, vocab_size)``. Train with :func:`lm_loss`.

    Args:
        config: a :class:`GPTConfig`, or the name of one of ``PRESETS`` ("tiny", "mini",
            "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt3-1.3b").

    Construction initialises the weights (:meth:`init_weights`). For models too large for one device,
    build under ``torch.device("meta")`` (no memory), let a sharded strategy place the shards with
    ``to_empty``, then call :meth:`init_weights` (trainscale's fsdp strategy does this).

    Raises:
        ValueError: an unknown preset name.
    """

    def __init__(self, config: GPTConfig | str = "mini") -> None:
        super().__init__()
        if isinstance(config, str):
            if config not in PRESETS:
                raise ValueError(f"unknown GPT preset {config!r}; choose one of {', '.join(map(repr, PRESETS))} "
                                 "or pass a GPTConfig")
            config = PRESETS[config]
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.context_length, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialise every parameter in place, GPT-2's way: linear and embedding weights from
        N(0, 0.02²), the residual output projections from N(0, (0.02/√(2·n_layer))²), biases zero,
        LayerNorms reset. Works on any device and on sharded (DTensor) parameters; a no-op on meta."""
        std = 0.02
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scale = 1 / math.sqrt(2 * self.config.n_layer) if name.endswith(".proj") else 1.0
                nn.init.normal_(module.weight, mean=0.0, std=std * scale)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # A pipeline stage holds some of the modules, the others None or left out of ``blocks`` (cut from
        # outside, torchtitan's rule): without ``wpe`` the input is the previous stage's hidden states
        # (B, T, C); without ``ln_f`` the output is this stage's hidden states (B, T, C).
        x = self._embed(idx) if self.wpe is not None else idx  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        if self.ln_f is None:
            return x
        x = self.ln_f(x)  # (B, T, C)
        return F.linear(x, self.wte.weight)  # (B, T, vocab_size): tied to the token embedding

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` → token plus position embeddings ``(B, T, C)``."""
        T = idx.shape[1]
        if T > self.config.context_length:
            raise ValueError(f"sequence length {T} exceeds context_length={self.config.context_length}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameters (the tied output matrix counted once); ``non_embedding`` leaves out the position
        embedding and the token embedding (the convention of Kaplan et al. 2020)."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.wte.weight.numel() + self.wpe.weight.numel()
        return total

    def flops_per_token(self, context_length: int | None = None) -> float:
        """Training FLOPs per token (forward and backward; a multiply-add is 2 FLOPs) at sequence length
        ``context_length`` (default ``config.context_length``): ``6·N + 12·L·C·T``, PaLM's estimate
        (Chowdhery et al. 2022, appendix B; nanoGPT ``estimate_mfu``), where ``6·N`` covers the matrix
        products with the weights (2 forward, 4 backward per parameter) and ``12·L·C·T`` the attention
        scores and their weighted sum (``L`` layers, width ``C``, ``T`` tokens; causal masking not
        discounted). ``N`` counts every parameter but the position embedding (a lookup, no product); the
        token embedding is counted because the tied output projection multiplies by it."""
        T = self.config.context_length if context_length is None else context_length
        n = self.num_parameters() - self.wpe.weight.numel()
        return 6.0 * n + 12.0 * self.config.n_layer * self.config.n_embd * T


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats: logits ``(B, T, V)``, targets ``(B, T)`` int64."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B·T, V) against (B·T,)
