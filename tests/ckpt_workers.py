"""Bodies of the checkpoint-layout tests (module level so ``spawn`` can import them): a DCP checkpoint
saved on one mesh (in the background, ``Runtime.save(asynchronous=True)``) and loaded on another; a
Trainer under ``checkpoint_async=True`` whose background writer is held until training has moved on."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from tests.parallel_workers import CONFIG, full_weights, text_loader, train_steps
from trainscale.models import GPT

GLOBAL_BATCH = 16  # every layout reads the same 16 samples per step (per-rank batch = 16 / data-parallel ranks)


def full_momentum(model, optimizer) -> dict:
    """Every parameter's SGD momentum buffer in full (DTensor shards gathered), keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))["state"]
    return {name: value["momentum_buffer"].clone() for name, value in state.items()}


def mesh_checkpoint(rank: int, strategy: str, parallel: dict | None, data_ranks: int, save_to: str | None = None,
                    load_from: tuple = (), before: int = 2, after: int = 2, teardown: bool = True,
                    asynchronous: bool = True) -> dict:
    """A GPT (seed 0, SGD with momentum) under ``strategy``/``parallel`` through the Runtime.

    Saving (``save_to``): ``before`` steps, a background save (a synchronous one when not ``asynchronous``: the
    single/ddp file), ``after`` more steps while it is written;
    returns the full weights and momentum at the save and the losses after. Loading (``load_from``, one or
    more checkpoints in turn, each into a fresh model): the full weights and momentum right after the load,
    then the losses of the ``after`` steps that follow the saved ``before`` (same 16 samples a step)."""
    from trainscale.runtime.runtime import Runtime

    rt = Runtime(accelerator="cpu", devices=1 if strategy == "single" else "auto", strategy=strategy,
                 parallel=parallel, timeout=120)
    out = {}
    for key, checkpoint in [("saved", None)] if save_to else [(c, c) for c in load_from]:
        torch.manual_seed(0)
        wrapped, optimizer = rt.setup(GPT(CONFIG), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
        batches = iter(rt.setup_dataloader(text_loader(GLOBAL_BATCH // data_ranks)))
        if checkpoint is None:
            train_steps(rt, wrapped, optimizer, batches, before)
            pending = rt.save(save_to, {"model": wrapped, "optimizer": optimizer, "step": before},
                              asynchronous=asynchronous)
        else:
            rest = rt.load(checkpoint, {"model": wrapped, "optimizer": optimizer})
            assert rest["step"] == before
            for _ in range(before):
                next(batches)  # the samples the saved run had trained on
        result = {"weights": full_weights(wrapped), "momentum": full_momentum(wrapped, optimizer)}
        result["losses"] = train_steps(rt, wrapped, optimizer, batches, after)
        if checkpoint is None:
            result["published_before_wait"] = Path(save_to).exists()
            rt.wait_for_save()
            result["write_s"] = pending.write_s if asynchronous else None
        out[key] = result
    rt.barrier()
    if teardown:  # False: another Runtime follows in these processes, on the same process group
        rt.teardown()
    return out


def fsdp_and_ddp_resume_each_other(rank: int, fsdp_checkpoint: str, ddp_checkpoint: str) -> dict:
    """In the same 2 processes: fsdp saves (DCP directory) and ddp reads it back; ddp saves (one file) and fsdp
    is asked to read it ("refused": its error)."""
    from trainscale.runtime.checkpoint_io import CheckpointError

    out = {"fsdp": mesh_checkpoint(rank, "fsdp", None, 2, fsdp_checkpoint, teardown=False)}
    out["ddp"] = mesh_checkpoint(rank, "ddp", None, 2, load_from=(fsdp_checkpoint,), teardown=False)
    weights = out["ddp"][fsdp_checkpoint]["weights"]  # named through DDP's wrapper: "module.<name>"
    out["ddp"][fsdp_checkpoint]["weights"] = {k.removeprefix("module."): v for k, v in weights.items()}
    out["ddp_saved"] = mesh_checkpoint(rank, "ddp", None, 2, ddp_checkpoint, teardown=False, asynchronous=False)
    try:
        mesh_checkpoint(rank, "fsdp", None, 2, load_from=(ddp_checkpoint,))
    except CheckpointError as err:
        out["refused"] = str(err)
    return out


# -- a Trainer with checkpoint_async=True, its background writer held until training moved on --------------
def hold_writes_until_the_next_step(model, final_step: int) -> dict:
    """Replace ``checkpoint_io._write_event`` so that, in the background writer thread, each save before step
    ``final_step`` writes its shards only after ``model`` (whose ``steps`` list grows at each training step) has
    trained one more optimizer step. Returns what it saw: ``{save step: trained steps when the write began}``."""
    import re

    from trainscale.runtime import checkpoint_io

    seen: dict[int, int] = {}

    def event(stage, path):
        match = re.search(r"step=(\d+)", path.name)
        if stage != "writing-shards" or match is None or threading.current_thread() is threading.main_thread():
            return
        step = int(match.group(1))
        if step < final_step:
            model.stepped.wait(timeout=60)  # set by the model once global_step > step
        seen[step] = model.trainer.global_step

    checkpoint_io._write_event = event
    return seen


class Watched(torch.nn.Module):
    """The fault tests' ConvNet with dropout; sets ``stepped`` once an optimizer step after the newest
    save has been taken."""

    def __init__(self) -> None:
        super().__init__()
        from trainscale.models import ConvNet

        torch.manual_seed(0)
        self.net = ConvNet(batchnorm=False)
        self.drop = torch.nn.Dropout(0.2)
        self.trainer = None
        self.stepped = threading.Event()
        self.saved_at = -1

    def training_step(self, batch):
        x, y, _ = batch
        if self.trainer.global_step > self.saved_at:  # an optimizer step after the save has been taken
            self.stepped.set()
        return torch.nn.functional.cross_entropy(self.net(self.drop(x)), y)


def async_trainer_body(rank: int, root: str) -> dict:
    """fsdp on 2 ranks, 2 epochs of 12 steps, a checkpoint every 4 steps and at epoch ends: once with
    synchronous saves, once with ``checkpoint_async=True`` and every background write held until a later step
    was trained. Returns the summaries, the final full weights and what the held writer saw."""
    from torch.utils.data import DataLoader

    from tests.fault_workers import Indexed
    from trainscale.callbacks import Callback
    from trainscale.loop.trainer import Trainer

    class Saved(Callback):  # a save at global step S: the writer may go on once step S + 1 has been trained
        def on_save_checkpoint(self, trainer, module, checkpoint):
            module.saved_at = trainer.global_step
            module.stepped.clear()

    out = {}
    for name, asynchronous in (("sync", False), ("async", True)):
        trainer = Trainer(accelerator="cpu", devices="auto", strategy="fsdp", max_epochs=2, seed=0,
                          default_root_dir=Path(root) / name,
                          enable_progress_bar=False, log_every_n_steps=1, checkpoint_every_n_steps=4, keep_last=None,
                          checkpoint_async=asynchronous, callbacks=[Saved()], timeout=120)
        model = Watched()
        model.trainer = trainer
        seen = hold_writes_until_the_next_step(model, final_step=24) if asynchronous else {}
        summary = trainer.fit(model, DataLoader(Indexed(96), batch_size=4, shuffle=True),
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
        out[name] = {"summary": summary, "weights": full_weights(model.net), "seen": dict(seen)}
    from trainscale.runtime import checkpoint_io

    checkpoint_io._write_event = lambda stage, path: None
    trainer.runtime.teardown()
    return out


def before_restore_body(rank: int, directory: str, strategy: str) -> dict:
    """2 ranks: save a ``strategy`` checkpoint of a linear layer, load it with a ``before_restore`` that notes the
    keys it sees and sets a plain entry; returns those keys and what the load returned."""
    from trainscale.runtime.runtime import Runtime

    torch.manual_seed(0)
    runtime = Runtime(accelerator="cpu", strategy=strategy, devices="auto", timeout=120)
    model, _ = runtime.setup(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
    target = Path(directory) / ("ck" if strategy == "fsdp" else "ck.pt")
    runtime.save(target, {"model": model, "step": 3})
    seen = []

    def note(entries):
        seen.append(sorted(entries))
        entries["step"] = 4

    rest = runtime.load(target, {"model": model}, before_restore=note)
    runtime.teardown()
    return {"seen": seen, "step": rest["step"]}


class Cool:
    """An object of a class of the user's own, which ``torch.load(weights_only=True)`` refuses (module level:
    the spawned ranks unpickle it)."""

    def __init__(self, value):
        self.value = value


def pickled_entries_body(rank: int, root: str, strategy: str) -> dict:
    """``strategy`` (ddp: a file; fsdp: a sharded directory) on 2 ranks: a fit whose ``on_save_checkpoint`` adds a
    ``Cool``, then a resume without ``weights_only=False`` (refused: its error, and whether the model kept its
    weights) and one with it (the value the hook saw); whether the checkpoint file (the sharded directory's extra
    file) loads weights-only, and what it keeps apart."""
    from torch.utils.data import DataLoader, TensorDataset

    from tests.parallel_workers import full_weights
    from trainscale.checkpointing.run_dirs import find_last
    from trainscale.lightning.module import TrainingModule
    from trainscale.loop.trainer import Trainer
    from trainscale.runtime.checkpoint_io import CheckpointError
    from trainscale.runtime.strategies.dcp_checkpoint import EXTRA

    class Keeps(TrainingModule):
        def __init__(self):
            super().__init__()
            self.layer, self.seen = torch.nn.Linear(4, 1), None

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_save_checkpoint(self, checkpoint):
            checkpoint["something_cool"] = Cool(5)

        def on_load_checkpoint(self, checkpoint):
            self.seen = checkpoint.get("something_cool")

    def fit(module, **kwargs):
        trainer = Trainer(accelerator="cpu", devices="auto", strategy=strategy, max_epochs=1, default_root_dir=root,
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, timeout=60)
        data = TensorDataset(torch.linspace(-1, 1, 32).reshape(8, 4), torch.zeros(8))
        trainer.fit(module, DataLoader(data, batch_size=2), **kwargs)
        return module

    fit(Keeps())
    last = Path(find_last(root))
    extra = torch.load(last / EXTRA if strategy == "fsdp" else last, weights_only=True)
    out = {"extra_loads_weights_only": "something_cool" not in extra,
           "kept_apart": [r["path"][0] for r in extra["pickled_entries"]]}
    torch.manual_seed(1)
    refused = Keeps()
    initial = full_weights(refused)
    try:
        fit(refused, ckpt_path="last")
    except CheckpointError as err:
        out["refused"] = str(err)
    out["unchanged_after_refusal"] = refused.seen is None and all(
        torch.equal(w, initial[k]) for k, w in full_weights(refused).items())
    out["seen"] = fit(Keeps(), ckpt_path="last", weights_only=False).seen.value
    return out
