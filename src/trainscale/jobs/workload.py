"""What a bench cell trains: the embedded default or the user's ``--entry package.module:function``.

The entry contract. ``function()`` takes no argument and returns a dict::

    {"model": nn.Module,                       # required; built fresh by this call
     "train": Dataset,                         # required; map-style, len() known
     "val": Dataset | None,                    # optional; validated after each epoch (accuracy, loss)
     "loss_fn": callable | None,               # optional; (outputs, targets) -> mean loss, default cross-entropy
     "optimizer": callable | None,             # optional; params -> Optimizer (or Trainer's (opt, sched) forms),
                                               #           default AdamW(lr=1e-3)
     "dataloader": dict | None,                # optional; extra DataLoader keyword arguments for training,
                                               #           e.g. {"num_workers": 2, "pin_memory": True}
     "flops_per_token": float | None,          # optional; training FLOPs per token (forward + backward) of a
                                               #           language model, reported with tokens/s
     "trainer": dict | None}                   # optional; Trainer flags the workload trains with, e.g.
                                               #           {"lr_scaling": "sqrt", "base_batch_size": 32,
                                               #            "accumulate_grad_batches": 2, "sync_batchnorm": True}

It runs in every process of every cell (after ``torch.manual_seed(seed)``), so it must be importable
there: the module is imported from the current directory or ``PYTHONPATH``. Keys other than these
raise an error (a misspelt key must not silently become a default). A model may also define
``training_step`` / ``validation_step`` as the Trainer allows. ``"trainer"`` may not set what the harness
sets itself (``HARNESS_FLAGS``: devices, strategy, precision, steps, seed, ...); ``trainscale plan`` ignores it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

DEFAULT_ENTRY = "trainscale.jobs.workload:mnist_convnet"
# --workload NAME: the built-in entries
WORKLOADS = {"convnet": DEFAULT_ENTRY, "lm": "trainscale.jobs.workload:shakespeare_gpt"}
KEYS = ("model", "train", "val", "loss_fn", "optimizer", "dataloader", "flops_per_token", "trainer")
# Trainer flags that bench and check set for each run: a workload's "trainer" dict may not set them.
HARNESS_FLAGS = frozenset({"accelerator", "devices", "strategy", "num_nodes", "precision", "seed", "max_epochs",
                           "max_steps", "default_root_dir", "enable_progress_bar", "enable_checkpointing",
                           "log_every_n_steps", "timeout", "callbacks", "logger", "parallel"})
LM_PRESET = "mini"  # the demo's GPT: 0.84M parameters, context 128, 4 heads (tp 2 and 4 divide them)
LM_VAL_SAMPLES = 512  # the first windows of the validation split (65,536 tokens)


def mnist_convnet() -> dict:
    """The demo's workload: the tutorial ConvNet on MNIST-5k (4,000 train / 1,000 validation digits),
    AdamW with lr 2e-3."""
    import torch

    from trainscale.data import load_mnist5k
    from trainscale.models import ConvNet

    train, val = load_mnist5k()
    return {"model": ConvNet(), "train": train, "val": val,
            "optimizer": lambda params: torch.optim.AdamW(params, lr=2e-3)}


def gpt_shakespeare() -> dict:
    """GPT-2 124M (``trainscale.models.GPT("gpt2-124m")``: 12 layers, 12 heads, width 768, context 1024)
    on byte-level Shakespeare in windows of 1,024 tokens (the ``shakespeare`` package), ``lm_loss``,
    AdamW with lr 6e-4 (GPT-2 small's). The worked example of docs/plan.md."""
    import torch

    from trainscale.data import load_text
    from trainscale.models import GPT
    from trainscale.models.gpt import lm_loss

    model = GPT("gpt2-124m")
    train, val = load_text(context_length=model.config.context_length)
    return {"model": model, "train": train, "val": val, "loss_fn": lm_loss,
            "optimizer": lambda params: torch.optim.AdamW(params, lr=6e-4)}


def shakespeare_gpt() -> dict:
    """The language-model workload (``--workload lm``): the reference GPT ("mini" preset) on byte-level
    Shakespeare (``load_text``, context 128; validated on the first 512 validation windows), AdamW with lr
    3e-3, and its FLOPs per token
    (``GPT.flops_per_token``, PaLM's 6·N + 12·L·C·T). Every strategy applies to it, ``tp`` and ``hsdp``
    included (the built-in tensor-parallel plan)."""
    import torch

    from trainscale.data import load_text
    from trainscale.models import GPT, PRESETS, lm_loss

    config = PRESETS[LM_PRESET]
    train, val = load_text(context_length=config.context_length)
    model = GPT(config)
    val = torch.utils.data.Subset(val, range(min(LM_VAL_SAMPLES, len(val))))  # validation costs little per cell
    return {"model": model, "train": train, "val": val, "loss_fn": lm_loss,
            "optimizer": lambda params: torch.optim.AdamW(params, lr=3e-3),
            "flops_per_token": model.flops_per_token()}


def parse_entry(entry: str) -> tuple[str, str]:
    """Split ``"package.module:function"``.

    Raises:
        ValueError: not of that form.
    """
    module, sep, func = str(entry).partition(":")
    if not sep or not module or not func or not all(part.isidentifier() for part in module.split(".") + func.split(".")):
        raise ValueError(f"entry={entry!r} must look like 'package.module:function' (a function returning "
                         f"{{'model', 'train', 'val', 'loss_fn', 'optimizer'}})")
    return module, func


def resolve_entry(entry: str) -> Callable[[], dict]:
    """Import the function named by ``entry`` (without calling it).

    Raises:
        ValueError: a malformed entry, a module that cannot be imported, or a missing/non-callable name.
    """
    module_name, func_name = parse_entry(entry)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"entry={entry!r}: cannot import {module_name!r} ({err}); run from the directory "
                         "that holds the package or add it to PYTHONPATH") from None
    for part in func_name.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise ValueError(f"entry={entry!r}: {module_name!r} has no callable {func_name!r}")
    return obj


def entry_name(entry: str | Callable | None) -> str:
    """The ``module:function`` string of ``entry`` (None: the default workload).

    Raises:
        ValueError: a function the cells cannot import (defined in ``__main__`` or locally).
    """
    if entry is None:
        return DEFAULT_ENTRY
    if isinstance(entry, str):
        parse_entry(entry)
        return entry
    module, qualname = getattr(entry, "__module__", None), getattr(entry, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname:
        raise ValueError(f"entry {entry!r} cannot be imported by the cell processes; define it at the top level of "
                         "an importable module and pass 'package.module:function'")
    return f"{module}:{qualname}"


def load_workload(entry: str) -> dict:
    """Call the entry function and check what it returned against the contract.

    Raises:
        ValueError: not a dict, unknown keys, a missing model/train, a model that is not an ``nn.Module``.
    """
    from torch import nn

    work = resolve_entry(entry)()
    if not isinstance(work, dict):
        raise ValueError(f"entry {entry!r} returned {type(work).__name__}; return a dict with keys {', '.join(KEYS)}")
    unknown = sorted(set(work) - set(KEYS))
    if unknown:
        raise ValueError(f"entry {entry!r} returned unknown keys {unknown}; the keys are {', '.join(KEYS)}")
    if not isinstance(work.get("model"), nn.Module):
        raise ValueError(f"entry {entry!r}: 'model' must be a torch.nn.Module, got {type(work.get('model')).__name__}")
    if work.get("train") is None or not hasattr(work["train"], "__len__"):
        raise ValueError(f"entry {entry!r}: 'train' must be a map-style Dataset with a length")
    if "batch_size" in (work.get("dataloader") or {}):
        raise ValueError(f"entry {entry!r}: 'dataloader' must not set batch_size; the sweep sets it per cell")
    _check_trainer_flags(entry, work.get("trainer"))
    fpt = work.get("flops_per_token")
    if fpt is not None and (isinstance(fpt, bool) or not isinstance(fpt, (int, float)) or not fpt > 0):
        raise ValueError(f"entry {entry!r}: 'flops_per_token' must be a positive number, got {fpt!r}")
    return {"val": None, "loss_fn": None, "optimizer": None, "dataloader": None, "flops_per_token": None, **work,
            "trainer": dict(work.get("trainer") or {})}


def _check_trainer_flags(entry: str, flags) -> None:
    if flags is None:
        return
    if not isinstance(flags, dict):
        raise ValueError(f"entry {entry!r}: 'trainer' must be a dict of Trainer flags, got {type(flags).__name__}")
    taken = sorted(set(flags) & HARNESS_FLAGS)
    if taken:
        raise ValueError(f"entry {entry!r}: 'trainer' sets {', '.join(taken)}, which bench and check set per run "
                         "(use their command-line flags instead)")
