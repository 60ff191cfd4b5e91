"""Bodies of the Hugging Face ``transformers`` tests: a tiny Llama (built from its config, nothing
downloaded) trained by ``Trainer.fit`` on dict batches, under ddp and fsdp in the same pair of processes."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from trainscale.callbacks import Callback

VOCAB, SEQ = 128, 8


def tiny_llama(seed: int = 0, tie: bool = False):
    """LlamaForCausalLM with 2 decoder layers of width 32 (~26k parameters), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                        tie_word_embeddings=tie, use_cache=False))


def tiny_gpt2(seed: int = 0):
    """GPT2LMHeadModel with 2 blocks of width 32, its head tied to the token embedding (GPT-2's default), seeded;
    no dropout (runs compared with a plain process draw other masks)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=2 * SEQ,
                                      bos_token_id=0, eos_token_id=0, use_cache=False, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def tiny_t5(seed: int = 0):
    """T5ForConditionalGeneration with 1 encoder and 1 decoder block of width 32, its shared embedding tied to the
    encoder's, the decoder's and the head (T5's default: one weight under four names), seeded; no dropout."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    return T5ForConditionalGeneration(T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                               vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1, use_cache=False))


def gpt2_tp_plan() -> dict:
    """A user's tensor-parallel plan of :func:`tiny_gpt2` (GPT-2 declares none; its blocks' ``Conv1D`` layers take no
    torch ``ParallelStyle``): the vocabulary rows of the token embedding and of the head tied to it split alike."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"transformer.wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}


class TokenDicts(Dataset):
    """``n`` samples of ``{"input_ids", "attention_mask", "labels"}`` (random token ids, labels = inputs: the
    model shifts them), what a tokenizer's collator gives a causal language model."""

    def __init__(self, n: int = 16, seed: int = 0) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": self.ids[i]}


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def plain_reference(batch_size: int = 8, tie: bool = False, model=None, steps: int | None = None) -> dict:
    """One process, plain PyTorch: the same samples in order, ``model(**batch).loss``, SGD; ``model`` (default: the
    tiny Llama) trained ``steps`` steps (default: one epoch)."""
    model = tiny_llama(0, tie) if model is None else model
    opt = sgd(model.parameters())
    for batch in list(DataLoader(TokenDicts(), batch_size=batch_size))[:steps]:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


PROMPT = torch.tensor([[3, 17, 42, 5], [9, 9, 1, 77]])


def greedy(model) -> tuple[torch.Tensor, torch.Tensor]:
    """``(model(input_ids=PROMPT).logits, model.generate(PROMPT, 4 greedy new tokens))``: what a user does with a
    fitted model (evaluation, generation), called on the model itself."""
    with torch.no_grad():
        logits = model(input_ids=PROMPT).logits
        tokens = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=4, do_sample=False,
                                pad_token_id=0)
    return logits, tokens


class ForwardAtFitStart(Callback):
    """A callback that calls the model itself in ``on_fit_start`` (after it is sharded, before the first step),
    as a user checking the loaded weights does: its logits on ``PROMPT``."""

    def __init__(self) -> None:
        self.logits = None

    def on_fit_start(self, trainer, module) -> None:
        with torch.no_grad():
            self.logits = module(input_ids=PROMPT).logits


def _fit(root: str, strategy: str, tie: bool, model=None, **flags):
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", strategy=strategy, max_epochs=1, seed=0,
                      default_root_dir=root, enable_progress_bar=False, timeout=60, **flags)
    model = tiny_llama(0, tie) if model is None else model
    # not shuffled: rank r reads samples r, r + 2, ...; the two ranks' batches of 4 are the reference's batch of 8
    summary = trainer.fit(model, DataLoader(TokenDicts(), batch_size=4), DataLoader(TokenDicts(8, seed=1), batch_size=4),
                          optimizer=sgd)
    return trainer, model, summary


def hf_body(rank: int, root: str) -> dict:
    """ddp (tied embeddings; its checkpoint exported by rank 0), fsdp with the default units and activation
    checkpointing by class name (the model called in ``on_fit_start`` and, after ``fit``, called and
    ``generate``d), a tied GPT-2 under fsdp and under tp (a user's plan) and a T5 under fsdp for one step, tp by the model's own plan (tied), then the exported directory
    loaded into a new fsdp-sharded model built on the meta device, on one process group: each run's final weights (whole),
    checkpoint and telemetry; the fsdp units; the tp placements; the loaded weights."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from tests.fsdp_workers import full_state

    import torch.distributed as dist

    from trainscale.export import export, load_pretrained
    from trainscale.runtime.strategies.apply_tp import apply_tp
    from trainscale.runtime.runtime import Runtime

    out = {}
    trainer, model, summary = _fit(f"{root}/ddp", "ddp", tie=True)
    out["ddp"] = {"state": full_state(model), "summary": summary, "dir": str(trainer.run_dir)}
    if rank == 0:
        export(trainer.run_dir / "checkpoints" / "last", f"{root}/exported")
    dist.barrier()
    at_start = ForwardAtFitStart()
    trainer, model, summary = _fit(f"{root}/fsdp", "fsdp", tie=False, activation_checkpointing={"LlamaDecoderLayer"},
                                   callbacks=[at_start])
    logits, tokens = greedy(model)  # the fitted, still sharded model called as it is
    out["fsdp"] = {"state": full_state(model), "summary": summary, "dir": str(trainer.run_dir),
                   "units": [type(m).__name__ for m in trainer.last_setup[1].modules() if isinstance(m, FSDPModule)],
                   "at_start": at_start.logits, "logits": logits, "tokens": tokens}
    trainer, model, _ = _fit(f"{root}/gpt2", "fsdp", tie=True, model=tiny_gpt2(), max_steps=1)
    out["gpt2"] = {"state": full_state(model), "dir": str(trainer.run_dir)}
    trainer, model, _ = _fit(f"{root}/t5", "fsdp", tie=True, model=tiny_t5(), max_steps=1)
    out["t5"] = {"state": full_state(model), "dir": str(trainer.run_dir)}
    trainer, model, _ = _fit(f"{root}/gpt2_tp", "tp", tie=True, model=tiny_gpt2(), max_steps=1, tp_plan=gpt2_tp_plan())
    out["gpt2_tp"] = {"state": full_state(model), "dir": str(trainer.run_dir),
                      "tied": model.lm_head.weight is model.transformer.wte.weight,
                      "placement": str(model.lm_head.weight.placements)}
    try:  # the head split, its tied embedding not: refused at setup
        apply_tp(tiny_gpt2(), trainer.runtime.strategy.mesh["tp"], {"lm_head": gpt2_tp_plan()["lm_head"]})
    except ValueError as err:
        out["gpt2_tp"]["half_plan"] = str(err)
    trainer, model, summary = _fit(f"{root}/tp", "tp", tie=True)
    out["tp"] = {"state": full_state(model), "summary": summary, "dir": str(trainer.run_dir),
                 "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                 "placements": {k: str(p.placements[0]) if isinstance(p, DTensor) else "plain"
                                for k, p in model.named_parameters(remove_duplicate=False)}}
    # the exported directory loaded into a model built on the meta device, sharded by fsdp (each rank allocates
    # and initialises its shards only), each rank reading the slices of its shards: never whole on one rank
    with torch.device("meta"):
        fresh = tiny_llama(seed=1, tie=True)
    Runtime(accelerator="cpu", devices="auto", strategy="fsdp", timeout=60).setup(fresh)
    load_pretrained(fresh, f"{root}/exported")
    out["imported"] = {"state": full_state(fresh), "sharded": isinstance(fresh.model.embed_tokens.weight, DTensor)}
    trainer.runtime.teardown()
    return out

