"""trainscale's GPU time model against published training throughput nobody here measured.

    PYTHONPATH=src python benchmarks/published.py            # the accuracy table (about 25 s of CPU)
    PYTHONPATH=src python benchmarks/published.py --json out.json

Each row gives the source, the hardware, the model and its configuration as published, and trainscale's prediction
(an interval from the constants' ranges, :mod:`trainscale.plan.efficiency`, and its middle) with the error of the
middle, and for the torchtitan rows the memory per GPU against the published one. Models are built from their
published configurations on the meta device and traced on fake tensors (nothing downloads, nothing is allocated):
Llama 3.1 from transformers' ``LlamaConfig`` (one decoder layer traced with each tensor-parallel rank's shapes, times
the number of layers, plus the embedding, output projection and loss traced once: the layers are identical, so this
is the whole step at the cost of one layer; rows of one model and shapes share the trace), ResNet-50 v1.5 from
``trainscale.models.resnet``. What a published table leaves out is read from the code of the commit it names (see
:func:`_titan`). Nothing here is fitted to these rows.

Not modelled (each row that uses one says so): asynchronous tensor parallelism (AsyncTP: its collectives are taken as
blocking), the data loader (NVIDIA's runs use DALI). Memory is the caching allocator's peak reserved bytes, as
torchtitan publishes it (:func:`llama_memory`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from trainscale.plan import cluster as cl  # noqa: E402
from trainscale.plan import gpu_time, hardware  # noqa: E402
from trainscale.plan.op_trace import OpLog  # noqa: E402

TORCHTITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
ASYNC_TP = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
TRAINY = "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
DLE = "NVIDIA/DeepLearningExamples PyTorch/Classification/ConvNets/resnet50v1.5/README.md"
# Llama 3.1 (Meta's model cards; torchtitan's llama3 model args): hidden, layers, heads, kv heads, ffn hidden
LLAMA = {"8B": (4096, 32, 32, 8, 14336), "70B": (8192, 80, 64, 8, 28672), "405B": (16384, 126, 128, 8, 53248)}
VOCAB = 128256
ERROR_BOUND = 0.40  # |error| a row may have outside its interval: what the model reaches (docs/plan.md)
MEDIAN_BOUND = 0.20  # median |error| of throughput over the rows: the bound aimed at
MEMORY_BOUND = 0.10  # |error| of a predicted memory against a published one: what the model reaches (docs/plan.md)


@dataclass(frozen=True)
class Row:
    """One published result: ``source``, ``table`` (where in it), ``hardware``, ``model``, ``config`` (as published),
    ``unit``, ``published`` (per GPU), ``published_memory_gib`` (None: not published), and what the prediction
    needs (``spec``)."""

    source: str
    table: str
    hardware: str
    model: str
    config: str
    unit: str
    published: float
    published_memory_gib: float | None
    spec: dict


_H100 = "H100 96GB HBM2e 500 W (8 per host, NVLink; 400 Gb/s RDMA per GPU)"
_GPU = {"h100-hbm2e-500w": _H100, "h200": "H200 SXM 141GB (8 per host, NVLink; 400 Gb/s RDMA per GPU)"}


def _titan(table, model, gpus, layout, batch, ac, compile_, float8, published, memory, note="", *, source=TORCHTITAN,
           gpu="h100-hbm2e-500w", seq=8192, fsdp_float8=False):
    """A torchtitan run. Not published in its table, taken from torchtitan's code at the run's commit: AdamW, bf16
    parameters with fp32 gradient reduction, selective AC's per-op policy, pp's micro-batches (the pp degree), the
    loss compiled with the model from 2025 (``torchtitan/components/loss.py``; the December 2024 commit has it
    commented out: "compiling loss function causes CUDA errors")."""
    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    parts = [f"FSDP {layout['dp_shard']}"] + [f"TP {tp}"] * (tp > 1) + \
        [f"PP {pp} (1F1B, {layout.get('microbatches', 1)} micro-batches)"] * (pp > 1)
    config = (f"{' × '.join(parts)}, local batch {batch}, seq {seq}, bf16, {ac} AC"
              + ", torch.compile" * compile_ + ", Float8" * float8 + " (FSDP float8 all-gather)" * fsdp_float8 + note)
    return Row(source, table, f"{gpus} × {_GPU[gpu]}", f"Llama 3.1 {model}", config, "tokens/s/GPU", published,
               memory, {"kind": "llama", "size": model, "nodes": gpus // 8, "layout": layout, "batch": batch,
                        "seq": seq, "recompute": ac, "compile": compile_, "float8": float8, "gpu": gpu,
                        "fsdp_float8": fsdp_float8, "compiled_loss": compile_ and source != TORCHTITAN})


def _dle(precision, gpus, published):
    """A row of NVIDIA's table; the configuration of ``PyTorch/Classification/ConvNets/configs.yml`` (DGXA100: batch
    256 for both, AMP with ``memory_format: nhwc`` and a static loss scale, TF32 in PyTorch's default NCHW; SGD with
    momentum 0.875, label smoothing 0.1)."""
    name = "TF32, NCHW" if precision == "32-true" else "AMP (fp16), NHWC"
    return Row(DLE, "Training performance: NVIDIA DGX A100 (8x A100 80GB)", f"{gpus} × A100 80GB SXM (DGX A100)",
               "ResNet-50 v1.5", f"{name}, batch 256 per GPU, DDP, SGD with momentum, 224 × 224", "images/s (all GPUs)",
               published, None, {"kind": "resnet", "precision": precision, "gpus": gpus, "batch": 256,
                                 "channels_last": precision != "32-true"})


ROWS = [
    _titan("Table 1", "8B", 8, {"dp_shard": 8}, 2, "selective", False, False, 5762, 82.4),
    _titan("Table 1", "8B", 8, {"dp_shard": 8}, 2, "selective", True, False, 6667, 77.0),
    _titan("Table 1", "8B", 8, {"dp_shard": 8}, 2, "selective", True, True, 8532, 76.8),
    _titan("Table 2", "8B", 8, {"dp_shard": 8}, 1, "full", True, True, 3890, 83.9, ", CP 1", seq=32768),
    _titan("Table 3", "8B", 128, {"dp_shard": 128}, 2, "selective", False, False, 5605, 67.0),
    _titan("Table 3", "8B", 128, {"dp_shard": 128}, 2, "selective", True, False, 6514, 62.0),
    _titan("Table 3", "8B", 128, {"dp_shard": 128}, 2, "selective", True, True, 8380, 61.8),
    _titan("Table 4", "70B", 256, {"dp_shard": 32, "tp": 8}, 16, "full", True, True, 829, 71.9),
    _titan("Table 5", "405B", 512, {"dp_shard": 8, "tp": 8, "pp": 8, "microbatches": 8}, 32, "full", True, True,
           100, 82.5, ", AsyncTP (not modelled)"),
    _titan("70B, vanilla TP", "70B", 256, {"dp_shard": 32, "tp": 8}, 16, "full", True, False, 597.3, None,
           source=ASYNC_TP),
    _titan("70B, vanilla TP", "70B", 256, {"dp_shard": 32, "tp": 8}, 16, "full", True, True, 809.8, None,
           " (tensorwise)", source=ASYNC_TP),
    _titan("8B, vanilla TP", "8B", 64, {"dp_shard": 8, "tp": 8}, 12, "selective", True, False, 4378, None,
           source=ASYNC_TP),
    _titan("8B, vanilla TP", "8B", 64, {"dp_shard": 8, "tp": 8}, 12, "selective", True, True, 5078.1, None,
           " (tensorwise)", source=ASYNC_TP),
    _titan("4 nodes", "8B", 32, {"dp_shard": 32}, 2, "selective", True, True, 10938, 47.96, source=TRAINY,
           gpu="h200", fsdp_float8=True),
    _titan("8 nodes", "8B", 64, {"dp_shard": 64}, 2, "selective", True, True, 10753, 46.97, source=TRAINY,
           gpu="h200", fsdp_float8=True),
    _dle("32-true", 1, 938), _dle("32-true", 8, 7248), _dle("16-mixed", 1, 2470), _dle("16-mixed", 8, 16621),
]


# -- Llama 3.1: one decoder layer per tp rank, and the embedding, output projection and loss ----------------------
def _llama_config(size: str, tp: int, seq: int):
    from transformers import LlamaConfig

    hidden, layers, heads, kv, ffn = LLAMA[size]
    return LlamaConfig(hidden_size=hidden, intermediate_size=ffn // tp, num_attention_heads=heads // tp,
                       num_key_value_heads=max(1, kv // tp), head_dim=hidden // heads, num_hidden_layers=layers,
                       vocab_size=VOCAB, rope_theta=500000.0, max_position_embeddings=seq, attn_implementation="sdpa")


def _meta(build, dtype):
    """A module built on the meta device in ``dtype`` (given fake storage by ``to_empty`` inside FakeTensorMode)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            module = build()
    finally:
        torch.set_default_dtype(default)
    return module


@functools.lru_cache(maxsize=None)  # rows of one model and shapes share the trace (not to be mutated)
def llama_ops(size: str, tp: int, micro: int, seq: int) -> dict:
    """Traced operators of one decoder layer (per tp rank, forward and backward), of the outer parts (embedding, final
    norm, output projection, fp32 cross-entropy as torchtitan computes it), and of AdamW's step over one layer's
    fp32 parameters; and the parameter counts."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    config = _llama_config(size, tp, seq)
    hidden = config.hidden_size
    layer_meta, master_meta = (_meta(lambda: LlamaDecoderLayer(config, 0), d) for d in (torch.bfloat16, torch.float32))
    outer_meta = _meta(lambda: torch.nn.ModuleDict({
        "embed": torch.nn.Embedding(VOCAB // tp, hidden), "norm": LlamaRMSNorm(hidden),
        "head": torch.nn.Linear(hidden, VOCAB // tp, bias=False)}), torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer = layer_meta.to_empty(device="cpu")
        rotary = LlamaRotaryEmbedding(config)
        x = torch.empty(micro, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(seq)[None]
        with OpLog() as layer_log:
            y = layer(x, position_embeddings=rotary(x, positions), position_ids=positions)
            y = y[0] if isinstance(y, tuple) else y
            layer_log.phase = "backward"
            y.backward(torch.empty_like(y))
        outer = outer_meta.to_empty(device="cpu")
        tokens = torch.zeros(micro, seq, dtype=torch.int64)
        with OpLog() as outer_log:
            logits = outer["head"](outer["norm"](outer["embed"](tokens)))
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
            outer_log.phase = "backward"
            loss.backward()
        master = master_meta.to_empty(device="cpu")
        for p in master.parameters():
            p.grad = torch.empty_like(p)
        optimizer = torch.optim.AdamW(master.parameters(), lr=3e-4, foreach=True)
        optimizer.step()  # creates the state
        with OpLog() as opt_log:
            opt_log.phase = "optimizer"
            optimizer.step()
    layer_params = sum(p.numel() for p in layer.parameters())
    outer_params = sum(p.numel() for p in outer.parameters())
    return {"layer": layer_log.ops, "outer": outer_log.ops, "optimizer": opt_log.ops, "layer_params": layer_params,
            "outer_params": outer_params, "layers": config.num_hidden_layers, "hidden": hidden}


def predict_llama(spec: dict) -> dict:
    """Tokens/s per GPU in each scenario (torchtitan's TPS/GPU: a data-parallel rank's tokens per second over its
    tp × pp GPUs), the middle's step breakdown and MFU against the H100 SXM's 989 TFLOP/s (torchtitan's own MFU
    peak, :func:`titan_flops_per_token`), and the memory per GPU (:func:`llama_memory`)."""
    lay = cl.Layout(**spec["layout"])
    micro = spec["batch"] // lay.microbatches
    ops = llama_ops(spec["size"], lay.tp, micro, spec["seq"])
    gpu = hardware.gpu(spec["gpu"])
    cluster = hardware.cluster(gpu, spec["nodes"], 8, "ib-400" if spec["nodes"] > 1 else None)
    shard = lay.dp_shard
    out = {}
    for s in gpu_time.SCENARIOS:
        layer = gpu_time.phases(ops["layer"], gpu, s, compile=spec["compile"], float8=spec["float8"],
                                recompute=spec["recompute"], weights_fp8=spec["fsdp_float8"])
        outer = gpu_time.phases(ops["outer"], gpu, s, compile=spec["compiled_loss"])
        per_layer_opt = gpu_time.phases(ops["optimizer"], gpu, s).optimizer_s
        params_here = ops["layers"] / lay.pp * ops["layer_params"] + ops["outer_params"]
        optimizer_s = per_layer_opt * params_here / ops["layer_params"] / shard
        work = cl.Transformer(layer, outer, optimizer_s, ops["layers"], ops["layer_params"],
                              micro * spec["seq"] * ops["hidden"] * 2, spec["recompute"],
                              gather_bytes=1.0 if spec["fsdp_float8"] else 2.0,
                              tp_gather_fraction=0.5 if spec["float8"] else 1.0, outer_params=ops["outer_params"])
        parts = cl.transformer_step(work, lay, cluster, s)
        out[s] = spec["batch"] * spec["seq"] / parts["step_s"] / (lay.tp * lay.pp)
        if s == "mid":
            out["parts"] = parts
    out["mfu"] = out["mid"] * titan_flops_per_token(spec["size"], spec["seq"]) / 989e12
    out["memory"] = llama_memory(spec, ops, lay)
    return out


@functools.lru_cache(maxsize=None)
def loss_ops(size: str, tp: int, micro: int, seq: int, compiled: bool = False) -> list:
    """Traced operators (memory only) of a torchtitan step's end on the last pipeline stage, forward then backward, as
    its code at the published commit runs it: the final norm on this rank's sequence shard (tensor parallelism's
    ``SequenceParallel``), its output gathered to the whole sequence (``ColwiseParallel(input_layouts=Shard(1))``: a
    copy stands for the all-gather's output), the output projection on this rank's vocabulary shard, the logits cast
    to fp32 (``loss_fn``: ``cross_entropy(pred.flatten(0, 1).float(), labels)``) and the cross-entropy: aten's under
    one rank, under tp the loss-parallel one (``torch.distributed.tensor.parallel.loss``: its ``_log_softmax``, which
    keeps the shifted logits and their exponential besides its result, and ``_nll_loss_and_log_softmax_backward``,
    which builds the gradient from a zeroed tensor and the exponential of the saved result; run on a fake process
    group). The bf16 logits (``pred``) are held until the loss is computed (train.py's ``del pred`` comes after
    ``loss_fn``), and so is their fp32 copy, an argument of ``cross_entropy``: a last forward operator reads them.
    A ``compiled`` loss (torchtitan compiles it from 2025) is partitioned as torch.compile's Inductor backend does it
    (AOTAutograd with Inductor's decompositions and the min-cut partitioner, which saves the bf16 logits and two
    values per token and recomputes the softmax in backward), its graphs traced operator by operator and costed as
    Inductor's kernels (:func:`trainscale.plan.op_trace.fused`); under tp the loss-parallel operators are fused
    instead (a DTensor graph is not partitioned here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from trainscale.plan import memory
    from trainscale.plan.op_trace import Op, fused

    hidden = LLAMA[size][0]
    outer_meta = _meta(lambda: torch.nn.ModuleDict({"norm": LlamaRMSNorm(hidden),
                                                    "head": torch.nn.Linear(hidden, VOCAB // tp, bias=False)}),
                       torch.bfloat16)
    group = memory.fake_process_group(tp, 0) if tp > 1 else contextlib.nullcontext()
    with group:
        mesh = memory._mesh(tp) if tp > 1 else None
        with FakeTensorMode(allow_non_fake_inputs=True):
            outer = outer_meta.to_empty(device="cpu")
            tokens = torch.zeros(micro * seq, dtype=torch.int64)
            partitioned = _inductor_partitioned(_titan_loss, (micro, seq, VOCAB), tokens) if compiled and tp == 1 else None
            with OpLog() as log:
                last = torch.zeros(micro, seq // tp, hidden, dtype=torch.bfloat16, requires_grad=True)  # last layer's
                gathered = outer["norm"](last)
                gathered = gathered.repeat(1, tp, 1) if tp > 1 else gathered
                pred = outer["head"](gathered)
                if partitioned is not None:
                    loss, held = partitioned(pred, tokens), (pred,)
                else:
                    logits = pred.flatten(0, 1).float()
                    loss = (_LossParallel.apply(logits, tokens, mesh, (micro * seq, VOCAB), log) if tp > 1
                            else F.cross_entropy(logits, tokens))
                    held = (pred, logits)
                held = tuple((t.untyped_storage()._cdata, t.nbytes) for t in held)
                log.ops.append(Op("del pred", "memory", 0.0, 0.0, "bf16", None, "forward", held))
                log.phase = "backward"
                loss.backward()
    return fused(log.ops) if compiled else log.ops


def _titan_loss(pred, labels):
    """torchtitan's ``loss_fn`` (labels already flat)."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels)


def _inductor_partitioned(fn, shape: tuple, labels):
    """``fn(pred, labels)`` split into a forward and a backward graph as torch.compile's Inductor backend splits it
    (``torch._inductor.compile_fx``: AOTAutograd with ``select_decomp_table()`` and
    ``min_cut_rematerialization_partition``), the graphs run as they are; traced once on bf16 ``pred`` of ``shape``
    (inside ``FakeTensorMode``) so that a later call only runs them."""
    from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    run = aot_function(fn, fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=lambda gm, _: make_boxed_func(gm),
                       partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
    run(torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True), labels).backward()
    return run


class _LossParallel(torch.autograd.Function):
    """``cross_entropy`` of vocabulary-sharded logits by torch's loss-parallel functions (the local computation that
    ``loss_parallel()``'s DTensor handlers run), for :func:`loss_ops`' trace. Autograd holds the saved result until
    the backward returns: a last operator of the backward reads it."""

    @staticmethod
    def forward(ctx, logits, target, mesh, shape, log):
        from torch.distributed.tensor.parallel import loss as lp

        result = lp._log_softmax(logits, 1, False, mesh, 0)
        loss, total_weight = lp._nll_loss_forward(result, target, None, None, 1, -100, torch.Size(shape), 1, mesh, 0)
        ctx.save_for_backward(result, target, total_weight)
        ctx.mesh, ctx.shape, ctx.log = mesh, shape, log
        return loss

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor.parallel import loss as lp

        from trainscale.plan.op_trace import Op

        result, target, total_weight = ctx.saved_tensors
        grad = lp._nll_loss_and_log_softmax_backward(grad, result, target, None, 1, -100, total_weight,
                                                     torch.Size(ctx.shape), 1, ctx.mesh, 0)
        saved = ((result.untyped_storage()._cdata, result.nbytes),)
        ctx.log.ops.append(Op("saved result released", "memory", 0.0, 0.0, "fp32", None, "backward", saved))
        return grad, None, None, None, None


def _1f1b_order(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """``[("F" or "B", micro-batch), ...]``: the order stage ``stage`` runs its forwards and backwards under 1F1B
    (torch's ``Schedule1F1B``: ``min(microbatches, stages - stage)`` forwards, then one backward and one forward in
    turn, then the remaining backwards)."""
    warmup = min(microbatches, stages - stage)
    order = [("F", m) for m in range(warmup)]
    for m in range(microbatches - warmup):
        order += [("B", m), ("F", warmup + m)]
    return order + [("B", m) for m in range(microbatches - warmup, microbatches)]


def _compute_events(spec: dict, ops: dict, lay, stage: int, layers: int) -> list[tuple]:
    """Allocator events (:mod:`trainscale.plan.allocator`) of the default stream of pipeline stage ``stage`` in one
    step: per micro-batch and layer, the layer's input (sequence-sharded under tp; the first layer's is the embedding's
    output) and its forward's tensors, of which what the checkpoint policy saves is held until that layer's backward;
    on the last stage the loss (:func:`loss_ops`); then each layer's backward, the recomputed forward included
    (the traced layer, Inductor's kernels under torch.compile). Under pp, the fp32 gradients FSDP2 accumulates unsharded
    across micro-batches (``MixedPrecisionPolicy(reduce_dtype=float32)`` with gradient sync off until the last
    micro-batch, as torch's pipelining stage sets it) appear after each layer's first backward."""
    from trainscale.plan.op_trace import allocation_events, fused, saved_storages

    layer = fused(ops["layer"]) if spec["compile"] else ops["layer"]
    forward = [op for op in layer if op.phase == "forward"]
    saved = set(saved_storages(ops["layer"], spec["recompute"]))
    micro = spec["batch"] // lay.microbatches
    act = micro * spec["seq"] * ops["hidden"] * 2 // lay.tp
    layer_forward = allocation_events(forward, held=saved)  # each traced once, tagged per layer and micro-batch
    layer_backward = allocation_events(layer, skip=saved)
    last = stage == lay.pp - 1
    loss = allocation_events(loss_ops(spec["size"], lay.tp, micro, spec["seq"], spec["compiled_loss"])) if last else []
    events: list[tuple] = []
    accumulated = set()
    for kind, m in _1f1b_order(stage, lay.pp, lay.microbatches):
        if kind == "F":
            for i in range(layers):
                events.append(("malloc", ("input", m, i), act))
                events += _tagged(layer_forward, ("layer", m, i))
            events += _tagged(loss, ("loss", m))
            continue
        for i in reversed(range(layers)):
            events += _tagged(layer_backward, ("backward", m, i))
            events += [("free", (("layer", m, i), key)) for key in saved]
            events.append(("free", ("input", m, i)))
            if lay.pp > 1 and i not in accumulated:
                accumulated.add(i)
                events.append(("malloc", ("accumulated", i), 4 * ops["layer_params"]))
    return events


def _tagged(events: list[tuple], tag) -> list[tuple]:
    """``events`` of one traced region (keys ``(None, storage)``) as those of its instance ``tag``."""
    return [(kind, (tag, key[1]), *rest) for kind, key, *rest in events]


@functools.lru_cache(maxsize=None)  # rows that differ only in what the default stream does not hold share it
def _compute_pool(size: str, tp: int, pp: int, microbatches: int, batch: int, seq: int, recompute: str,
                  compile_: bool, compiled_loss: bool, stage: int, layers: int) -> tuple[int, int]:
    """``(peak reserved, peak allocated)`` bytes of :func:`_compute_events` replayed by the caching allocator."""
    from trainscale.plan.allocator import replay

    spec = {"size": size, "batch": batch, "seq": seq, "recompute": recompute, "compile": compile_,
            "compiled_loss": compiled_loss}
    lay = cl.Layout(tp=tp, pp=pp, microbatches=microbatches)
    pool = replay(_compute_events(spec, llama_ops(size, tp, batch // microbatches, seq), lay, stage, layers))
    return pool.peak_reserved, pool.peak_allocated


def llama_memory(spec: dict, ops: dict, lay) -> dict:
    """Bytes reserved at the peak on the busiest GPU of a torchtitan run (torchtitan logs the caching allocator's peak
    reserved memory, ``max_reserved_gib``), by part (see docs/plan.md):

    - ``states``: fp32 parameters, gradients and AdamW's two moments of this GPU's FSDP shard (16 bytes per
      parameter: torchtitan keeps fp32 parameters and casts to bf16 in FSDP's all-gather; the sharded gradients are the
      reduce-scatter's outputs, which FSDP2 allocates on its reduce-scatter stream, so their blocks stay reserved in
      that stream's pool between steps);
    - ``unsharded``: bf16 parameters gathered at once: the root unit (embedding, norm, output projection; FSDP2 does
      not reshard the root after forward) and two layers (the one running and the one prefetched; fp8 under FSDP's
      float8 all-gather), with one layer's
      bf16 gradients and their fp32 reduce-scatter input; under pp every layer of the stage (torchtitan:
      ``reshard_after_forward=False``), whose fp32 gradients are in ``compute``;
    - ``compute``: the default stream's pool, replayed through the caching allocator's rules
      (:func:`_compute_events`, :mod:`trainscale.plan.allocator`); ``compute_allocated`` is its peak of live bytes.

    Under pp every stage is predicted and the largest total kept (torchtitan reports the maximum over GPUs): stage
    ``s`` holds :func:`stage_layers` layers and ``min(microbatches, pp - s)`` micro-batches in flight; the first holds
    the embedding, the last the final norm and output projection (each half the root unit's parameters)."""
    layer_p, pp = ops["layer_params"], lay.pp
    best: dict = {}
    for stage, layers in enumerate(stage_layers(ops["layers"], pp)):
        outer_p = ops["outer_params"] if pp == 1 else ops["outer_params"] / 2 * (stage in (0, pp - 1))
        states = 16 * (layers * layer_p + outer_p) / lay.dp_shard
        if pp > 1:
            unsharded = 2 * (layers * layer_p + outer_p)
        else:  # gathered layers in fp8 (1 byte) under FSDP's float8 all-gather (torchao's Float8TrainingTensor)
            unsharded = 2 * outer_p + 2 * (1 if spec["fsdp_float8"] else 2) * layer_p + (2 + 4) * layer_p
        reserved, allocated = _compute_pool(spec["size"], lay.tp, pp, lay.microbatches, spec["batch"], spec["seq"],
                                            spec["recompute"], spec["compile"], spec["compiled_loss"], stage, layers)
        parts = {"states": states, "unsharded": unsharded, "compute": reserved}
        if sum(parts.values()) > best.get("total", -1):
            best = {**parts, "compute_allocated": allocated, "total": sum(parts.values()), "stage": stage}
    return best


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage as torchtitan splits them when no split points are given (its
    ``generate_split_points`` at the published commit, one stage per rank): ``layers // pp`` on the first stage, one
    more on each middle stage while the remainder lasts, the rest on the last."""
    base, extra = divmod(layers, pp)
    middle = [base + (i < extra) for i in range(pp - 2)]
    return [layers] if pp == 1 else [base, *middle, layers - base - sum(middle)]


def titan_flops_per_token(size: str, seq: int) -> float:
    """torchtitan's FLOPs per token, ``6·N + 12·L·H·T`` (N: the parameters less the token embedding, the output
    projection included; L layers, H hidden, T the sequence length): what its MFU divides by 989 TFLOP/s."""
    hidden, layers, heads, kv, ffn = LLAMA[size]
    head_dim = hidden // heads
    per_layer = hidden * (hidden + 2 * kv * head_dim) + hidden * hidden + 3 * hidden * ffn + 2 * hidden
    params = layers * per_layer + hidden + hidden * VOCAB
    return 6 * params + 12 * layers * hidden * seq


@functools.lru_cache(maxsize=None)
def resnet_ops(precision: str, batch: int) -> tuple:
    """Traced operators of one ResNet-50 v1.5 step on one GPU (SGD with momentum, label smoothing 0.1, as NVIDIA's
    recipe) and the gradients' bytes (fp32)."""
    from trainscale.models.resnet import ResNet50
    from trainscale.plan import memory

    meta = memory.build_meta_model(ResNet50)
    sample = (torch.empty(3, 224, 224, device="meta"), torch.empty((), dtype=torch.int64, device="meta"))
    ops = gpu_time.trace_step(meta, sample, batch, lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1),
                              lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.875, foreach=True), precision)
    return ops, 4 * sum(p.numel() for p in meta.parameters())


def predict_resnet(spec: dict) -> dict:
    """Images/s of all GPUs in each scenario: one GPU's traced step and DDP's bucketed all-reduce over NVLink."""
    ops, grad_bytes = resnet_ops(spec["precision"], spec["batch"])
    gpu = hardware.gpu("a100-80gb")
    cluster = hardware.cluster(gpu, 1, 8)
    out = {}
    for s in gpu_time.SCENARIOS:
        phases = gpu_time.phases(ops, gpu, s, channels_last=spec["channels_last"])
        parts = cl.ddp_step(phases, grad_bytes, spec["gpus"], cluster, s)
        out[s] = spec["batch"] * spec["gpus"] / parts["step_s"]
        if s == "mid":
            out["parts"] = parts
    return out


def predict(row: Row) -> dict:
    return predict_llama(row.spec) if row.spec["kind"] == "llama" else predict_resnet(row.spec)


def evaluate(rows: list[Row] = ROWS) -> list[dict]:
    """Each row with its prediction: ``low``/``mid``/``high`` (per GPU as published), ``error`` of the middle
    ((predicted − published) / published), ``inside`` (the published value within [low, high])."""
    out = []
    for row in rows:
        p = predict(row)
        low, high = p["slow"], p["fast"]
        memory = p.get("memory", {}).get("total")
        gib = memory / 2**30 if memory else None
        out.append({**asdict(row), "low": low, "mid": p["mid"], "high": high, "error": p["mid"] / row.published - 1,
                    "inside": low <= row.published <= high, "mfu": p.get("mfu"),
                    "parts": {k: round(v, 4) for k, v in p["parts"].items()}, "memory_gib": gib,
                    "memory_error": gib / row.published_memory_gib - 1 if gib and row.published_memory_gib else None,
                    "memory_parts": {k: v if k == "stage" else round(v / 2**30, 2)
                                     for k, v in p.get("memory", {}).items()}})
    return out


def median_abs_error(results: list[dict]) -> float:
    return statistics.median(abs(r["error"]) for r in results)


_SHORT = {TORCHTITAN: "torchtitan llama3_h100_202412", ASYNC_TP: "torchtitan asyncTP_llama3_h100_2025-06",
          TRAINY: "torchtitan llama3-8b_h200_202506", DLE: "DeepLearningExamples ResNet-50 v1.5"}


def memory_errors(results: list[dict]) -> list[float]:
    """The memory errors of the rows that publish a memory figure."""
    return [r["memory_error"] for r in results if r["memory_error"] is not None]


def _memory_cell(r: dict) -> str:
    if r["memory_gib"] is None:
        return "—"
    published = f"{r['published_memory_gib']:.1f} / " if r["published_memory_gib"] else "— / "
    error = f" ({r['memory_error']:+.0%})" if r["memory_error"] is not None else ""
    return f"{published}{r['memory_gib']:.1f}{error}"


def format_table(results: list[dict]) -> str:
    lines = ["| source | hardware | model | configuration | published | predicted (interval) | error | MFU | "
             "memory GiB: published / predicted |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        mfu = f"{r['mfu']:.0%}" if r["mfu"] else "—"
        lines.append(f"| {_SHORT[r['source']]} {r['table']} | {r['hardware']} | {r['model']} | {r['config']} | "
                     f"{r['published']:,.0f} {r['unit']} | {r['mid']:,.0f} ({r['low']:,.0f}–{r['high']:,.0f}) | "
                     f"{r['error']:+.0%}{'' if r['inside'] else ' (outside)'} | {mfu} | {_memory_cell(r)} |")
    memory = memory_errors(results)
    lines.append(f"\nMedian absolute error over {len(results)} rows: {median_abs_error(results):.1%}; "
                 f"{sum(r['inside'] for r in results)} of {len(results)} published values inside the interval. "
                 f"Memory: {sum(abs(e) <= 0.10 for e in memory)} of {len(memory)} published figures within 10 %, "
                 f"median absolute error {statistics.median(abs(e) for e in memory):.1%}.")
    return "\n".join(lines)


MEMORY_TERMS = (
    "published figure: the caching allocator's peak reserved bytes (torchtitan's train.py logs max_reserved_gib, "
    "torch.cuda.memory_stats()['reserved_bytes.all.peak'], at the commits the tables name)",
    "states: 16 bytes per parameter of the FSDP shard (fp32 parameter, gradient, AdamW's exp_avg and exp_avg_sq); "
    "the gradients are FSDP2's reduce-scatter outputs, allocated on its reduce-scatter stream "
    "(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce), whose pool keeps their blocks between "
    "steps",
    "unsharded: bf16 parameters gathered at once: the root unit (FSDP2 does not reshard the root after forward), two "
    "layers (running, prefetched; fp8 under FSDP's float8 all-gather), one layer's bf16 gradients and fp32 "
    "reduce-scatter input; under pp every layer of the stage (torchtitan: reshard_after_forward=False)",
    "compute: the default stream's allocations of one step replayed by the caching allocator's rules "
    "(trainscale.plan.allocator, after c10/cuda/CUDACachingAllocator.cpp); each tensor from its write to its last read "
    "unless held longer (pred until the loss returns, autograd's saved tensors until their backward)",
    "activations: each layer's input (sequence-sharded under tp) and what the checkpoint policy saves, per micro-batch "
    "in flight (torch's Schedule1F1B order under pp)",
    "loss: the final norm on the sequence shard, its all-gathered output, the output projection on the vocabulary "
    "shard, the fp32 cast; aten's cross-entropy, under tp the loss-parallel one "
    "(torch/distributed/tensor/parallel/loss.py); a compiled loss partitioned as Inductor does (AOTAutograd, "
    "select_decomp_table, min_cut_rematerialization_partition) and fused",
    "pp: FSDP2 accumulates the stage's gradients unsharded in fp32 across micro-batches (reduce_dtype=float32 with "
    "gradient sync off until the last micro-batch, torch/distributed/pipelining/stage.py; _fsdp_param.py "
    "to_accumulated_grad_if_needed); every stage predicted, the largest kept, with torchtitan's layers per stage "
    "(generate_split_points) and Schedule1F1B's micro-batches in flight",
    "not modelled: tp's all-gather and reduce-scatter buffers inside a layer (the layer is traced with a tp rank's "
    "shapes, norms and residuals on the whole sequence), other streams' pools, Inductor's buffer reuse beyond fusion",
)


def format_memory(results: list[dict]) -> str:
    """The memory prediction of each row by part (GiB) and the terms it is made of, with their sources."""
    lines = ["Memory (GiB per GPU, reserved at the peak on the busiest GPU; compute's live bytes in brackets):"]
    for r in results:
        m = r["memory_parts"]
        if m:
            lines.append(f"- {_SHORT[r['source']]} {r['table']}, {r['model']}: states {m['states']:.1f} + unsharded "
                         f"{m['unsharded']:.1f} + compute {m['compute']:.1f} ({m['compute_allocated']:.1f}) = "
                         f"{m['total']:.1f}" + (f" (pipeline stage {m['stage']})" if r["spec"]["layout"].get("pp", 1) > 1
                                                else ""))
    return "\n".join(lines + ["Memory terms:"] + [f"- {t}" for t in MEMORY_TERMS])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    results = evaluate()
    print(format_table(results))
    from trainscale.plan import efficiency

    print("\nConstants (interval: the prediction's ends):")
    for c in efficiency.ALL:
        print(f"- {c}")
    print("\n" + format_memory(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
