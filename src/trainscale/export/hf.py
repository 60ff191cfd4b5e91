"""A trainscale checkpoint → a Hugging Face model directory, as ``save_pretrained`` writes it.

The model's weights are read whole into this one process, from a checkpoint file (strategies single, ddp, dp)
or a sharded DCP directory (fsdp, hsdp, tp, model_parallel: ``dcp_checkpoint.read_whole``, any mesh), put into the
``transformers`` class the config names (built on the meta device: no second copy of the weights), and written by
that model's own ``save_pretrained``: ``config.json`` with ``architectures`` and ``dtype``, ``generation_config.json``
for a generative model, safetensors files split at ``max_shard_size`` (with ``model.safetensors.index.json``:
``metadata.total_size`` and ``weight_map``), tied weights written once by the model's own tie rules
(``_tied_weights_keys``, ``tie_word_embeddings``). The config is the model's ``config.to_dict()``, which the Trainer
saves in every checkpoint of a ``transformers`` model (``hf_config``), or the ``config`` given; a config whose model
expects other weight names or shapes than the checkpoint holds is refused. Memory: the whole model once, in its
stored dtype.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

FORMATS = ("safetensors",)
MAX_SHARD_SIZE = "50GB"  # save_pretrained's default (transformers 5)


def export(checkpoint: str | Path, out: str | Path, format: str = "safetensors", config: Any = None,
           verify: bool = True, tokenizer: Any = None, max_shard_size: int | str = MAX_SHARD_SIZE) -> Path:
    """Write the model of trainscale checkpoint ``checkpoint`` to the new directory ``out`` as its class's
    ``save_pretrained`` would, which ``transformers.AutoModelForCausalLM.from_pretrained(out)`` (or the Auto class of
    its task, or ``pipeline(model=out)``, or a serving stack reading ``architectures``) loads with the same weights.

    Args:
        checkpoint: a checkpoint file (``epoch=E-step=S.ckpt``), a sharded checkpoint directory, or a run's
            ``checkpoints/last`` (the file that names the newest).
        out: the directory to create; it must not exist or be empty. Written under ``.<name>.tmp`` and
            renamed at the end: a failed export leaves nothing under ``out``.
        format: "safetensors" (the only one).
        config: None (the ``hf_config`` the checkpoint holds), a ``transformers`` config, its ``to_dict()``, or
            the path of a ``config.json`` or of a directory holding one (e.g. the one the run started from; its
            ``generation_config.json``, if any, is written too). The model class is the config's
            ``architectures``; without one, the class of the config's ``model_type`` whose weights the checkpoint
            holds (the causal LM, sequence classifier, ...).
        verify: check the checkpoint's SHA-256 files (``False``: a checkpoint you trust that has none).
        tokenizer: None, a tokenizer (anything with ``save_pretrained``), or the directory of one, written beside
            the weights (``AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)``).
        max_shard_size: the largest safetensors file, bytes or a string such as ``"5GB"`` (``save_pretrained``'s
            argument); a larger model is split into ``model-0000i-of-0000n.safetensors`` files and an index.

    Returns:
        ``out``.

    Raises:
        ValueError: an unknown ``format``, ``out`` not empty, a ``max_shard_size`` that is no positive size, no
            config (the checkpoint's model was not a ``transformers`` model and ``config`` was not given), a config
            path that holds no config.json, or a config that disagrees with the weights
            (another architecture or size: the message names the missing, unexpected or differently shaped
            weights).
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
    _check_shard_size(max_shard_size)
    tokenizer = _tokenizer(tokenizer)
    state, extra = _read_model(_resolve(Path(checkpoint)), verify)
    hf_config = _config(config, extra.get("hf_config"), checkpoint)
    model = _model(hf_config, state, checkpoint)
    _generation_config(model, config)
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' notes on the config's defaults, not the user's doing
            model.save_pretrained(tmp, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
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
        ValueError: ``directory`` holds no safetensors file; a parameter or buffer of ``model`` is not in the files
            (a tied copy of one that is, e.g. a head tied to the token embedding, may be absent), naming the first
            ones.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    directory = Path(directory)
    if not directory.is_dir() or not any(directory.glob("*.safetensors")):
        what = "is not a directory" if not directory.is_dir() else "holds no .safetensors file"
        raise ValueError(f"{str(directory)!r} {what}: pass the directory `trainscale export` or save_pretrained wrote "
                         "(model.safetensors, or model-*.safetensors with model.safetensors.index.json)")
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
    ``state_dict`` (or ``model``) state dict, or a sharded directory of any mesh read whole (``checkpointer.read_module_checkpoint``)."""
    from trainscale.checkpointing.checkpointer import read_module_checkpoint
    from trainscale.runtime import checkpoint_io

    if path.is_dir():
        with warnings.catch_warnings():  # DCP's note that it reads in one process: what is meant here
            warnings.filterwarnings("ignore", message="torch.distributed is .*")
            entries, read_model = read_module_checkpoint(path, verify)
            return read_model(), entries
    content = checkpoint_io.load_file(path, verify)
    weights = next((content[k] for k in ("state_dict", "model") if isinstance(content, dict)
                    and isinstance(content.get(k), dict)), None)  # the Trainer's key, or a file written before it
    if weights is None:
        raise checkpoint_io.CheckpointError(f"{str(path)!r} is not a trainscale checkpoint (no 'state_dict' or "
                                            "'model' state dict)")
    return weights, content


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
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"config {str(config)!r} is neither a config.json nor a directory holding one; pass the "
                             "config.json the model was built from, or the directory it was loaded from")
        config = json.loads(file.read_text())
    values = dict(saved if config is None else config)
    if "model_type" not in values:
        raise ValueError("the config has no 'model_type'; pass the config.json the model was built from")
    return transformers.AutoConfig.for_model(values.pop("model_type"), **values)


def _check_shard_size(max_shard_size: int | str) -> None:
    """Refuse a ``max_shard_size`` that ``save_pretrained`` would read as no size or as zero bytes (it parses it with
    ``transformers.utils.hub.convert_file_size_to_int``), before the checkpoint is read.

    Raises:
        ValueError: not bytes or a size such as "5GB", or not positive.
    """
    from transformers.utils.hub import convert_file_size_to_int

    try:
        size = convert_file_size_to_int(max_shard_size)
    except (ValueError, TypeError):
        size = None
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r} (CLI: --max-shard-size) must be a positive size, bytes or "
                         "e.g. '5GB' or '500MB'")


def _tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` (anything with ``save_pretrained``), or the tokenizer a directory holds, loaded before anything is
    written: a directory without one fails the export at once.

    Raises:
        ValueError: the directory holds no tokenizer that ``AutoTokenizer`` loads.
    """
    if tokenizer is None or hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    import transformers

    path = Path(tokenizer)
    if not path.is_dir():
        raise ValueError(f"tokenizer {str(path)!r} is not a directory; pass the directory the tokenizer was saved to "
                         "(tokenizer.save_pretrained(DIR), or the model directory it came with)")
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{str(path)!r} holds no tokenizer that transformers.AutoTokenizer loads ({err}); pass the "
                         "directory tokenizer.save_pretrained wrote") from err


def _model(config: Any, state: dict, checkpoint: Any) -> Any:
    """The ``transformers`` model of ``config`` holding ``state``: built on the meta device, the checkpoint's tensors
    assigned (no copy), tied weights tied again by the model's own rules.

    Raises:
        ValueError: the config's class, or every class of its ``model_type``, expects other weights than ``state``;
            several classes fit and the config names none; a tied weight whose stored copies differ.
    """
    import torch

    problems, fits = [], []
    for cls in _classes(config):
        with torch.device("meta"):
            model = cls(config)
        count, problem = _disagreement(model, state)
        if count:
            problems.append((count, f"{cls.__name__} {problem}"))
        else:
            fits.append(model)
    if not fits:
        closest = min(problems)[1]
        raise ValueError(f"the config ({config.model_type}) and the weights of {str(checkpoint)!r} disagree: no "
                         f"{config.model_type} class takes them; the closest, {closest}. Pass the config the model was "
                         "trained with (--config), or export the checkpoint of this model")
    if len(fits) > 1:
        raise ValueError(f"the weights of {str(checkpoint)!r} fit several {config.model_type} classes "
                         f"({', '.join(type(m).__name__ for m in fits)}); pass a config whose 'architectures' names one")
    model = fits[0]
    _check_tied_copies(model, state)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model


def _classes(config: Any) -> list:
    """The ``PreTrainedModel`` classes ``config`` may describe: the first its ``architectures`` names, else every class
    of its ``model_type`` in transformers' Auto mappings (base model, causal LM, classifiers, ...).

    Raises:
        ValueError: ``architectures`` names a class this transformers does not have.
    """
    import transformers

    names = list(getattr(config, "architectures", None) or [])
    missing = [n for n in names if not hasattr(transformers, n)]
    if missing:
        raise ValueError(f"the config's architectures {missing} are not classes of transformers "
                         f"{transformers.__version__}; pass a config of a transformers model (--config)")
    classes = [getattr(transformers, n) for n in (names[:1] or _auto_class_names(config.model_type))
               if hasattr(transformers, n)]
    return [c for c in classes if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)]


def _auto_class_names(model_type: str) -> list[str]:
    """The model class names that transformers' Auto mappings (``MODEL_*_MAPPING_NAMES``) give ``model_type``."""
    from transformers.models.auto import modeling_auto

    names: list[str] = []
    for attr in sorted(a for a in dir(modeling_auto) if a.startswith("MODEL") and a.endswith("_MAPPING_NAMES")):
        found = getattr(modeling_auto, attr).get(model_type) or ()
        names.extend(n for n in ((found,) if isinstance(found, str) else found) if n not in names)
    return names


def _disagreement(model: Any, state: dict) -> tuple[int, str]:
    """``(how many names differ, what differs)`` between the weights ``model`` expects (names and shapes) and
    ``state``: ``(0, "")`` when they agree. A tied weight (``all_tied_weights_keys``: e.g. ``lm_head.weight`` tied to
    the token embedding) may be absent."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = sorted(set(expected) - set(state) - tied)
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k} {tuple(state[k].shape)} where it expects {expected[k]}" for k in sorted(set(state) & set(expected))
              if tuple(state[k].shape) != expected[k]]
    parts = [f"{label} {len(names)}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
             for label, names in (("expects weights the checkpoint lacks,", missing),
                                  ("does not take", unexpected), ("gets other shapes,", shapes)) if names]
    return len(missing) + len(unexpected) + len(shapes), "; ".join(parts)


def _check_tied_copies(model: Any, state: dict) -> None:
    """Raise ValueError when the checkpoint holds a tied weight (e.g. ``lm_head.weight``) whose values differ from its
    source's: the config ties what the model trained apart, and tying would drop trained values."""
    import torch

    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target in state and source in state and not torch.equal(state[target], state[source]):
            raise ValueError(f"the config ties {target} to {source} (tie_word_embeddings), but the checkpoint holds "
                             "different values for them; pass the config the model was trained with "
                             "(tie_word_embeddings=False)")


def _generation_config(model: Any, config: Any) -> None:
    """The ``generation_config.json`` beside a ``config`` directory (or file) given, as the model's generation config;
    otherwise the one the model derives from its config (``save_pretrained`` writes it for generative models)."""
    if not isinstance(config, (str, Path)):
        return
    path = Path(config)
    directory = path if path.is_dir() else path.parent
    if (directory / "generation_config.json").is_file() and model.can_generate():
        import transformers

        model.generation_config = transformers.GenerationConfig.from_pretrained(str(directory))
