"""The one place that collects all training state into a checkpoint and puts it back.

State (torchtitan's fixed keys): ``model``, ``optimizer`` (``optimizer_1``... for more),
``scheduler`` (``scheduler_1``...), ``train_state`` (:class:`~trainscale.loop.state.TrainState`),
``loop`` (the position in the epoch), ``rng`` (every rank's RNG states), ``callbacks`` (each
callback's ``state_dict``), ``world_size``, ``optimizer_classes``, and for a Hugging Face model ``hf_config`` (its
``config.to_dict()``). Writing is the Runtime's
(atomic file + SHA-256, or a DCP directory under fsdp); naming, ``last`` and rotation are
``trainscale.checkpointing.run_dirs``'s.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from trainscale.checkpointing import rng, run_dirs as ckpt
from trainscale.runtime import hf
from trainscale.checkpointing.train_state import ResumePoint, TrainState

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime


def _keyed(prefix: str, objects) -> dict[str, Any]:
    return {prefix if i == 0 else f"{prefix}_{i}": obj for i, obj in enumerate(objects)}


def default_name(fit: Any, state: TrainState, suffix: str) -> str:
    """The one checkpoint name: ``epoch=E-step=S`` + ``suffix`` (the strategy's: ".pt" for one file, "" for a
    sharded directory), E the epochs completed."""
    completed = state.epoch + 1 if state.batches >= fit.epoch_batches else state.epoch
    return ckpt.checkpoint_name(completed, state.global_step, suffix)


def save(runtime: Runtime, target: Path, fit: Any, state: TrainState, optimizers, schedulers, callbacks: dict,
         on_save: Callable[[dict], None] | None = None, asynchronous: bool = False) -> tuple[Path, Any]:
    """Write a checkpoint of the running ``fit`` (a ``FitRun``) to ``target`` (a file, or a directory under a
    sharding strategy). All ranks
    call it; ends with a barrier, or (``asynchronous``) once the state is staged (``Runtime.save``).
    ``on_save(checkpoint)`` sees the dict before it is written and may add keys (Lightning's
    ``Callback.on_save_checkpoint``).

    Returns:
        The path (a file, or a DCP directory under a sharding strategy) and None, or the ``AsyncSave`` that
        publishes it there.
    """
    complete = state.batches >= fit.epoch_batches
    totals = [*fit.epoch_loss.totals(runtime), time.perf_counter() - fit.started]  # loss sum, samples, tokens, s
    sampler = getattr(fit.train_loader, "sampler", None)
    consumed = (sampler.consumed_after(state.batches - fit.epoch_offset, fit.train_loader.batch_size)
                if hasattr(sampler, "consumed_after") else None)
    content = {"model": fit.model, **_keyed("optimizer", optimizers),
               **_keyed("scheduler", [s.scheduler for s in schedulers]),
               "train_state": state.state_dict(), "rng": runtime.all_gather_object(rng.rng_state()),
               "world_size": runtime.world_size, "callbacks": callbacks,
               "optimizer_classes": [type(o).__name__ for o in optimizers],
               "loop": {"epoch": state.epoch, "complete": complete, "consumed": consumed, "batches": state.batches,
                        "totals": None if complete else totals}}
    if (hf_config := hf.config_dict(fit.model)) is not None:  # config.json for `trainscale export`
        content["hf_config"] = hf_config
    if on_save is not None:
        on_save(content)
    return target, runtime.save(target, content, asynchronous=asynchronous)


def load(runtime: Runtime, path: Path, model: Any, optimizers, schedulers, state: TrainState,
         callbacks=(), verify: bool = True) -> tuple[ResumePoint, dict]:
    """Restore model, optimizers, schedulers, ``state`` and the ``callbacks``' states in place from ``path``.

    Returns:
        The resume point and the checkpoint's other entries (``train_state``, ``loop``, ``callbacks``: the
        callbacks' saved states by ``state_key``, and any key a callback's ``on_save_checkpoint`` added).

    Raises:
        ValueError: the checkpoint's optimizers are of other classes than the configured ones (e.g. Adam
            saved, SGD configured): resume with the same optimizer, or start fresh.
    """
    configured = [[g["lr"] for g in o.param_groups] for o in optimizers]
    objects = {"model": model, **_keyed("optimizer", optimizers), **_keyed("scheduler", [s.scheduler for s in schedulers])}
    rest = runtime.load(path, objects, verify=verify)  # verify=False: no .sha256 needed (the user's opt-out)
    _check_optimizer_classes(path, rest.get("optimizer_classes"), optimizers)
    _say_which_lr_wins(runtime, configured, optimizers)
    point = _resume_point(runtime, rest, state)
    if point.rng is not None and point.complete:
        rng.set_rng_state(point.rng)  # mid-epoch: restored after the epoch's loader iterator is made, as when saved
    where = f"end of epoch {point.epoch + 1}" if point.complete else f"epoch {point.epoch + 1}, sample {point.consumed}"
    runtime.print(f"trainscale: resumed from {path} ({where}, step {state.global_step})")
    states = dict(rest.get("callbacks") or {})
    for cb in (cb for cb in callbacks if cb.state_key in states):
        cb.load_state_dict(states[cb.state_key])
    return point, rest


def _check_optimizer_classes(path: Path, saved: list | None, optimizers) -> None:
    current = [type(o).__name__ for o in optimizers]
    if saved is not None and list(saved) != current:
        raise ValueError(f"{path} was trained with optimizer(s) {', '.join(saved)} but {', '.join(current)} is "
                         "configured; resume with the same optimizer class, or start fresh (ckpt_path=None)")


def _resume_point(runtime: Runtime, rest: dict, state: TrainState) -> ResumePoint:
    """Fill ``state`` from a loaded checkpoint's plain values and say where to resume."""
    train, loop = rest["train_state"], rest["loop"]
    state.global_step = int(train["global_step"])
    # an epoch resumed mid-way gets its record again at its end: the partial one goes
    state.history = [r for r in train["history"] if loop["complete"] or r["epoch"] != loop["epoch"]]
    rngs = rest.get("rng") or []
    rng = rngs[runtime.rank] if len(rngs) == runtime.world_size else (rngs[0] if rngs else None)
    return ResumePoint(loop["epoch"], bool(loop["complete"]), loop["consumed"], int(loop["batches"]),
                       tuple(loop.get("totals") or (0.0, 0.0, 0.0)), rng, int(rest.get("world_size", runtime.world_size)))


def _say_which_lr_wins(runtime: Runtime, configured: list[list[float]], optimizers) -> None:
    restored = [[g["lr"] for g in o.param_groups] for o in optimizers]
    if restored != configured:
        runtime.print(f"trainscale: the checkpoint's learning rate(s) {restored} replace the configured {configured} "
                      "(optimizer state resumes as saved; to change it, set param_group['lr'] in a callback's "
                      "on_fit_start)")
