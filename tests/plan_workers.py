"""Bodies of the plan's multi-process tests: real runs whose tensor bytes the predictions must match.

Measured, per rank, with real tensors on real gloo processes through the Runtime:
- parameter, gradient and optimizer-state bytes: the sizes of the distinct storages behind the
  parameters (their local shards under fsdp), their ``.grad`` after the second backward and the
  optimizer's state tensors after the second step;
- the peak of live tensor bytes over the whole run (model construction, wrapping, two steps, the
  batch): PyTorch's ``MemTracker`` (a dispatch mode that follows every storage allocated and freed)
  entered before the model is built, so DDP's buckets and FSDP's all-gather buffers are counted.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

# (strategy, precision, activation checkpointing of nn.Sequential blocks, BatchNorm) per world size.
# fsdp + bf16-mixed runs without BatchNorm: with it, FSDP2 casts the BatchNorm weights to bf16 while
# the running statistics stay fp32, and CPU batch_norm raises "expected scalar type BFloat16 but found
# Float" (torch 2.13; a Runtime bug reported separately, not a planning question).
CONFIGS = {1: [("ddp", "32-true", False, True), ("ddp", "64-true", False, True)],
           2: [("ddp", "32-true", False, True), ("fsdp", "32-true", False, True), ("ddp", "bf16-mixed", True, True),
               ("fsdp", "bf16-mixed", True, False), ("fsdp", "64-true", False, True)],
           4: [("ddp", "32-true", False, True), ("fsdp", "32-true", False, True)]}
BATCH = 64


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class LiveBytes:
    """The peak of live tensor bytes, as ``MemTracker`` counts them (each storage once, from its creation by an
    op until it is freed), without its module hooks: those register multi-grad hooks on module inputs, which
    ``torch.autograd.grad`` refuses ("A leaf node was passed to _will_engine_execute_node"), and a pipeline
    stage's first schedule step infers its shapes with ``autograd.grad`` (torch 2.13 ``PipelineStage``).
    ``with LiveBytes() as live: ...``; then ``live.peak`` (bytes)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.weak import WeakIdKeyDictionary

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        outer._add(t.untyped_storage())
                return out

        self.mode, self.live, self.current, self.peak = Mode(), WeakIdKeyDictionary(), 0, 0

    def _add(self, storage) -> None:
        import weakref

        if storage in self.live or storage.nbytes() == 0:
            return
        self.live[storage] = weakref.finalize(storage, self._free, storage.nbytes())
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)

    def _free(self, nbytes: int) -> None:
        self.current -= nbytes

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _tracked_run(rt, build, steps) -> dict:
    """Under ``MemTracker`` (:class:`LiveBytes` for pipeline stages) from before the model is built: ``build()``
    set up by ``rt`` with AdamW, one optimizer step after each ``forward_backward(model)`` of ``steps``; this
    rank's parameter, gradient (after the last backward) and optimizer-state bytes (the local shards' storages)
    and the peak of live tensor bytes."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = LiveBytes() if rt.config.strategy == "pp" else MemTracker()
    with tracker:
        model, optimizer = rt.setup(build(), adamw)
        for forward_backward in steps:
            forward_backward(model)
            grads = _storage_bytes(p.grad for p in model.parameters())
            rt.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            if isinstance(tracker, MemTracker):
                tracker.reset_mod_stats()
    peak = tracker.peak if isinstance(tracker, LiveBytes) else \
        sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
    return {"parameters": _storage_bytes(model.parameters()), "gradients": grads,
            "optimizer": _storage_bytes(t for s in optimizer.state.values() for t in s.values()), "peak": peak}


def _measure(strategy: str, precision: str, checkpointing: bool, batchnorm: bool) -> dict:
    from trainscale.models import ConvNet
    from trainscale.runtime.runtime import Runtime

    torch.manual_seed(0)
    rt = Runtime(accelerator="cpu", devices="auto", strategy=strategy, precision=precision, timeout=60,
                 activation_checkpointing={torch.nn.Sequential} if checkpointing else None)
    x, y = torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))

    def step(model):
        batch = rt.to_device((x.clone(), y.clone()))  # the batch's bytes counted (in float64 under "64-true")
        with rt.autocast():
            loss = F.cross_entropy(model(batch[0]), batch[1])
        rt.backward(loss)

    return _tracked_run(rt, lambda: ConvNet(batchnorm=batchnorm), [step, step])


def measure_body(rank: int) -> dict:
    import torch.distributed as dist

    world = int(__import__("os").environ["WORLD_SIZE"])
    try:
        return {cfg: _measure(*cfg) for cfg in CONFIGS[world]}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def gpt_config(uneven: bool):
    """The small GPT of tests/parallel_workers.py; ``uneven``: with 255 vocabulary rows and 33 positions, so
    tensor-parallel shards (``torch.chunk``: 128 and 127 rows) and FSDP shards (17 and 16 rows) differ by rank."""
    import dataclasses

    from tests.parallel_workers import CONFIG

    return dataclasses.replace(CONFIG, vocab_size=255, context_length=33) if uneven else CONFIG


def _gpt_batches(uneven: bool, rt):
    """Two batches of 4: the text data set, or (uneven vocabulary) random tokens below 255, 32 per sequence
    (of the 33 positions: sequence parallelism splits the sequence evenly over tp)."""
    from tests.parallel_workers import text_loader

    if not uneven:
        # 32 windows: 2 batches of 4 on each rank even with 4 data-parallel ranks (hsdp 2 × 2), so the second
        # step runs with the optimizer state allocated, as the plan's trace does (16 gave hsdp one step)
        return zip(range(2), rt.setup_dataloader(text_loader(batch_size=4, samples=32)))
    tokens = torch.randint(0, 255, (2, 4, 33), generator=torch.Generator().manual_seed(0))
    return enumerate((t[:, :-1], t[:, 1:]) for t in tokens)


def _gpt_step(rt, x, y):
    """One forward and backward of the GPT on ``(x, y)``, copied inside so each step's batch counts once: a
    pipeline's schedule step under "pp", else the module's call and the Runtime's backward."""
    from trainscale.models import lm_loss

    if rt.config.strategy == "pp":
        return lambda model: rt.forward_backward(model, (x.clone(), y.clone()), lm_loss)
    return lambda model: rt.backward(lm_loss(model(x.clone()), y.clone()))


def _gpt_run(rt, uneven: bool) -> dict:
    """:func:`_tracked_run` of the GPT (:func:`gpt_config`) set up by ``rt``, over :func:`_gpt_batches`."""
    from trainscale.models import GPT

    torch.manual_seed(0)
    batches = [rt.to_device(b) for _, b in _gpt_batches(uneven, rt)]
    return _tracked_run(rt, lambda: GPT(gpt_config(uneven)), [_gpt_step(rt, x, y) for x, y in batches])


def measure_gpt_body(rank: int, strategy: str, parallel: dict, uneven: bool = False) -> dict:
    """The small GPT (:func:`gpt_config`) under ``strategy`` ("tp", "hsdp") with ``parallel``: this rank's
    parameter, gradient (after the second backward) and optimizer-state bytes (AdamW, after the second
    step), the sizes of the local shards' storages, and the peak of live tensor bytes (``MemTracker`` from
    before the model is built; the batch read before it and copied inside, so each step's batch counts once)."""
    import torch.distributed as dist

    from trainscale.runtime.runtime import Runtime

    try:
        return _gpt_run(Runtime(accelerator="cpu", devices="auto", strategy=strategy, parallel=parallel, timeout=60),
                        uneven)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure_pp_body(rank: int, schedules: tuple) -> dict:
    """The small GPT on 2 pipeline stages under each of ``schedules`` ("1f1b", "gpipe") in turn, in one process
    group: per schedule, :func:`measure_gpt_body`'s bytes of this rank (= stage)."""
    import torch.distributed as dist

    from trainscale.runtime.runtime import Runtime

    try:
        return {schedule: _gpt_run(Runtime(accelerator="cpu", devices="auto", strategy="pp", timeout=60,
                                           pp_schedule=schedule), False) for schedule in schedules}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
