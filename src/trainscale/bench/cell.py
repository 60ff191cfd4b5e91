"""One bench cell: a fresh job that warms up, then times training, and writes ``result.json``.

Started by the sweep under torchrun, one process per device::

    python -m torch.distributed.run --standalone --nproc-per-node=N -m trainscale.bench.cell --config CELL.json

``CELL.json`` holds: entry, accelerator, strategy, precision, devices, per_device_batch, epochs,
steps (or null), warmup_steps, seed, cell_dir. The timed run validates after its epoch(s) but runs no sanity
check of validation batches before training (``num_sanity_val_steps=0`` unless the workload's ``"trainer"`` flags
set it). Rank zero writes ``cell_dir/result.json``; a rank
that fails writes ``cell_dir/error.rank<R>.json`` (exception type, message, whether it is an
out-of-memory error) before exiting non-zero, so the sweep can record why.
"""

from __future__ import annotations

import copy
import gc
import math
import sys
import time
from pathlib import Path

from trainscale.jobs.launcher import job_main

WARMUP_STEPS = 5
PROBE_BATCHES = 50
PROBE_ALLREDUCE_REPS = 5






def _peak_memory(device) -> tuple[int, str]:
    """This process's peak memory in bytes and what was measured."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "max_rss"  # Linux: KiB


def _probe_data(rt, loader, batches: int) -> float | None:
    """Seconds per batch to fetch and move batches with no compute (the loop's data wait when the
    loader is the bottleneck; an upper bound of it otherwise). On CUDA ``to_device``'s copies from pinned
    memory are asynchronous: the clock is read after ``torch.cuda.synchronize``, once they have landed."""
    import torch

    if batches < 1:
        return None
    rt.set_epoch(loader, 0)
    cuda = rt.device.type == "cuda"
    if cuda:  # nothing queued before the probe is counted in it
        torch.cuda.synchronize(rt.device)
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        rt.to_device(batch)
        n += 1
        if n >= batches:
            break
    if cuda:
        torch.cuda.synchronize(rt.device)
    return (time.perf_counter() - t0) / n if n else None


def _probe_allreduce(rt, numel: int) -> float | None:
    """Median seconds of one all-reduce of a float32 buffer the size of the gradients, measured alone.

    DDP overlaps its bucketed all-reduce with backward (Li et al. 2020), so this bounds the
    communication a step waits for from above. None under pipeline stages: they all-reduce no gradients, and
    each stage's gradient size differs (an all-reduce of different sizes aborts gloo: "Received data size
    doesn't match expected size")."""
    import torch
    import torch.distributed as dist

    if rt.world_size < 2 or numel < 1 or rt.strategy.pipelined:
        return None
    buf = torch.zeros(numel, dtype=torch.float32, device=rt.device)
    times = []
    for i in range(PROBE_ALLREDUCE_REPS + 1):
        rt.barrier()
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
        if i:  # the first one sets up the connection
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def hsdp_layout(strategy: str, devices: int) -> dict | None:
    """The mesh of a one-node ``hsdp`` cell: 2 replicas of ``devices / 2`` shards (the grid only makes
    hsdp cells with an even device count of at least 4); None (the strategy's own layout) otherwise."""
    return {"dp_replicate": 2, "dp_shard": devices // 2} if strategy == "hsdp" else None


def lm_numbers(telemetry: dict | None, history: list[dict], flops_per_token: float | None) -> dict:
    """``tokens_per_s`` (every data-parallel rank's tokens; telemetry's, else the epochs'), ``flops_per_token``
    (the workload's, else telemetry's counted FLOPs per sample over tokens per sample) and their product
    ``achieved_flops_per_s``; None where the batches hold no tokens or nothing gives the FLOPs."""
    tel = telemetry or {}
    tokens_per_s = tel.get("tokens_per_s")
    if tokens_per_s is None:
        times = [h["epoch_time_s"] for h in history if h.get("tokens_per_s")]
        tokens = sum(h["tokens_per_s"] * h["epoch_time_s"] for h in history if h.get("tokens_per_s"))
        tokens_per_s = tokens / sum(times) if times and sum(times) > 0 else None
    if flops_per_token is None and tel.get("flops_per_sample") and tel.get("tokens_per_s") and tel.get("samples_per_s"):
        flops_per_token = tel["flops_per_sample"] / (tel["tokens_per_s"] / tel["samples_per_s"])
    achieved = flops_per_token * tokens_per_s if flops_per_token and tokens_per_s else None
    return {"tokens_per_s": tokens_per_s, "flops_per_token": flops_per_token, "achieved_flops_per_s": achieved}


def run_cell(cfg: dict) -> dict | None:
    """Warm up, train for ``epochs`` (or ``steps``), probe; rank zero returns the result row."""
    import torch
    from torch.utils.data import DataLoader

    from trainscale.jobs.workload import load_workload
    from trainscale.loop.trainer import Trainer

    cell_dir = Path(cfg["cell_dir"])
    torch.manual_seed(cfg["seed"])
    work = load_workload(cfg["entry"])
    model = work["model"]
    optimizer = work["optimizer"]
    if optimizer is None and not hasattr(model, "configure_optimizers"):
        def optimizer(params):
            return torch.optim.AdamW(params, lr=1e-3)
    b = cfg["per_device_batch"]
    loader_kwargs = dict(work["dataloader"] or {})
    train_loader = DataLoader(work["train"], batch_size=b, shuffle=True, **loader_kwargs)
    val_loader = DataLoader(work["val"], batch_size=max(b, 256)) if work["val"] is not None else None
    common = dict(accelerator=cfg["accelerator"], devices=cfg["devices"], strategy=cfg["strategy"],
                  precision=cfg["precision"], seed=cfg["seed"], enable_progress_bar=False,
                  enable_checkpointing=False, log_every_n_steps=10**9, timeout=cfg.get("collective_timeout", 300),
                  parallel=hsdp_layout(cfg["strategy"], cfg["devices"]),
                  # no sanity check: its validation batches (all 512 windows of the lm workload) would run once more
                  # before training, untimed; validation after the timed epoch reads the same loader
                  **{"num_sanity_val_steps": 0, **work["trainer"]})

    if cfg["warmup_steps"]:  # kernels, allocator, process group: paid once, not timed
        warm = Trainer(max_epochs=1, max_steps=cfg["warmup_steps"], default_root_dir=cell_dir / "warmup", **common)
        warm.fit(copy.deepcopy(model), train_loader, None, loss_fn=work["loss_fn"], optimizer=optimizer)
        # Its model copy and optimizer state would stay allocated through the timed run (and in its peak memory);
        # the model refers back to its trainer, a cycle that only the collector frees.
        del warm
        gc.collect()
    trainer = Trainer(max_epochs=cfg["epochs"], max_steps=cfg["steps"], default_root_dir=cell_dir / "timed", **common)
    summary = trainer.fit(model, train_loader, val_loader, loss_fn=work["loss_fn"], optimizer=optimizer)
    rt = trainer.runtime

    n_train = len(work["train"])
    batches_per_epoch = math.ceil(math.ceil(n_train / rt.data_parallel_size) / b)  # the sampler pads, no drop_last
    steps = summary["steps"]
    time_s = sum(summary["epoch_time_s"])
    probe_data = _probe_data(rt, rt.setup_dataloader(train_loader, seed=cfg["seed"]), min(steps, PROBE_BATCHES))
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    probe_allreduce = _probe_allreduce(rt, numel)
    peaks = rt.all_gather_object(_peak_memory(rt.device))
    # Tear the process group down here rather than at interpreter exit, which on a loaded machine
    # occasionally aborts a gloo worker ("terminate called without an active exception", pytorch/pytorch#190489).
    rt.teardown()
    if not rt.is_rank_zero:
        return None
    return {
        "n_train": n_train, "batches_per_epoch": batches_per_epoch, "steps": steps,
        "epochs": summary["epochs"], "full_epochs": cfg["steps"] is None or steps >= cfg["epochs"] * batches_per_epoch,
        "time_s": time_s, "epoch_times_s": summary["epoch_time_s"],
        "step_time_s": time_s / steps if steps else None, "samples_per_s": summary["samples_per_s"],
        "global_batch_size": summary["global_batch_size"], "world_size": summary["world_size"],
        "train_loss": summary["train_loss"], "val_loss": summary["val_loss"], "val_accuracy": summary["val_accuracy"],
        "history": [{k: h.get(k) for k in ("epoch", "epoch_time_s", "val_accuracy", "val_loss")}
                    for h in trainer.history],
        **lm_numbers(summary.get("telemetry"), trainer.history, work["flops_per_token"]),
        "n_params": numel, "peak_memory_bytes": [p for p, _ in peaks], "peak_memory_kind": peaks[0][1],
        "probe_data_s": probe_data, "probe_allreduce_s": probe_allreduce,
        "telemetry": summary.get("telemetry"), "device": summary["device"], "torch_version": summary["torch_version"],
    }




def main(argv: list[str] | None = None) -> int:
    return job_main(run_cell, argv, "python -m trainscale.bench.cell", "cell_dir", "result.json")


if __name__ == "__main__":
    sys.exit(main())
