"""Bodies of the pipeline-parallel tests (module level so ``spawn`` can import them): the Trainer on the
reference GPT, one process or two pipeline stages, with what each run measured."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Subset

from trainscale.callbacks import Callback
from trainscale.models import GPT, GPTConfig, lm_loss

# 4 blocks: with 2 stages each holds 2 of them and one copy of the tied token embedding, about 0.54 of
# the parameters (2 blocks would leave the duplicated embedding at 0.58).
PP_CONFIG = GPTConfig(vocab_size=256, context_length=32, n_layer=4, n_head=4, n_embd=64)


def text_loaders(batch_size: int, train: int, val: int) -> tuple[DataLoader, DataLoader]:
    """The first ``train`` training chunks (shuffled) and ``val`` validation chunks of the byte-level corpus."""
    from trainscale.data import load_text

    train_set, val_set = load_text(context_length=PP_CONFIG.context_length)
    return (DataLoader(Subset(train_set, range(train)), batch_size=batch_size, shuffle=True),
            DataLoader(Subset(val_set, range(val)), batch_size=batch_size))


def state_bytes(optimizer) -> int:
    """Exact bytes this rank holds for the optimizer's parameters, their gradients and its state (of a
    DTensor, the local shard)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors = params + [p.grad for p in params if p.grad is not None] + state
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


class Record(Callback):
    """The loss of every step on this rank, and the largest :func:`state_bytes` seen right after an
    optimizer step (before ``zero_grad``)."""

    def __init__(self) -> None:
        self.losses, self.peak_bytes = [], 0

    def on_train_batch_end(self, trainer, module, loss, batch, batch_idx) -> None:
        if trainer.is_step_end:
            self.losses.append(loss.item())

    def sgd(self, params):
        """SGD with momentum (AdamW's per-element normalisation magnifies rounding differences of
        near-zero gradients), measured after each step."""
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)

        def measure(opt, args, kwargs):
            self.peak_bytes = max(self.peak_bytes, state_bytes(opt))

        optimizer.register_step_post_hook(measure)
        return optimizer


def fit_gpt(rank: int, root: str, strategy: str, *, steps: int | None = None, epochs: int = 1, train: int = 64,
            val: int = 21, schedule: str | None = None, accumulate: int = 1, ckpt_path: str | None = None,
            destroy: bool = False, batch_size: int = 8, meta: bool = False, **flags) -> dict:
    """Fit a GPT (seed 0; built on the meta device if ``meta``) with clipping at norm 0.5; return this rank's
    weights (whole: FSDP shards gathered),
    the per-step losses (and gradient norms from rank zero's step records), the validation loss, the peak
    bytes of parameters + gradients + optimizer state, the summary."""
    import json

    import torch.distributed as dist

    from trainscale.train.trainer import Trainer

    record = Record()
    pp = strategy == "pp"
    trainer = Trainer(accelerator="cpu", devices="auto" if pp else 1, strategy=strategy, max_epochs=epochs,
                      max_steps=steps, seed=0, default_root_dir=root, enable_progress_bar=False, timeout=60,
                      log_every_n_steps=1, gradient_clip_val=0.5, accumulate_grad_batches=accumulate,
                      callbacks=[record], logger=False, pp_schedule=schedule, **flags)
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = GPT(PP_CONFIG)
    train_loader, val_loader = text_loaders(batch_size, train, val)
    dtypes = set()  # of the logits the loss sees (under pp: on the last stage only)

    def loss_fn(logits, targets):
        dtypes.add(str(logits.dtype))
        return lm_loss(logits, targets)

    summary = trainer.fit(model, train_loader, val_loader, loss_fn=loss_fn, optimizer=record.sgd, ckpt_path=ckpt_path)
    records = ([json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
               if rank == 0 else [])
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
               for k, v in model.state_dict().items()}
    out = {"weights": weights, "losses": record.losses,
           "norms": [r["grad_norm"] for r in records if r.get("kind") == "step" and "grad_norm" in r],
           "val_loss": summary["val_loss"], "bytes": record.peak_bytes, "summary": summary, "logit_dtypes": dtypes}
    if destroy and dist.is_initialized():
        dist.destroy_process_group()
    return out


def _compiled(rank: int, root: str, steps: int) -> dict:
    """1F1B with ``compile`` (dynamo with AOT autograd and no code generation, ``backend="aot_eager"``: no
    C++ compiler run); ``graphs``: the graphs dynamo compiled in this process."""
    from torch._dynamo.utils import counters

    counters.clear()
    out = fit_gpt(rank, root, "pp", steps=steps, compile={"backend": "aot_eager"})
    return {**out, "graphs": counters["stats"]["unique_graphs"]}


def pp_runs(rank: int, root: str, steps: int) -> dict:
    """GPipe and 1F1B over 2 stages for ``steps`` steps, 1F1B under "bf16-mixed", 1F1B of a GPT built on the
    meta device, 1F1B with each stage's blocks compiled, then 1F1B with 2 accumulated micro-batches per step;
    one process group for all."""
    return {"gpipe": fit_gpt(rank, f"{root}/gpipe", "pp", steps=steps, schedule="gpipe"),
            "1f1b": fit_gpt(rank, f"{root}/1f1b", "pp", steps=steps, schedule="1f1b", pp_microbatches=2),
            "bf16": fit_gpt(rank, f"{root}/bf16", "pp", steps=steps, precision="bf16-mixed"),
            "meta": fit_gpt(rank, f"{root}/meta", "pp", steps=steps, meta=True),
            "compiled": _compiled(rank, f"{root}/compiled", steps),
            "accumulate": fit_gpt(rank, f"{root}/acc", "pp", steps=2, accumulate=2, destroy=True)}


def pp_resume(rank: int, root: str, parallel: dict | None = None, destroy: bool = True) -> dict:
    """Two epochs uninterrupted, against one epoch then a resume from its "last" checkpoint for the second;
    ``parallel``: the mesh (None: one stage per rank); ``destroy=False``: more runs follow in these processes."""
    small = dict(train=24, val=12, parallel=parallel)
    full = fit_gpt(rank, f"{root}/full", "pp", epochs=2, **small)
    first = fit_gpt(rank, f"{root}/stopped", "pp", epochs=1, **small)
    resumed = fit_gpt(rank, f"{root}/stopped", "pp", epochs=2, ckpt_path="last", destroy=destroy, **small)
    return {"full": full, "first": first, "resumed": resumed}


def pp_dp_runs(rank: int, root: str, steps: int) -> dict:
    """On 4 ranks: 2 stages × 2 tensor-parallel ranks over batches of 16, with sequence parallelism (1F1B,
    a checkpoint at the end) and without (GPipe), under "bf16-mixed", and resumed from a checkpoint
    (:func:`pp_resume`); 2 stages × 2 FSDP shards (1F1B), 2 stages × 2 replicas
    (GPipe), 2 stages × 2 shards under "bf16-mixed", each over 2 data-parallel batches of 8, then 2 stages ×
    2 shards accumulating 2 micro-batches per step over a ragged epoch; one process group for all."""
    pp_tp = dict(steps=steps, val=20, batch_size=16, parallel={"pp": 2, "tp": 2})
    return {"tp": fit_gpt(rank, f"{root}/tp", "pp", **pp_tp),
            "tp_gpipe": fit_gpt(rank, f"{root}/tp_gpipe", "pp", schedule="gpipe",
                                strategy_options={"sequence_parallel": False}, **pp_tp),
            "tp_bf16": fit_gpt(rank, f"{root}/tp_bf16", "pp", precision="bf16-mixed", **pp_tp),
            "tp_resume": pp_resume(rank, f"{root}/tp_resume", {"pp": 2, "tp": 2}, destroy=False),
            "shard": fit_gpt(rank, f"{root}/shard", "pp", steps=steps, val=20, parallel={"pp": 2, "dp_shard": 2}),
            "replicate": fit_gpt(rank, f"{root}/replicate", "pp", steps=steps, val=20, schedule="gpipe",
                                 parallel={"pp": 2, "dp_replicate": 2}),
            "bf16": fit_gpt(rank, f"{root}/bf16", "pp", steps=steps, val=20, parallel={"pp": 2, "dp_shard": 2},
                            precision="bf16-mixed"),
            # 28 samples per rank: micro-batches 8, 8 | 8, 4 (a new batch shape inside an accumulated step)
            "accumulate": fit_gpt(rank, f"{root}/acc", "pp", train=56, val=20, accumulate=2,
                                  parallel={"pp": 2, "dp_shard": 2}, destroy=True)}


def pp_hsdp_run(rank: int, root: str, steps: int) -> dict:
    """On 8 ranks: 2 stages × HSDP (2 replicas × 2 FSDP shards), 1F1B, each data-parallel rank reading batches of 8."""
    return fit_gpt(rank, root, "pp", steps=steps, val=20, parallel={"pp": 2, "dp_replicate": 2, "dp_shard": 2},
                   destroy=True)
