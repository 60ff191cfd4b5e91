"""Pipeline stages in the plan: the peak memory of each stage, composed from one traced micro-batch and the
schedule, and the step time with the pipeline's bubble.

**Memory.** torch's ``PipelineStage`` does not run on fake tensors over a fake process group (its first step
votes on the stages' shapes with values a fake tensor does not have, and receives pickled metadata from the
other stages), so the stage's own module is traced directly: the model is cut as the pp strategy cuts it
(``pipeline.stage_units``, ``apply_pp.keep_stage``) on a fake copy, and one micro-batch's forward and backward
run under ``MemTracker`` (then, under a second tracker, the optimizer step) with the optimizer state present.
The schedule is then composed from torch 2.13's own implementation (``torch/distributed/pipelining``):

- in flight: when backward ``j`` of ``M`` micro-batches starts, the stage holds the activations of the
  micro-batches it has run forward and not yet backward: ``min(M, k + j) − j`` with ``k`` warm-up forwards,
  ``k = M`` under GPipe (all forwards first) and ``k = min(M, P − s)`` under 1F1B on stage ``s`` of ``P``
  (``Schedule1F1B._step_microbatches``: "Last stage has 1 warmup, second-to-last 2 warmups, ... first stage
  num_stages warmups", ``warmup_chunks = min(n_microbatches, num_stages - stage_index)``);
- receive buffers, allocated once per micro-batch and kept (``_setup_forward_recv_info``,
  ``_setup_backward_recv_info``): ``M`` input activations on every stage but the first, ``M`` output
  gradients on every stage but the last;
- the gradient of each received input (the buffer's ``.grad``, set by backward and cleared only at the next
  step, ``clear_runtime_states``) on every stage but the first: one more per finished backward;
- no output kept on the last stage: the runner's ``schedule.step(..., return_outputs=False)`` leaves
  ``output_chunks`` empty (the losses are all it reads);
- the whole batch (inputs and targets) on every stage, as the loop gives it to each.

The peak is the largest of: backward ``j`` (the traced forward-backward peak plus the other in-flight
activations and the earlier input gradients), the end of the step, and the optimizer step (its traced peak
plus what the step keeps). All in bytes, per stage (rank = stage).

**Time.** (M + P − 1) slots of the slowest stage's micro-batch compute: each stage works M slots and idles
P − 1 while the pipeline fills and drains, the bubble (P − 1)/(M + P − 1) of the step (Huang et al. 2019,
"GPipe", §2.2; 1F1B has the same bubble, Narayanan et al. 2021, §2.2), plus one point-to-point transfer of a
micro-batch's boundary activation (forward) and its gradient (backward) per slot boundary crossed
(:func:`step_s`).
"""

from __future__ import annotations

from typing import Callable

import torch

from trainscale.plan import comm
from trainscale.plan.memory import _fake_batch, _fake_copy, _fake_mode, meta_copy


def schedule_used(schedule: str, microbatches: int, stages: int) -> str:
    """The schedule a step runs: 1F1B needs M ≥ P micro-batches, else the runner falls back to GPipe
    (``apply_pp.PipelineRunner._schedule_for``)."""
    return "1f1b" if schedule == "1f1b" and microbatches >= stages else "gpipe"


def warmup(schedule: str, microbatches: int, stages: int, stage: int) -> int:
    """Forwards a stage runs before its first backward: GPipe all M; 1F1B ``min(M, P − s)`` (torch's
    ``Schedule1F1B._step_microbatches``, ``warmup_chunks``)."""
    if schedule_used(schedule, microbatches, stages) == "gpipe":
        return microbatches
    return min(microbatches, stages - stage)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _total(tracker, kind: str) -> int:
    """Bytes of a ``MemTracker`` snapshot ("current" or "peak"), all devices."""
    return int(sum(s["Total"] for s in tracker.get_tracker_snapshot(kind).values()))


def _stage_copy(meta, names: list, stage: int, precision: str, ac: tuple):
    """Inside ``FakeTensorMode``: stage ``stage`` of a fake copy of ``meta``, cut as the pp strategy cuts it
    (activation checkpointing applied to the whole model first, as the Runtime does before the strategy). The cut
    is made on a meta copy, so that only the stage's own parameters become fake tensors (making those of the whole
    model for every stage took most of a GPT plan's pp rows)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from trainscale.runtime.apply import apply_activation_checkpointing
    from trainscale.runtime.strategies.apply_pp import keep_stage

    with unset_fake_temporarily():
        cut = keep_stage(apply_activation_checkpointing(meta_copy(meta), ac), names[stage])
    return _fake_copy(cut, precision)


def boundaries(meta, sample: tuple, micro_batch: int, stages: int, precision: str = "32-true",
               split_points: list | None = None) -> list[tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of the activation each stage but the last sends on, for a micro-batch of ``micro_batch``
    samples: one forward of the stages in turn on fake tensors (``FakeTensorMode``: no memory, no compute), without
    autograd; ``stages - 1`` entries. :func:`estimate` computes them once for all its :func:`trace_stage` calls.

    Raises:
        ValueError: no split for a model that is not a GPT, bad split points (``pipeline.stage_units``).
    """
    from trainscale.runtime.precision import Precision
    from trainscale.runtime.strategies.pipeline import stage_units

    names = stage_units(meta, stages, split_points)
    prec = Precision(precision, "cpu")
    out = []
    with _fake_mode(), torch.no_grad():
        x = prec.convert_input(_fake_batch(sample, micro_batch))[0]
        for s in range(stages - 1):
            with prec.autocast():
                x = _stage_copy(meta, names, s, precision, ())(x)
            out.append((x.shape, x.dtype))
    return out


def _forward(model, x, target, last: bool, loss_fn, autocast) -> tuple:
    """One micro-batch's forward through the stage: ``(output, the root of backward)``: the loss on the last
    stage, else the output (backward from the received gradient)."""
    with autocast():
        out = model(x)
        return out, (loss_fn(out, target) if last else out)


def _traced_backward(model, optimizer, x, target, grad_out, loss_fn, autocast, keep: bool = False) -> tuple:
    """Forward and backward of one micro-batch under ``MemTracker`` (the stage's parameters, gradients and optimizer
    state counted, the received input and output gradient not: the composition counts those buffers); ``keep``:
    keep the gradients of an earlier micro-batch. Returns ``(peak, activations)`` (bytes)."""
    from trainscale.plan.trackers import PeakMemTracker

    if not keep:
        optimizer.zero_grad(set_to_none=True)
    x.grad = None  # the received input's gradient: one per micro-batch (counted by the composition)
    tracker = PeakMemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        before = _total(tracker, "current")
        out, root = _forward(model, x, target, grad_out is None, loss_fn, autocast)
        activations = _total(tracker, "current") - before
        root.backward(grad_out)
        del out, root
    return _total(tracker, "peak"), activations


def _empty(shape_dtype: tuple) -> torch.Tensor:
    shape, dtype = shape_dtype
    return torch.empty(shape, dtype=dtype)


def trace_stage(meta, sample: tuple, micro_batch: int, loss_fn: Callable, optimizer_fn: Callable, stages: int,
                stage: int, precision: str = "32-true", split_points: list | None = None, ac: tuple = (),
                sent: list | None = None) -> dict:
    """One micro-batch of ``micro_batch`` samples through stage ``stage`` of ``stages`` on fake tensors, with the
    optimizer state present (a first untracked step creates it), then a second micro-batch. Bytes: ``fb_first`` and
    ``fb_next``, the forward-backward peaks of the step's first micro-batch and of a later one, which finds the
    gradients allocated (parameters, gradients, optimizer state, activations, temporaries, the received input's
    gradient), ``activations`` (alive after forward that were not before it), ``opt_peak`` (the optimizer step's peak),
    ``rest`` (parameters, gradients, optimizer state and buffers before the optimizer step), ``input`` (the received
    activation; 0 on the first stage), ``output`` (the activation sent on; 0 on the last); and ``flops``, of the
    micro-batch's forward and backward (``torch.utils.flop_counter.FlopCounterMode``). ``sent``: the stages'
    :func:`boundaries` (computed here when not given; a plan of all stages computes them once).

    Raises:
        ValueError: no split for a model that is not a GPT, bad split points (``pipeline.stage_units``).
    """
    from torch.utils.flop_counter import FlopCounterMode

    from trainscale.plan.trackers import PeakMemTracker
    from trainscale.runtime.precision import Precision
    from trainscale.runtime.strategies.pipeline import stage_units

    names = stage_units(meta, stages, split_points)
    autocast, last = Precision(precision, "cpu").autocast, stage == stages - 1
    if sent is None:
        sent = boundaries(meta, sample, micro_batch, stages, precision, split_points)
    with _fake_mode():
        micro = Precision(precision, "cpu").convert_input(_fake_batch(sample, micro_batch))
        x = _empty(sent[stage - 1]).requires_grad_() if stage else micro[0]
        grad_out = None if last else _empty(sent[stage])
        model = _stage_copy(meta, names, stage, precision, tuple(ac or ()))
        optimizer = optimizer_fn(model.parameters())
        with FlopCounterMode(display=False) as flops:
            _forward(model, x, micro[1], last, loss_fn, autocast)[1].backward(grad_out)
        optimizer.step()  # the optimizer state now exists, as in a steady-state step
        first, activations = _traced_backward(model, optimizer, x, micro[1], grad_out, loss_fn, autocast)
        # the second micro-batch's backward finds the gradients of the first allocated
        following, _ = _traced_backward(model, optimizer, x, micro[1], grad_out, loss_fn, autocast, keep=True)
        step = PeakMemTracker()
        step.track_external(model, optimizer)
        rest = _total(step, "current")
        with step:
            optimizer.step()
    return {"fb_first": first, "fb_next": following, "activations": activations, "opt_peak": _total(step, "peak"),
            "rest": rest, "input": _nbytes([x]) if stage else 0, "output": 0 if last else _nbytes([grad_out]),
            "flops": flops.get_total_flops()}


def stage_peak(trace: dict, schedule: str, microbatches: int, stages: int, stage: int, batch_bytes: int) -> int:
    """Peak bytes of stage ``stage`` over a steady-state step of ``microbatches`` micro-batches (see the module's
    docstring), from :func:`trace_stage`'s ``trace``; ``batch_bytes``: the whole batch (inputs and targets).
    Point-to-point sends keep their tensor until their work is released: GPipe keeps every send's work to the end
    of its phase (``fwd_sends_to_wait``, ``bwd_sends_to_wait``), 1F1B the previous backward's."""
    m = microbatches
    k = warmup(schedule, m, stages, stage)
    gpipe = schedule_used(schedule, m, stages) == "gpipe"

    def backward(j: int) -> int:
        in_flight = min(m, k + j) - j
        sent = j * (trace["input"] + trace["output"]) if gpipe else min(j, 1) * trace["input"]
        return trace["fb_next" if j else "fb_first"] + (in_flight - 1) * trace["activations"] + sent

    ends = (trace["rest"], trace["opt_peak"])
    buffers = m * (trace["input"] + trace["output"]) + batch_bytes
    return buffers + max(*(backward(j) for j in range(m)), *ends)


def estimate(meta, layout: list, sample: tuple, loss_fn: Callable, optimizer_fn: Callable, devices: int,
             batch_size: int, precision: str, ac: tuple, options: dict) -> tuple:
    """``(MemoryEstimate, schedule)`` of ``devices`` pipeline stages (one per device) at ``batch_size`` samples per
    step: the estimate of the stage with the largest peak (its exact bytes, ``memory.exact_bytes``; its activations:
    those of the micro-batches it holds after its warm-up forwards), and ``schedule``, what the time model needs:
    ``stages``, ``microbatches``, ``schedule`` (the one a step runs), ``bubble`` ((P − 1)/(M + P − 1)),
    ``compute_share`` (the slowest stage's share of the model's FLOPs), ``optimizer_share`` (the largest stage's
    share of the parameter bytes), ``boundary_bytes`` (the largest activation a micro-batch sends between stages),
    ``peaks`` (each stage's peak, bytes).
    ``options``: the Runtime's ``pp_schedule`` (default "1f1b"), ``pp_microbatches`` (default 4·P; a batch runs in
    the most micro-batches up to that which divide it) and ``pp_split_points``.

    Raises:
        ValueError: no split for a model that is not a GPT, fewer GPT blocks than stages, bad split points.
    """
    from trainscale.plan.memory import MemoryEstimate, exact_bytes
    from trainscale.runtime.precision import Precision
    from trainscale.runtime.strategies.apply_pp import micro_batches_for
    from trainscale.runtime.strategies.pipeline import bubble_fraction

    m = micro_batches_for(batch_size, options.get("pp_microbatches") or 4 * devices)
    schedule, split = options.get("pp_schedule") or "1f1b", options.get("pp_split_points")
    with _fake_mode():
        batch_bytes = _nbytes(Precision(precision, "cpu").convert_input(_fake_batch(sample, batch_size)))
    stages = []
    sent = boundaries(meta, sample, batch_size // m, devices, precision, split)
    for s in range(devices):
        exact = exact_bytes(meta, layout, "pp", devices, s, precision, split_points=split)
        trace = trace_stage(meta, sample, batch_size // m, loss_fn, optimizer_fn, devices, s, precision, split, ac,
                            sent)
        stages.append((stage_peak(trace, schedule, m, devices, s, batch_bytes), s, exact, trace))
    peak, worst, exact, trace = max(stages, key=lambda st: st[0])
    held = warmup(schedule, m, devices, worst) * trace["activations"]
    est = MemoryEstimate("pp", devices, worst, batch_size, precision, exact["parameters"], exact["gradients"],
                         exact["optimizer"], exact["buffers"], 0, held, peak)
    whole = sum(p.numel() * p.element_size() for p in meta.parameters()) or 1
    flops = [st[3]["flops"] for st in stages]
    return est, {"stages": devices, "microbatches": m, "schedule": schedule_used(schedule, m, devices),
                 "bubble": bubble_fraction(devices, m), "compute_share": max(flops) / max(1, sum(flops)),
                 "optimizer_share": max(st[2]["parameters"] for st in stages) / whole,
                 "boundary_bytes": max(st[3]["output"] for st in stages), "peaks": [st[0] for st in stages]}


def step_s(t, schedule: dict, link: comm.Link) -> tuple[float, float]:
    """``(step seconds, communication seconds)`` of a pipeline step from one device's measured step ``t``
    (``ComputeTime`` of the same batch): :func:`trainscale.plan.comm.pipeline_s` of the slowest stage's micro-batch
    compute (forward and backward of the whole batch × its FLOP share / M) and the boundary transfers, plus the
    data loader's wait, the loop's own work and the largest stage's optimizer step (its share of the parameters)."""
    m, p = schedule["microbatches"], schedule["stages"]
    slot = (t.forward_s + t.backward_s) * schedule["compute_share"] / m
    transfer = comm.p2p_s(schedule["boundary_bytes"], link)
    comm_s = 2 * (m + p - 1) * transfer
    return (t.data_s + t.other_s + comm.pipeline_s(slot, transfer, p, m)
            + t.optimizer_s * schedule["optimizer_share"], comm_s)
