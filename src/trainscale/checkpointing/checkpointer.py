"""The one place that collects all training state into a checkpoint and puts it back.

State (torchtitan's fixed keys, with Lightning's name for the weights): ``state_dict`` (the model's weights, in a
checkpoint file as in Lightning's; ``model`` in a sharded DCP directory, as Lightning's ``FSDPStrategy`` writes it,
and in the checkpoint files written before: :func:`weights_key`), ``optimizer`` (``optimizer_1``... for more),
``scheduler`` (``scheduler_1``...), ``train_state`` (:class:`~trainscale.loop.state.TrainState`),
``loop`` (the position in the epoch; mid-epoch, with every rank's state of a training loader that keeps
its own, ``loader_states``: ``checkpointing/loader_state.py``), ``rng`` (every rank's RNG states), ``callbacks`` (each
callback's ``state_dict``; its ``TensorState`` values as entries of their own, ``callbacks/<key>/<name>``, sharded
like the model: a callback with ``setup_state(model)`` makes them before a load), ``world_size``,
``optimizer_classes``, ``epoch`` and ``global_step`` (Lightning's keys: ``trainer.current_epoch`` and
``trainer.global_step`` when written; a resume reads ``loop``), for a Hugging Face model ``hf_config`` (its ``config.to_dict()``) and, for a module with ``save_hyperparameters()``, ``hyper_parameters`` (Lightning's key)
and ``module_class``, which ``TrainingModule.load_from_checkpoint`` rebuilds the module from
(:func:`read_module_checkpoint`; the data module's as ``datamodule_hyper_parameters``: :func:`hparams_entries`), and
``pickled_entries``: the entries an ``on_save_checkpoint`` hook added and the callbacks' states that
``torch.load(weights_only=True)`` could not read, kept apart as bytes (:func:`keep_apart_unreadable`). Writing is the Runtime's
(atomic file + SHA-256, or a DCP directory under fsdp); naming, ``last`` and rotation are
``trainscale.checkpointing.run_dirs``'s.
"""

from __future__ import annotations

import os
import pickle
import re
import time
import urllib.parse
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from trainscale.checkpointing import rng, run_dirs as ckpt
from trainscale.runtime import hf
from trainscale.checkpointing.train_state import ResumePoint, TrainState
from trainscale.runtime.checkpoint_io import CheckpointError, TensorState
from trainscale.utilities.parsing import pickled

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime


def _keyed(prefix: str, objects) -> dict[str, Any]:
    return {prefix if i == 0 else f"{prefix}_{i}": obj for i, obj in enumerate(objects)}


def weights_key(sharded: bool) -> str:
    """The checkpoint entry of the model's weights: "state_dict" in a checkpoint file (Lightning's key:
    ``torch.load(path)["state_dict"]``), "model" in a sharded (DCP) directory (its tensors' names start with
    ``model.``, as in Lightning's ``FSDPStrategy``). A file written with "model" still loads
    (``checkpoint_io.FORMER_NAMES``)."""
    return "model" if sharded else "state_dict"


def is_sharded(path: Path) -> bool:
    """Whether checkpoint ``path`` is a sharded (DCP) directory rather than one file."""
    return path.is_dir() and (path / ".metadata").is_file()


def save(runtime: Runtime, target: Path, fit: Any, state: TrainState, optimizers, schedulers, callbacks: dict,
         on_save: Callable[[dict], None] | None = None, asynchronous: bool = False,
         plateau_pending: dict | None = None) -> tuple[Path, Any]:
    """Write a checkpoint of the running ``fit`` (a ``FitRun``) to ``target`` (a file, or a directory under a
    sharding strategy). All ranks
    call it; ends with a barrier, or (``asynchronous``) once the state is staged (``Runtime.save``).
    ``on_save(checkpoint)`` sees the dict before it is written and may add keys (Lightning's
    ``Callback.on_save_checkpoint``); a key it adds, or a callback's state, holding an object a weights-only load
    refuses is kept apart as bytes (:func:`keep_apart_unreadable`), so that the checkpoint still loads weights-only.
    ``plateau_pending``: the "step" ``ReduceLROnPlateau`` update this checkpoint precedes (``{"count", "metrics"}``,
    saved under ``loop``; ``ResumePoint.plateau_pending``), or None.

    Returns:
        The path (a file, or a DCP directory under a sharding strategy) and None, or the ``AsyncSave`` that
        publishes it there.

    Raises:
        TypeError: a key ``on_save`` added, or a callback's state, holds an object ``pickle`` cannot write (named;
            nothing is written).
    """
    complete = state.batches >= fit.epoch_batches
    totals = [*fit.epoch_loss.totals(runtime)[:3], time.perf_counter() - fit.started]  # loss sum, samples, tokens, s
    sampler = getattr(fit.train_loader, "sampler", None)
    consumed = (sampler.consumed_after(state.batches - fit.epoch_offset, fit.train_loader.batch_size)
                if hasattr(sampler, "consumed_after") else None)
    positions = fit.loader_positions  # a loader that keeps its own position: its state per rank, mid-epoch
    loader_states = None if positions is None or complete else runtime.all_gather_object(
        positions.state_after(state.batches - fit.epoch_offset))
    content = {weights_key(runtime.strategy.sharded_checkpoints): fit.model, **_keyed("optimizer", optimizers),
               **_keyed("scheduler", [s.scheduler for s in schedulers]),
               "train_state": state.state_dict(), "rng": runtime.all_gather_object(rng.rng_state()),
               "world_size": runtime.world_size, "callbacks": callbacks,
               "epoch": state.current_epoch, "global_step": state.global_step,  # Lightning's keys
               "optimizer_classes": [type(o).__name__ for o in optimizers],
               "loop": {"epoch": state.epoch, "complete": complete, "consumed": consumed, "batches": state.batches,
                        "totals": None if complete else totals, "loader_states": loader_states,
                        "plateau_pending": plateau_pending}}
    content.update(hparams_entries(fit.model, fit.datamodule))
    if (hf_config := hf.config_dict(fit.model)) is not None:  # config.json for `trainscale export`
        content["hf_config"] = hf_config
    fixed = set(content)
    content.update(datamodule_state(fit.datamodule))  # before the hooks, as Lightning's; kept apart when pickled
    if on_save is not None:
        _call_with_state_views(on_save, content, optimizers, schedulers)
    content["callbacks"], tensor_states = _split_tensor_states(content["callbacks"])
    keep_apart_unreadable(content, [key for key in content if key not in fixed])
    return target, runtime.save(target, {**content, **tensor_states}, asynchronous=asynchronous)


def datamodule_state(datamodule: Any) -> dict[str, Any]:
    """A stateful data module's entry of a checkpoint (Lightning's ``_dump_checkpoint``): ``{its class's
    __qualname__: datamodule.state_dict()}`` when that state is not empty, else nothing."""
    state = datamodule.state_dict() if callable(getattr(datamodule, "state_dict", None)) else None
    return {type(datamodule).__qualname__: state} if state else {}


def restore_datamodule(datamodule: Any, checkpoint: dict) -> None:
    """Give a data module the state :func:`datamodule_state` saved in ``checkpoint`` (``load_state_dict``), as
    Lightning's ``restore_datamodule``; nothing when it saved none or has no such hook."""
    key = type(datamodule).__qualname__
    if datamodule is not None and key in checkpoint and callable(getattr(datamodule, "load_state_dict", None)):
        datamodule.load_state_dict(checkpoint[key])


# Lightning's checkpoint keys for the optimizers' and schedulers' states, shown to on_save_checkpoint only
_STATE_VIEWS = ("optimizer_states", "lr_schedulers")


def _call_with_state_views(on_save: Callable[[dict], None], content: dict, optimizers, schedulers) -> None:
    """``on_save(content)`` with Lightning's ``optimizer_states`` and ``lr_schedulers`` (lists of state dicts, in
    ``configure_optimizers``' order) in ``content`` while it runs, then taken out again: the file holds those states
    once, under trainscale's ``optimizer``/``scheduler`` keys, which a resume reads; so the two lists are a view for
    the hook to read (what it changes in them is not saved). A ``state_dict()`` holds references to the tensors, not
    copies."""
    content["optimizer_states"] = [o.state_dict() for o in optimizers]
    content["lr_schedulers"] = [s.scheduler.state_dict() for s in schedulers]
    try:
        on_save(content)
    finally:
        for key in _STATE_VIEWS:
            content.pop(key, None)


def strict_loading(model: Any) -> bool:
    """Whether ``model``'s weights are loaded strictly (every weight present, none extra): its ``strict_loading``
    attribute (Lightning's ``LightningModule.strict_loading``, which a module that saves only some weights sets
    False), True for a module without one."""
    return getattr(model, "strict_loading", True) is not False


def load(runtime: Runtime, path: Path, model: Any, optimizers, schedulers, state: TrainState,
         callbacks=(), verify: bool = True, on_load: Callable[[dict], None] | None = None,
         weights_only: bool | None = None) -> tuple[ResumePoint, dict]:
    """Restore model, optimizers, schedulers, ``state`` and the ``callbacks``' states in place from ``path``.
    ``on_load(checkpoint)`` (Lightning's ``on_load_checkpoint`` hooks) sees the checkpoint as read before anything
    is restored from it, and its changes take effect: in a file the weights are under ``state_dict``, a state
    dict (``Runtime.load``'s ``before_restore``). The weights are loaded strictly unless the module sets
    ``strict_loading = False`` (:func:`strict_loading`), as Lightning's resume. ``weights_only=False`` (Lightning's argument: only for a checkpoint
    you trust) unpickles the entries the save kept apart (``pickled_entries``) back into their places first
    (:func:`restore_pickled`), so that the hooks and the callbacks' ``load_state_dict`` see them as saved.

    Returns:
        The resume point and the checkpoint's other entries (``train_state``, ``loop``, ``callbacks``: the
        callbacks' saved states by ``state_key``, and any key a callback's ``on_save_checkpoint`` added). A
        callback whose ``state_key`` is absent reads the class-named entry of an older checkpoint, if any
        (Lightning's ``_legacy_state_key``).

    Raises:
        ValueError: the checkpoint's optimizers are of other classes than the configured ones (e.g. Adam
            saved, SGD configured): resume with the same optimizer, or start fresh.
        CheckpointError: the checkpoint holds pickled entries and ``weights_only`` is not False; raised on every
            rank before anything is restored.
    """
    configured = [[g["lr"] for g in o.param_groups] for o in optimizers]
    for cb in callbacks:
        if hasattr(cb, "setup_state"):  # its tensors made (for the model) before the checkpoint is read into them
            cb.setup_state(model)
    _, tensor_states = _split_tensor_states({cb.state_key: cb.state_dict() for cb in callbacks})
    objects = {weights_key(is_sharded(Path(path))): model, **_keyed("optimizer", optimizers),
               **_keyed("scheduler", [s.scheduler for s in schedulers]), **tensor_states}

    def read(entries: dict) -> None:  # before anything is restored: what was kept apart, then the hooks
        if "pytorch-lightning_version" in entries and "train_state" not in entries:
            raise CheckpointError(f"{str(path)!r} was written by Lightning: trainscale resumes only its own "
                                  "checkpoints (their loop, sampler and random states); load the weights with "
                                  "YourModule.load_from_checkpoint(path) and start a new fit (ckpt_path=None)")
        restore_pickled(entries, weights_only, path)
        if on_load is not None:
            on_load(entries)

    rest = runtime.load(path, objects, verify=verify, before_restore=read,  # verify=False: the user's opt-out
                        strict=strict_loading(model))
    _check_optimizer_classes(path, rest.get("optimizer_classes"), optimizers)
    _say_which_lr_wins(runtime, configured, optimizers)
    point = _resume_point(runtime, rest, state)
    if point.rng is not None and point.complete:
        rng.set_rng_state(point.rng)  # mid-epoch: restored after the epoch's loader iterator is made, as when saved
    where = (f"end of epoch {point.epoch + 1}" if point.complete else f"epoch {point.epoch + 1}, "
             + (f"batch {point.batches}" if point.consumed is None else f"sample {point.consumed}"))
    runtime.print(f"trainscale: resumed from {path} ({where}, step {state.global_step})")
    states = dict(rest.get("callbacks") or {})
    _warn_missing_callbacks(runtime, states, callbacks)
    for cb in callbacks:
        state = states.get(cb.state_key, states.get(cb._legacy_state_key))
        if state is not None:
            cb.load_state_dict(state)
    return point, rest


def _warn_missing_callbacks(runtime: Runtime, states: dict, callbacks) -> None:
    """A ``UserWarning`` (rank zero) naming the callbacks whose saved state no callback of this run reads, in
    Lightning's words (``trainer/call.py``, ``_call_callbacks_on_load_checkpoint``); a state that is empty (a
    callback with nothing to keep) is not missed."""
    known = {key for cb in callbacks for key in (cb.state_key, cb._legacy_state_key)}
    missing = [key for key, state in states.items() if state and key not in known]
    if missing and runtime.is_rank_zero:
        warnings.warn("Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be "
                      f"provided during `Trainer` instantiation. Please add the following callbacks: {missing}; "
                      "their saved state is not restored", UserWarning, stacklevel=4)


# what a checkpoint read with ``torch.load(weights_only=True)`` may hold: a hyperparameter of another type
# (a module, a function) would make the whole checkpoint unreadable, so it is left out (and named)
_PLAIN = (type(None), bool, int, float, str)


def _is_plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN) or type(value).__name__ == "Tensor" and type(value).__module__ == "torch"


def hparams_entries(model: Any, datamodule: Any = None) -> dict:
    """The checkpoint entries of the hyperparameters ``model`` and ``datamodule`` saved (``save_hyperparameters()``),
    under Lightning's keys: none for one without them; else ``hyper_parameters`` (the values of plain types: None,
    bool, int, float, str, tensors, and lists, tuples and str-keyed dicts of them, which ``torch.load(path,
    weights_only=True)`` reads), ``hparams_name`` (the ``__init__`` argument one container came in, or
    "kwargs"), ``hparams_left_out`` (the names of the values of other types) and ``hparams_pickled`` (those of
    them ``pickle`` can write, each pickled into bytes: read by ``load_from_checkpoint(..., weights_only=False)``
    only), and ``module_class`` (``module.QualName``); the data module's keys start with ``datamodule_``."""
    entries: dict[str, Any] = {}
    for obj, prefix in ((model, ""), (datamodule, "datamodule_")):
        saved = dict(getattr(obj, "hparams", None) or {})
        if not saved:
            continue
        others = {k: v for k, v in saved.items() if not _is_plain(v)}
        entries.update({f"{prefix}hyper_parameters": {k: v for k, v in saved.items() if k not in others},
                        f"{prefix}hparams_name": getattr(obj, "_hparams_name", None),
                        f"{prefix}hparams_left_out": sorted(others),
                        f"{prefix}hparams_pickled": {k: b for k, v in others.items() if (b := pickled(v)) is not None}})
    if entries.get("hyper_parameters") is not None:
        entries["module_class"] = f"{type(model).__module__}.{type(model).__qualname__}"
    return entries


PICKLED_ENTRIES = "pickled_entries"


def keep_apart_unreadable(content: dict, added: list[str]) -> None:
    """Move out of ``content`` the entries of ``added`` (keys an ``on_save_checkpoint`` hook added) and the states
    in ``content["callbacks"]`` that ``torch.load(weights_only=True)`` would refuse (an object of a class of your
    own: torch's ``get_unsafe_globals_in_checkpoint`` names it), each as the bytes ``torch.save`` writes for it, in
    ``content["pickled_entries"]``: a list of ``{"path": [key] or ["callbacks", state_key], "types": [names],
    "data": bytes}``, which a weights-only load reads without running anything (:func:`restore_pickled` puts them
    back). Plain values, and objects with ``state_dict``/``load_state_dict`` (the Runtime saves their states), stay.

    Raises:
        TypeError: such an entry holds an object ``pickle`` cannot write (a lambda, a local class, an open file),
            naming the entry and what to do.
    """
    from trainscale.runtime.checkpoint_io import _is_stateful

    places = [((key,), content[key]) for key in added]
    places += [(("callbacks", key), state) for key, state in content["callbacks"].items()]
    records = []
    for where, value in places:
        if _is_plain(value) or _is_stateful(value) or isinstance(value, TensorState):
            continue
        data, types = _saved_with_types(where, value)
        if types:
            records.append({"path": list(where), "types": types, "data": data})
            parent = content["callbacks"] if len(where) == 2 else content
            del parent[where[-1]]
    if records:
        content[PICKLED_ENTRIES] = records


def _saved_with_types(where: tuple, value: Any) -> tuple[bytes, list[str]]:
    """``torch.save(value)``'s bytes and the globals in them that a weights-only load refuses."""
    import io

    import torch

    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise TypeError(f"checkpoint entry {_entry_name(where)} ({type(value).__qualname__}) cannot be saved: pickle "
                        f"cannot write it ({err}); keep there plain values (numbers, strings, lists, dicts, tensors) "
                        "or objects of classes defined at a module's top level, not a lambda, a local function or "
                        "class, or an open file") from err
    buffer.seek(0)
    return buffer.getvalue(), torch.serialization.get_unsafe_globals_in_checkpoint(buffer)


def _entry_name(where) -> str:
    return f"callbacks[{where[1]!r}]" if len(where) == 2 else repr(where[0])


def restore_pickled(entries: dict, weights_only: bool | None, path: Any) -> None:
    """Put the entries :func:`keep_apart_unreadable` kept apart (``entries["pickled_entries"]``) back in their
    places in ``entries``, unpickled (``torch.load(weights_only=False)``, on the CPU): with ``weights_only=False``
    only. Nothing to do for a checkpoint without them.

    Raises:
        CheckpointError: there are such entries and ``weights_only`` is not False: names them, their types and
            ``weights_only=False``.
    """
    import io

    import torch

    from trainscale.runtime.checkpoint_io import CheckpointError

    records = entries.pop(PICKLED_ENTRIES, None) or []
    if records and weights_only is not False:
        held = "; ".join(f"{_entry_name(r['path'])}: {', '.join(r['types'])}" for r in records)
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds objects that on_save_checkpoint or a callback's state_dict() saved and "
            f"that a weights-only load refuses ({held}); they are kept apart, pickled, and read only with "
            "weights_only=False, which runs their pickled code: pass weights_only=False (e.g. trainer.fit(model, "
            "ckpt_path=..., weights_only=False)) only for a checkpoint you trust. Nothing was restored")
    for record in records:
        parent = entries if len(record["path"]) == 1 else entries.setdefault("callbacks", {})
        parent[record["path"][-1]] = torch.load(io.BytesIO(record["data"]), map_location="cpu", weights_only=False)


def local_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` as a local path; an ``http://`` or ``https://`` URL is downloaded first, as Lightning's
    ``load_from_checkpoint`` does (``torch.hub.load_state_dict_from_url``): into torch hub's cache,
    ``<torch.hub.get_dir()>/checkpoints/<the URL's file name>`` (``$TORCH_HOME/hub``, by default
    ``~/.cache/torch/hub``), through a temporary file renamed into place (``torch.hub.download_url_to_file``), and
    read from there on later calls without downloading again (torch's rule: delete the file to fetch a new one).

    Raises:
        ValueError: a URL of another scheme (``s3://``, ``gs://``): trainscale reads local files and HTTP(S) only.
        urllib.error.URLError: the download failed (an unreachable host; ``HTTPError`` for a missing file).
    """
    import torch

    text = os.fspath(path)
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", text)
    if scheme is None:
        return Path(text)
    if scheme.group(1).lower() not in ("http", "https"):
        raise ValueError(f"checkpoint {text!r} is a {scheme.group(1)}:// URL: trainscale reads checkpoints from local "
                         "paths and http(s):// URLs; copy it to a local (or mounted) file and pass that path")
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urllib.parse.urlparse(text).path)
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        torch.hub.download_url_to_file(text, str(cached), progress=True)
    return cached


def read_module_checkpoint(path: str | os.PathLike, verify: bool = True,
                           map_location: Any = "cpu") -> tuple[dict, Callable[[], dict]]:
    """Read a checkpoint in this one process, without a process group: a file of a single/ddp run or a sharded
    (DCP) directory of an fsdp/model_parallel run, or an ``http(s)://`` URL of a file (:func:`local_checkpoint`);
    also a file Lightning wrote (``pytorch-lightning_version``, ``state_dict``, ``hyper_parameters``), whose weights
    and hyperparameters are read the same way. Returns its plain entries (``hyper_parameters``, ...; no ``model``)
    and a function that reads the model's whole state dict (from a DCP directory every shard is read,
    ``dcp_checkpoint.read_whole``). Tensors are placed by ``map_location``, ``torch.load``'s argument (a device
    or its name, a dict from saved to new locations, or ``f(storage, location)``): applied by ``torch.load``
    to a file (each tensor's location: the device it was saved from); a DCP directory is read on the CPU, so
    there every tensor's location is "cpu".

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: neither a trainscale checkpoint (its weights and ``train_state``) nor a file Lightning
            wrote (its weights and ``pytorch-lightning_version``), a failed checksum (``verify``), an unreadable file.
        ValueError, urllib.error.URLError: a URL that is not http(s), a failed download (:func:`local_checkpoint`).

    Warns:
        UserWarning: the file records no SHA-256 (a checkpoint loaded, edited and saved back with plain
            ``torch.save``, as Lightning's docs show, or one Lightning wrote): it is read without verifying its bytes,
            as Lightning reads every file. A file whose recorded SHA-256 differs from its bytes is refused.
    """
    from trainscale.runtime import checkpoint_io
    from trainscale.runtime.strategies import dcp_checkpoint

    path = local_checkpoint(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist; pass a checkpoint file "
                                "(<run>/checkpoints/epoch=E-step=S.ckpt) or a sharded checkpoint directory")
    if ckpt.is_last_pointer(path):  # <run>/checkpoints/last: the checkpoint it names
        path = ckpt.read_last(path)
    sharded = is_sharded(path)
    entries = _read_plain_entries(path / dcp_checkpoint.EXTRA if sharded else path, verify, map_location)
    key = weights_key(sharded)
    if isinstance(entries, dict) and key not in entries:  # a file written before "state_dict"
        key = checkpoint_io.FORMER_NAMES.get(key, key)
    _check_module_entries(path, entries, key, sharded)
    model_state = entries.pop(key, None)
    if not sharded:
        return entries, lambda: model_state
    return entries, lambda: _mapped(dcp_checkpoint.read_whole(path, weights_key(True), verify), map_location)


def _read_plain_entries(file: Path, verify: bool, map_location: Any) -> Any:
    """``checkpoint_io.load_file(file, verify)``; a file that records no SHA-256 (a plain ``torch.save`` file: a
    checkpoint edited and saved back, or one Lightning wrote) is read unverified, with a ``UserWarning``, as
    Lightning reads every file."""
    from trainscale.runtime import checkpoint_io

    try:
        return checkpoint_io.load_file(file, verify, map_location=map_location)
    except checkpoint_io.NoDigestError as err:
        warnings.warn(f"{err.args[0].split(', so')[0]}: it was saved with plain torch.save (edited and saved back, "
                      "or written by another library), so it is loaded without verifying its bytes", stacklevel=4)
        return checkpoint_io.load_file(file, False, map_location=map_location)


def _check_module_entries(path: Path, entries: Any, key: str, sharded: bool) -> None:
    """Raise ``CheckpointError`` unless ``entries`` are a trainscale checkpoint's (its weights under ``key`` and
    ``train_state``) or those of a file Lightning wrote (``pytorch-lightning_version``, its weights under
    ``state_dict``: its weights and hyperparameters load alike)."""
    lightning_file = isinstance(entries, dict) and not sharded and "pytorch-lightning_version" in entries
    if (isinstance(entries, dict) and ("train_state" in entries or lightning_file)
            and (sharded or key in entries)):
        return
    keys = sorted(entries)[:8] if isinstance(entries, dict) else type(entries).__name__
    hint = (" (a Lightning checkpoint: load its weights with module.load_state_dict(torch.load(path)"
            "['state_dict']))" if isinstance(entries, dict) and "state_dict" in entries else "")
    raise CheckpointError(
        f"{str(path)!r} is not a trainscale checkpoint: it has no 'state_dict' and 'train_state' entries (it holds "
        f"{keys}){hint}; pass a checkpoint written by Trainer.fit or Trainer.save_checkpoint")


def _mapped(tensors: dict, map_location: Any) -> dict:
    """``torch.load``'s ``map_location`` applied to ``{name: tensor}`` on the CPU: each tensor goes through
    ``torch.save``/``torch.load`` in memory (one at a time), so that every form acts exactly as in ``torch.load``."""
    import io

    import torch

    if map_location in (None, "cpu"):
        return tensors
    out = {}
    for name, tensor in tensors.items():
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        buffer.seek(0)
        out[name] = torch.load(buffer, map_location=map_location, weights_only=True)
    return out


def _split_tensor_states(states: dict) -> tuple[dict, dict]:
    """The callbacks' states without their ``TensorState`` values, and those values as checkpoint entries
    ``callbacks/<state_key>/<name>``: written beside the model (sharded through DCP under the sharding strategies),
    not pickled whole by rank zero with the other callback values."""
    plain, tensors = {}, {}
    for key, state in states.items():
        items = state.items() if isinstance(state, dict) else ()
        plain[key] = {k: v for k, v in items if not isinstance(v, TensorState)} if items else state
        tensors.update((f"callbacks/{key}/{k}", v) for k, v in items if isinstance(v, TensorState))
    return plain, tensors


def _check_optimizer_classes(path: Path, saved: list | None, optimizers) -> None:
    current = [type(o).__name__ for o in optimizers]
    if saved is not None and list(saved) != current:
        raise ValueError(f"{path} was trained with optimizer(s) {', '.join(saved)} but {', '.join(current)} is "
                         "configured; resume with the same optimizer class, or start fresh (ckpt_path=None)")


def _resume_point(runtime: Runtime, rest: dict, state: TrainState) -> ResumePoint:
    """Fill ``state`` from a loaded checkpoint's plain values and say where to resume."""
    train, loop = rest["train_state"], rest["loop"]
    state.global_step = int(train["global_step"])
    state.epoch, state.epoch_ended = int(loop["epoch"]), bool(loop["complete"])  # current_epoch until the loop runs
    state.total_batches = int(train.get("total_batches", 0))  # absent from checkpoints written before it was kept
    # an epoch resumed mid-way gets its record again at its end: the partial one goes
    state.history = [r for r in train["history"] if loop["complete"] or r["epoch"] != loop["epoch"]]
    rngs = rest.get("rng") or []
    rng = rngs[runtime.rank] if len(rngs) == runtime.world_size else (rngs[0] if rngs else None)
    loaders = loop.get("loader_states") or []
    return ResumePoint(loop["epoch"], bool(loop["complete"]), loop["consumed"], int(loop["batches"]),
                       tuple(loop.get("totals") or (0.0, 0.0, 0.0)), rng, int(rest.get("world_size", runtime.world_size)),
                       loaders[runtime.rank] if len(loaders) == runtime.world_size else None, len(loaders),
                       loop.get("plateau_pending"))  # absent from checkpoints written before it was kept


def _say_which_lr_wins(runtime: Runtime, configured: list[list[float]], optimizers) -> None:
    restored = [[g["lr"] for g in o.param_groups] for o in optimizers]
    if restored != configured:
        runtime.print(f"trainscale: the checkpoint's learning rate(s) {restored} replace the configured {configured} "
                      "(optimizer state resumes as saved; to change it, set param_group['lr'] in a callback's "
                      "on_fit_start)")
