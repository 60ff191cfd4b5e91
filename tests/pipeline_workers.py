"""Bodies of the pipeline-parallel tests (module level so ``spawn`` can import them): the Trainer on the
reference GPT, one process or two pipeline stages, with what each run measured."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from trainscale.callbacks import Callback
from trainscale.models import GPT, GPTConfig, lm_loss

# 4 blocks: with 2 stages each holds 2 of them and one copy of the tied token embedding, about 0.54 of
# the parameters (2 blocks would leave the duplicated embedding at 0.58).
PP_CONFIG = GPTConfig(vocab_size=256, context_length=32, n_layer=4, n_head=4, n_embd=64)
# the meta-device run's loss must fall by 0.2 from ~ln 256: more steps than a parity check needs
META_STEPS = 4


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

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.is_step_end:
            self.losses.append(outputs["loss"].item())

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
            destroy: bool = False, batch_size: int = 8, meta: bool = False, net: bool = False, callbacks: tuple = (),
            **flags) -> dict:
    """Fit a GPT (seed 0; built on the meta device if ``meta``; with ``net``, a :class:`Net` on
    :func:`net_loaders` instead; ``callbacks`` after the one that records) with clipping at norm 0.5; return this
    rank's weights (whole: FSDP and
    tensor-parallel shards gathered), the per-step losses (and gradient norms from rank zero's step records),
    the validation loss, the peak bytes of parameters + gradients + optimizer state, the summary."""
    import json

    import torch.distributed as dist

    from trainscale.loop.trainer import Trainer

    record = Record()
    pp = strategy == "pp"
    trainer = Trainer(accelerator="cpu", devices="auto" if pp else 1, strategy=strategy, max_epochs=epochs,
                      max_steps=steps, seed=0, default_root_dir=root, enable_progress_bar=False, timeout=60,
                      log_every_n_steps=1, gradient_clip_val=0.5, accumulate_grad_batches=accumulate,
                      callbacks=[record, *callbacks], logger=False, pp_schedule=schedule, **flags)
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = Net() if net else GPT(PP_CONFIG)
    train_loader, val_loader = (net_loaders if net else text_loaders)(batch_size, train, val)
    dtypes = set()  # of the logits the loss sees (under pp: on the last stage only)

    def loss_fn(logits, targets):
        dtypes.add(str(logits.dtype))
        return (torch.nn.functional.cross_entropy if net else lm_loss)(logits, targets)

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


def _counting_gradient_takes(run: Callable[[], dict]) -> dict:
    """``run()``, with ``takes``: how often a pipeline runner took its stage's gradients aside (on the first step of
    each batch shape only: ``PipelineRunner.train_step``'s ``fresh``)."""
    from trainscale.runtime.strategies.apply_pp import PipelineRunner

    original, takes = PipelineRunner._take_gradients, []

    def counted(self):
        takes.append(1)
        return original(self)

    PipelineRunner._take_gradients = counted
    try:
        return {**run(), "takes": len(takes)}
    finally:
        PipelineRunner._take_gradients = original


def pp_runs(rank: int, root: str, steps: int) -> dict:
    """GPipe and 1F1B over 2 stages for ``steps`` steps, 1F1B under "bf16-mixed", 1F1B of a GPT built on the
    meta device (:data:`META_STEPS` steps), 1F1B with each stage's blocks compiled, then 1F1B with 2 accumulated
    micro-batches per step, then :func:`pp_fp16_runs`, :func:`plan_errors` and :func:`pp_resume` (one stage per
    rank); one process group for all."""
    gpipe = _counting_gradient_takes(lambda: fit_gpt(rank, f"{root}/gpipe", "pp", steps=steps, schedule="gpipe"))
    return {"gpipe": gpipe,
            "1f1b": fit_gpt(rank, f"{root}/1f1b", "pp", steps=steps, schedule="1f1b", pp_microbatches=2),
            "bf16": fit_gpt(rank, f"{root}/bf16", "pp", steps=steps, precision="bf16-mixed"),
            "meta": fit_gpt(rank, f"{root}/meta", "pp", steps=META_STEPS, meta=True),
            "compiled": _compiled(rank, f"{root}/compiled", steps),
            "accumulate": fit_gpt(rank, f"{root}/acc", "pp", steps=2, accumulate=2),
            "fp16": pp_fp16_runs(rank, f"{root}/fp16", steps),
            "plan_errors": plan_errors(rank, f"{root}/errors"),
            "resume": pp_resume(rank, f"{root}/resume")}


def pp_resume(rank: int, root: str, parallel: dict | None = None, destroy: bool = True) -> dict:
    """Two epochs uninterrupted, against one epoch then a resume from its "last" checkpoint for the second;
    ``parallel``: the mesh (None: one stage per rank); ``destroy=False``: more runs follow in these processes.
    2 micro-batches per batch (not the default 4 · stages): what is checked is the resume, not the schedule, and
    each micro-batch costs a pass through every stage (most of the time under tp: its DTensor collectives).
    16 training samples: 2 steps an epoch on one pipeline, 1 on each of 2 data-parallel ones; the resumed epoch's
    first step already applies the momentum saved with the checkpoint."""
    small = dict(train=16, val=8, parallel=parallel, pp_microbatches=2)
    full = fit_gpt(rank, f"{root}/full", "pp", epochs=2, **small)
    first = fit_gpt(rank, f"{root}/stopped", "pp", epochs=1, **small)
    resumed = fit_gpt(rank, f"{root}/stopped", "pp", epochs=2, ckpt_path="last", destroy=destroy, **small)
    return {"full": full, "first": first, "resumed": resumed}


def pp_tp_runs(rank: int, root: str, steps: int) -> dict:
    """On 4 ranks: 2 stages × 2 tensor-parallel ranks over batches of 16, with sequence parallelism (1F1B,
    a checkpoint at the end) and without (GPipe), and under "bf16-mixed", then :func:`pp_tp_user_runs` and
    :func:`pp_resume` on that mesh; one process group for all. 2 micro-batches of 8 per batch (the default number,
    4 · stages, is ``pp_runs``'s GPipe run): each micro-batch is a pass of DTensor collectives through both stages."""
    pp_tp = dict(steps=steps, val=20, batch_size=16, parallel={"pp": 2, "tp": 2}, pp_microbatches=2)
    return {"tp": fit_gpt(rank, f"{root}/tp", "pp", **pp_tp),
            "tp_gpipe": fit_gpt(rank, f"{root}/tp_gpipe", "pp", schedule="gpipe",
                                strategy_options={"sequence_parallel": False}, **pp_tp),
            "tp_bf16": fit_gpt(rank, f"{root}/tp_bf16", "pp", precision="bf16-mixed", **pp_tp),
            "user": pp_tp_user_runs(rank, f"{root}/user", steps),
            "resume": pp_resume(rank, f"{root}/resume", {"pp": 2, "tp": 2})}


def pp_dp_runs(rank: int, root: str, steps: int) -> dict:
    """On 4 ranks: 2 stages × 2 FSDP shards (1F1B), 2 stages × 2 replicas (GPipe), 2 stages × 2 shards under
    "bf16-mixed", each over 2 data-parallel batches of 8, then 2 stages × 2 shards accumulating 2 micro-batches
    per step over a ragged epoch, then :func:`pp_resume` on 2 stages × 2 shards; one process group for all.
    The first three cut each batch into 2 micro-batches; the accumulating run keeps the default count (4 · stages),
    which adapts to its batch of 4."""
    two = dict(steps=steps, val=20, pp_microbatches=2)
    return {"shard": fit_gpt(rank, f"{root}/shard", "pp", parallel={"pp": 2, "dp_shard": 2}, **two),
            "replicate": fit_gpt(rank, f"{root}/replicate", "pp", schedule="gpipe",
                                 parallel={"pp": 2, "dp_replicate": 2}, **two),
            "bf16": fit_gpt(rank, f"{root}/bf16", "pp", parallel={"pp": 2, "dp_shard": 2}, precision="bf16-mixed",
                            **two),
            # 28 samples per rank: micro-batches 8, 8 | 8, 4 (a new batch shape inside an accumulated step)
            "accumulate": fit_gpt(rank, f"{root}/acc", "pp", train=56, val=20, accumulate=2,
                                  parallel={"pp": 2, "dp_shard": 2}),
            "resume": pp_resume(rank, f"{root}/resume", {"pp": 2, "dp_shard": 2})}


def pp_hsdp_run(rank: int, root: str, steps: int) -> dict:
    """On 8 ranks: 2 stages × HSDP (2 replicas × 2 FSDP shards), 1F1B, each data-parallel rank reading batches of 8."""
    return fit_gpt(rank, root, "pp", steps=steps, val=20, parallel={"pp": 2, "dp_replicate": 2, "dp_shard": 2},
                   destroy=True)


class Block(nn.Module):
    """A residual MLP block whose two weights a Megatron pair splits (no bias on the row-split layer, so
    that every parameter is split)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """A user's model (not a GPT) that tolerates a pipeline cut: inputs ``(B, 16)``, logits ``(B, 16)``."""

    def __init__(self, features: int = 16, width: int = 32, depth: int = 4, classes: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def net_loaders(batch_size: int, train: int, val: int) -> tuple[DataLoader, DataLoader]:
    """Random inputs and labels (seed 1), ``train`` shuffled for training and ``val`` for validation."""
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(train + val, 16, generator=generator), torch.randint(0, 16, (train + val,), generator=generator)
    return (DataLoader(TensorDataset(x[:train], y[:train]), batch_size=batch_size, shuffle=True),
            DataLoader(TensorDataset(x[train:], y[train:]), batch_size=batch_size))


def net_plan() -> dict:
    """A tensor-parallel plan covering every weight of :class:`Net` (keys against the whole model)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"embed": ColwiseParallel(output_layouts=Replicate()), "layers.*.up": ColwiseParallel(),
            "layers.*.down": RowwiseParallel(), "head": ColwiseParallel(output_layouts=Replicate())}


def parallelize_net(stage: Net, mesh) -> Net:
    """:func:`net_plan` written as a function of the stage, which holds only the modules it keeps."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in stage.layers:  # this stage's blocks only
        parallelize_module(layer, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for name in ("embed", "head"):  # on the first stage, on the last
        if getattr(stage, name) is not None:
            parallelize_module(getattr(stage, name), mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
    return stage


def pp_tp_user_runs(rank: int, root: str, steps: int) -> dict:
    """On 4 ranks, 2 stages × 2 tensor-parallel ranks of a :class:`Net` cut at ``layers.2``, split by
    :func:`net_plan` given as ``tp_plan``, by :func:`parallelize_net`, and by a plan of the blocks only (the
    embedding and the head plain, replicated), then that plan under "16-mixed" (``fp16_error``: the message
    of the ValueError it raised), on the process group of the runs before it."""
    flags = dict(steps=steps, val=16, batch_size=16, net=True, parallel={"pp": 2, "tp": 2},
                 pp_split_points=["layers.2"])
    blocks = {k: v for k, v in net_plan().items() if k.startswith("layers")}
    out = {"plan": fit_gpt(rank, f"{root}/plan", "pp", tp_plan=net_plan(), **flags),
           "fn": fit_gpt(rank, f"{root}/fn", "pp", parallelize=parallelize_net, **flags),
           "blocks": fit_gpt(rank, f"{root}/blocks", "pp", tp_plan=blocks, **flags)}
    try:
        fit_gpt(rank, f"{root}/fp16", "pp", tp_plan=blocks, precision="16-mixed", **flags)
    except ValueError as error:
        out["fp16_error"] = str(error)
    return out


def planted_inf(rank: int, root: str, agree: bool, steps: int = 3, poisoned: int = 1) -> dict:
    """A hand-written loop on 2 stages of a :class:`Net` under "16-mixed" (SGD with momentum, no clipping), in
    which stage 0's ``embed.weight`` gets an infinite gradient at step ``poisoned`` only; per step: the loss
    scale before it and whether this rank's weights changed. ``agree=False`` swaps in torch's plain
    ``GradScaler`` (each rank checks only its own stage's gradients). With ``agree``, the scaler's state is
    then saved, overwritten and loaded back: ``resumed_scale``."""
    from trainscale.runtime.runtime import Runtime

    rt = Runtime(accelerator="cpu", devices="auto", strategy="pp", precision="16-mixed", timeout=60,
                 pp_split_points=["layers.2"], pp_microbatches=2)
    if not agree:
        rt.precision.scaler = torch.amp.GradScaler("cpu")
    torch.manual_seed(0)
    model = Net()
    module, optimizer = rt.setup(model, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    poison = [False]
    if model.embed is not None:  # stage 0
        model.embed.weight.register_hook(lambda g: torch.full_like(g, float("inf")) if poison[0] else g)
    x, y = next(iter(net_loaders(16, 16, 0)[0]))
    out = []
    for step in range(steps):
        poison[0] = step == poisoned
        before, scale = [p.detach().clone() for p in model.parameters()], rt.precision.scaler.get_scale()
        loss = rt.forward_backward(module, (x, y), torch.nn.functional.cross_entropy)
        rt.step(optimizer)
        optimizer.zero_grad()
        out.append({"scale": scale, "loss": float(loss),
                    "changed": any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))})
    result = {"steps": out, "scale": rt.precision.scaler.get_scale()}
    if agree:
        rt.save(f"{root}/ckpt", {"model": module, "optimizer": optimizer})
        rt.precision.scaler.update(new_scale=1.0)
        rt.load(f"{root}/ckpt", {"model": module, "optimizer": optimizer})
        result["resumed_scale"] = rt.precision.scaler.get_scale()
    return result


def pp_fp16_runs(rank: int, root: str, steps: int) -> dict:
    """On 2 ranks: 2 stages of a :class:`Net` cut at ``layers.2`` under "16-mixed" (the Trainer, clipping at
    0.5), then :func:`planted_inf` with trainscale's scaler and with torch's plain one; one process group."""
    return {"fit": fit_gpt(rank, f"{root}/fit", "pp", steps=steps, val=16, batch_size=16, net=True,
                           pp_split_points=["layers.2"], precision="16-mixed"),
            "agreed": planted_inf(rank, f"{root}/agreed", agree=True),
            "plain": planted_inf(rank, f"{root}/plain", agree=False)}


def fit_then_evaluate(rank: int, root: str, strategy: str) -> dict:
    """Fit a GPT for one epoch of 2 steps, then validate the same model object, with its own weights and with
    ckpt_path="last", on the same Trainer (the model was sharded or cut by the fit: set up once, reused)."""
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", strategy=strategy, max_epochs=1, seed=0, timeout=60,
                      default_root_dir=root, enable_progress_bar=False, logger=False)
    torch.manual_seed(0)
    model = GPT(PP_CONFIG)
    train_loader, val_loader = text_loaders(8, 16, 16)
    summary = trainer.fit(model, train_loader, val_loader, loss_fn=lm_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    return {"fit": summary["val_loss"], "validate": trainer.validate(model, val_loader, loss_fn=lm_loss)[0]["val_loss"],
            "last": trainer.validate(model, val_loader, loss_fn=lm_loss, ckpt_path="last")[0]["val_loss"]}


def plan_errors(rank: int, root: str) -> dict:
    """On 2 ranks, on the process group of the runs before it: a :class:`Net` under pp with a split point that
    leaves the first stage empty, under pp with ``pp_microbatches`` above the batch, and under tp=2 with a plan
    whose head returns each rank's slice of the logits; each case's error message (``"none"`` if a case trained)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from trainscale.loop.trainer import Trainer

    cases = {"empty_stage": dict(strategy="pp", pp_split_points=["embed"]),
             "microbatches": dict(strategy="pp", pp_split_points=["layers.2"], pp_microbatches=8),
             "sharded_output": dict(strategy="tp", tp_plan={**net_plan(), "head": ColwiseParallel()})}
    out = {}
    for name, flags in cases.items():
        trainer = Trainer(accelerator="cpu", devices=2, max_steps=1, default_root_dir=f"{root}/{name}", logger=False,
                          enable_progress_bar=False, timeout=60, **flags)
        try:
            trainer.fit(Net(), net_loaders(batch_size=4, train=8, val=0)[0], loss_fn=nn.functional.cross_entropy,
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
            out[name] = "none"
        except ValueError as error:
            out[name] = str(error)
    return out
