"""A trainscale checkpoint → a Hugging Face model directory (``config.json`` + ``*.safetensors``).

The model's weights are read whole into this one process, from a checkpoint file (strategies single, ddp, dp)
or a sharded DCP directory (fsdp, hsdp, tp, model_parallel: ``dcp_checkpoint.read_whole``, any mesh), and
written by torch's ``torch.distributed.checkpoint.HuggingFaceStorageWriter`` (safetensors files and
``model.safetensors.index.json``, the layout ``from_pretrained`` reads). ``config.json`` is the model's
``config.to_dict()``, which the Trainer saves in every checkpoint of a ``transformers`` model (``hf_config``),
or the ``config`` given. Memory: the whole model once, in its stored dtype.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

FORMATS = ("safetensors",)


def export(checkpoint: str | Path, out: str | Path, format: str = "safetensors", config: Any = None,
           verify: bool = True) -> Path:
    """Write the model of trainscale checkpoint ``checkpoint`` to the new directory ``out``, which
    ``transformers.AutoModelForCausalLM.from_pretrained(out)`` (or the model's own class) loads with the same
    weights.

    Args:
        checkpoint: a checkpoint file (``epoch=E-step=S.pt``), a sharded checkpoint directory, or a run's
            ``checkpoints/last`` (the file that names the newest).
        out: the directory to create; it must not exist or be empty. Written under ``.<name>.tmp`` and
            renamed at the end: a failed export leaves nothing under ``out``.
        format: "safetensors" (the only one).
        config: None (the ``hf_config`` the checkpoint holds), a ``transformers`` config, its ``to_dict()``, or
            the path of a ``config.json`` or of a directory holding one (e.g. the one the run started from).
        verify: check the checkpoint's SHA-256 files (``False``: a checkpoint you trust that has none).

    Returns:
        ``out``.

    Raises:
        ValueError: an unknown ``format``, ``out`` not empty, or no config (the checkpoint's model was not a
            ``transformers`` model and ``config`` was not given).
        FileNotFoundError, trainscale.runtime.checkpoint_io.CheckpointError: as a checkpoint load.
        ModuleNotFoundError: ``transformers`` or ``safetensors`` is not installed (``pip install 'trainscale[hf]'``).
    """
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not supported; use one of {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{str(out)!r} exists and is not an empty directory; export to a new directory, or "
                         "delete it first")
    _require("transformers", "safetensors")
    state, extra = _read_model(_resolve(Path(checkpoint)), verify)
    hf_config = _config(config, extra.get("hf_config"), checkpoint)
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write(_untied(state), tmp)
        hf_config.save_pretrained(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_pretrained(model: Any, directory: str | Path) -> None:
    """Load the weights of a Hugging Face model directory (the safetensors files that ``from_pretrained`` reads and
    :func:`export` writes) into ``model`` in place, whole or sharded: after fsdp, hsdp or tp sharded it, each rank
    reads only the slices of its own shards (torch's ``torch.distributed.checkpoint.HuggingFaceStorageReader``
    through ``dcp.load``), so the whole model is never in one process. Call it on every rank of the job (after
    ``Runtime.setup``, or in a callback's ``on_fit_start``), with the model whose class wrote the files.

    Raises:
        ValueError: a parameter or buffer of ``model`` is not in the files (a tied copy of one that is, e.g. a
            head tied to the token embedding, may be absent), naming the first ones.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    stored = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    state = get_model_state_dict(model)
    params = dict(model.named_parameters(remove_duplicate=False))  # tied names share one Parameter
    stored_params = {id(params[name]) for name in stored if name in params}
    tied = {name for name in state if name not in stored and name in params and id(params[name]) in stored_params}
    missing = sorted(set(state) - set(stored) - tied)
    if missing:
        raise ValueError(f"{str(directory)!r} has no {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} of "
                         f"{type(model).__name__}: load the directory of this model's class")
    wanted = {name: tensor for name, tensor in state.items() if name in stored}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*")
        dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=not dist.is_initialized())
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))


def _require(*packages: str) -> None:
    import importlib.util

    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ModuleNotFoundError(f"trainscale export needs {', '.join(missing)}: pip install 'trainscale[hf]'")


def _resolve(path: Path) -> Path:
    """``path``, or the checkpoint a ``checkpoints/last`` file names (one line, relative to its folder)."""
    if path.is_file() and path.name == "last":
        return path.parent / path.read_text().strip()
    return path


def _read_model(path: Path, verify: bool) -> tuple[dict, dict]:
    """``({name: tensor}, the checkpoint's other entries)`` of the model in checkpoint ``path``: a file holding a
    ``model`` state dict, or a sharded directory of any mesh read whole (``checkpointer.read_module_checkpoint``)."""
    from trainscale.checkpointing.checkpointer import read_module_checkpoint
    from trainscale.runtime import checkpoint_io

    if path.is_dir():
        with warnings.catch_warnings():  # DCP's note that it reads in one process: what is meant here
            warnings.filterwarnings("ignore", message="torch.distributed is .*")
            entries, read_model = read_module_checkpoint(path, verify)
            return read_model(), entries
    content = checkpoint_io.load_file(path, verify)
    if not isinstance(content, dict) or not isinstance(content.get("model"), dict):
        raise checkpoint_io.CheckpointError(f"{str(path)!r} is not a trainscale checkpoint (no 'model' state dict)")
    return content["model"], content


def _config(config: Any, saved: dict | None, checkpoint: Any) -> Any:
    """The ``transformers`` config to write as ``config.json``."""
    import transformers

    if config is None and saved is None:
        raise ValueError(f"checkpoint {str(checkpoint)!r} holds no Hugging Face config (its model was not a "
                         "transformers PreTrainedModel when it was saved); pass config= (CLI: --config), e.g. the "
                         "directory the model was loaded from")
    if isinstance(config, transformers.PretrainedConfig):
        return config
    if isinstance(config, (str, Path)):
        path = Path(config)
        config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    values = dict(saved if config is None else config)
    if "model_type" not in values:
        raise ValueError("the config has no 'model_type'; pass the config.json the model was built from")
    return transformers.AutoConfig.for_model(values.pop("model_type"), **values)


def _untied(state: dict) -> dict:
    """``state`` without the names whose tensor shares its storage with an earlier one (tied weights, e.g. a
    language-model head tied to the token embedding, which a checkpoint file keeps as one tensor). safetensors
    refuses shared tensors; ``from_pretrained`` ties them again from the config, as after ``save_pretrained``."""
    seen: set = set()
    kept = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            kept[name] = tensor
    return kept


def _write(state: dict, directory: Path) -> None:
    """The tensors of ``state`` as safetensors files in ``directory``, written by DCP's Hugging Face writer in
    this process (``model-00001-of-00001.safetensors`` and ``model.safetensors.index.json``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    directory.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*")
        dcp.save({k: v.contiguous() for k, v in state.items()}, storage_writer=HuggingFaceStorageWriter(str(directory)),
                 no_dist=True)
