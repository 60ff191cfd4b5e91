"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), shared by the sharded strategies.

A checkpoint is a directory: every rank writes its own shards of the modules and optimizers
(``__<rank>_0.distcp`` and ``.metadata``), rank zero the other entries (``trainscale_extra.pt``, with
its SHA-256). Every file has its SHA-256 in the manifest ``shards.sha256`` (``sha256sum -c`` reads it): each
rank hashes the shards it wrote, and rank zero, once every rank has written and the ``.metadata`` is on disk,
gathers their digests into it; a load verifies ``.metadata`` and every shard file it reads against it. Modules and optimizers are keyed by the module's own parameter names, so a checkpoint
loads on another world size or mesh shape (DCP reshards on load;
https://pytorch.org/docs/stable/distributed.checkpoint.html). Written under ``.<name>.tmp`` and renamed
by rank zero once every rank has finished: a crash leaves no half checkpoint under the final name.

A save may also go on in the background (``async_group``): torch's ``async_save`` copies the state to
host memory ("staging", the only part the caller waits for) and a thread writes the copy, its
collectives on a separate gloo group so they never interleave with training's. The directory is
published (renamed) by :meth:`AsyncSave.wait`, after the write ended, never before
(https://pytorch.org/docs/stable/distributed.checkpoint.html#torch.distributed.checkpoint.state_dict_saver.async_save).
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from trainscale.runtime import checkpoint_io

EXTRA = "trainscale_extra.pt"  # the non-sharded entries (loop position, RNG, scheduler, scaler)
MANIFEST = "shards.sha256"  # "<sha256>  <file>" per line, for every file of the checkpoint


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _shard_writer(path: Path):
    """DCP's ``FileSystemWriter`` for ``path`` that records the SHA-256 of every file (:data:`MANIFEST`) and marks
    the start and end of this rank's shard writes with ``checkpoint_io._write_event`` ("writing-shards",
    "shards-written"; the kill tests stop a write there).

    Each rank hashes the files it wrote (just written: read back from the page cache) into ``.<prefix>sha256.part``;
    ``finish`` runs on rank zero after every rank's ``write_data`` has returned, writes ``.metadata``, then merges
    the parts and the digests of ``.metadata`` and the extra file into the manifest."""
    from torch.distributed.checkpoint import FileSystemWriter

    class _ShardWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            checkpoint_io._write_event("writing-shards", path)
            written = super().write_data(plan, planner)  # FileSystemWriter writes before it returns
            files = sorted({result.storage_data.relative_path for result in written.value()})
            lines = "".join(f"{_sha256(path / name)}  {name}\n" for name in files)
            checkpoint_io.atomic_write_bytes(path / f".{plan.storage_data.prefix}sha256.part", lines.encode())
            checkpoint_io._write_event("shards-written", path)
            return written

        def finish(self, metadata, results) -> None:
            super().finish(metadata, results)
            parts = sorted(path.glob(".*sha256.part"))
            lines = "".join(part.read_text() for part in parts)
            lines += "".join(f"{_sha256(path / name)}  {name}\n" for name in (".metadata", EXTRA)
                             if (path / name).is_file())
            checkpoint_io.atomic_write_bytes(path / MANIFEST, lines.encode())
            for part in parts:
                part.unlink()

    return _ShardWriter(str(path))


def _read_manifest(path: Path) -> dict[str, str]:
    """The file → SHA-256 record of checkpoint ``path`` (:data:`MANIFEST`).

    Raises:
        CheckpointError: the checkpoint has none (written before trainscale recorded one, or not by trainscale).
    """
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise checkpoint_io.CheckpointError(
            f"checkpoint {str(path)!r} has no checksum manifest {MANIFEST!r}, so its shard files cannot be verified "
            "(a flipped bit would load silently); resume from a checkpoint written by this trainscale, or, if you "
            "trust this one, load it unverified with verify=False (Trainer.fit(ckpt_verify=False))")
    digests = {}
    for line in manifest.read_text().splitlines():
        digest, _, name = line.partition("  ")
        digests[name] = digest
    return digests


def _verify_files(path: Path, names: list[str], digests: dict[str, str]) -> None:
    """Raise unless every file of ``names`` in checkpoint ``path`` has the SHA-256 the manifest records."""
    for name in names:
        if name not in digests:
            raise checkpoint_io.CheckpointError(f"checkpoint {str(path)!r}: {name!r} is not in its checksum manifest "
                                                f"{MANIFEST!r}; resume from an earlier checkpoint or delete this one")
        if (path / name).is_file() and _sha256(path / name) != digests[name]:
            raise checkpoint_io.CheckpointError(
                f"checkpoint {str(path)!r}: {name!r} is corrupted ({(path / name).stat().st_size} bytes whose sha256 is "
                f"not the {digests[name][:12]}… recorded when it was written); resume from an earlier checkpoint or "
                "delete this one")


def _shard_reader(path: Path, digests: dict[str, str] | None):
    """DCP's ``FileSystemReader`` for ``path`` that verifies the shard files this rank reads against ``digests``
    (None: unverified), and names the file when one is missing or cannot be read (DCP's own error names none)."""
    from torch.distributed.checkpoint import FileSystemReader

    class _ShardReader(FileSystemReader):
        def read_data(self, plan, planner):
            files = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
            for name in files:
                if not (path / name).is_file():
                    raise checkpoint_io.CheckpointError(
                        f"checkpoint {str(path)!r} is missing its shard file {name!r}: the directory was copied in "
                        "part or a file was deleted; copy the whole checkpoint directory, or resume from an earlier "
                        "checkpoint")
            if digests is not None:
                _verify_files(path, files, digests)
            try:
                return super().read_data(plan, planner)
            except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as err:
                raise checkpoint_io.CheckpointError(
                    f"checkpoint {str(path)!r}: shard file(s) {', '.join(map(repr, files))} cannot be read "
                    f"({type(err).__name__}: {_first_line(err)}); truncated or corrupted: resume from an earlier "
                    "checkpoint or delete this one") from err

    return _ShardReader(str(path))


# What torch's zip writer (``torch.save`` into a DCP shard file) raises when the file system takes fewer bytes than it
# wrote: a full disk or quota, seen as "unexpected pos 64 vs 0" (caffe2/serialize/inline_container.cc).
_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed writing")


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:300]


def _clear_error(err: BaseException, path: Path, otherwise: str) -> checkpoint_io.CheckpointError:
    """One clear error for what a DCP save or load raised. torch's ``CheckpointException`` derives from
    ``BaseException`` (an ``except Exception`` misses it) and holds every failing rank's own error, each one
    the same on every rank: ours (a shard missing or unreadable, already clear), a full disk (named as such),
    or another, reported as ``otherwise`` with the first rank's error."""
    failures = getattr(err, "failures", None) or {None: (err, None)}
    causes = [(rank, failure[0] if isinstance(failure, tuple) else failure)
              for rank, failure in sorted(failures.items(), key=lambda item: str(item[0]))]
    for _, cause in causes:
        if isinstance(cause, checkpoint_io.CheckpointError):
            return checkpoint_io.CheckpointError(str(cause))
        if isinstance(cause, OSError) and cause.errno in checkpoint_io._DISK_FULL:
            return checkpoint_io.disk_full_error(path, cause)
        if isinstance(cause, RuntimeError) and any(s in str(cause) for s in _SHORT_WRITE):
            return checkpoint_io.disk_full_error(path, OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}, or "
                                                                             "the write was cut short: torch's "
                                                                             f"writer said {_first_line(cause)!r}"))
    rank, cause = causes[0]
    where = "" if rank is None else f" (rank {rank})"
    return checkpoint_io.CheckpointError(f"{otherwise}{where}: {type(cause).__name__}: {_first_line(cause)}")


def _is_checkpoint_failure(err: BaseException) -> bool:
    """An error of a DCP save or load: any ``Exception`` or torch's ``CheckpointException`` (a ``BaseException``),
    not a ``KeyboardInterrupt`` or ``SystemExit``."""
    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(err, (Exception, CheckpointException))


def _publish(tmp: Path, path: Path) -> None:
    """Rank zero's last act of a save: ``tmp`` (complete on every rank) becomes ``path``."""
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    checkpoint_io._fsync_dir(path.parent)


class AsyncSave:
    """A checkpoint directory being written in the background; published at :attr:`path` by :meth:`wait`.

    Attributes:
        path: where the checkpoint appears once published.
        write_s: seconds from the start of the background write to its end on this rank (None before).
    """

    def __init__(self, future: Any, tmp: Path, path: Path, rank: int) -> None:
        self.path, self.write_s = path, None
        self._future, self._tmp, self._rank, self._published, self._failed = future, tmp, rank, False, False
        self._started = time.perf_counter()
        future.add_done_callback(self._ended)  # run by the writer thread as the write ends

    def _ended(self, _future: Any = None) -> None:
        if self.write_s is None:
            self.write_s = time.perf_counter() - self._started

    def done(self) -> bool:
        """Whether this rank's background write has ended (a check that never blocks)."""
        return self._future.done()

    def wait(self) -> Path | None:
        """Block until this rank's write has ended, then publish: rank zero renames the temporary directory to
        :attr:`path` (its write ends after every rank's shards and the metadata are on disk: DCP gathers the
        ranks' results there). Idempotent. Other ranks may return before rank zero has renamed.

        Raises:
            CheckpointError: the write failed on some rank (DCP reports it to every rank); the temporary
                directory is removed and nothing is published. Raised once: a later call returns None.
        """
        if self._failed:
            return None
        try:
            self._future.result()
        except BaseException as err:  # CheckpointException is a BaseException: one message for every rank
            if not _is_checkpoint_failure(err):
                raise
            self._failed = True
            if self._rank == 0:
                shutil.rmtree(self._tmp, ignore_errors=True)
            raise _clear_error(err, self.path, f"the background write of checkpoint {str(self.path)!r} failed "
                                               "and nothing was published") from err
        self._ended()  # result() may return before the writer thread has run the callback
        if self._rank == 0 and not self._published:
            _publish(self._tmp, self.path)
        self._published = True
        return self.path


def load_whole(path: Any, state: dict, rank: int, strategy: str, unwrap: Callable, verify: bool = True,
               read: Callable | None = None, before_restore: Callable[[dict], None] | None = None,
               strict: bool = True) -> dict:
    """``load_checkpoint`` of the strategies whose ranks hold whole models (single, ddp, dp): a checkpoint file
    (``checkpoint_io.load_replicated``, its bytes from ``read``: as in ``checkpoint_io.load_file``), or a DCP
    directory written by a sharded strategy on any mesh, whose shards every rank reads into its whole tensors
    (modules of ``state`` unwrapped first). ``before_restore``: as in ``load_replicated`` for a file,
    as in :meth:`DCPCheckpointer.load` for a directory; ``strict`` as in both. Raises as those do."""
    import torch

    path = Path(path)
    if not (path.is_dir() and (path / ".metadata").is_file()):
        return checkpoint_io.load_replicated(path, state, unwrap, verify, read, before_restore, strict)
    whole = {key: unwrap(value) if isinstance(value, torch.nn.Module) else value for key, value in state.items()}
    return DCPCheckpointer(rank, strategy).load(path, whole, verify, before_restore, strict)


def read_whole(path: Any, key: str, verify: bool = True) -> dict:
    """Entry ``key`` (e.g. "model") of the DCP checkpoint ``path`` read whole into this one process, whatever mesh
    wrote it: ``{name: tensor}`` on the CPU, each tensor allocated from the checkpoint's metadata (its global
    shape and dtype) and filled from every shard by ``dcp.load(..., no_dist=True)``, which needs no process group
    (and starts no collective when one exists). Non-tensor items of the entry are left out. ``verify``: the
    ``.metadata`` and shard files are checked against the manifest first (:data:`MANIFEST`).

    Raises:
        CheckpointError: the checkpoint has no entry ``key``, a file fails its checksum, a shard is missing.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    digests = _read_manifest(path) if verify else None
    if digests is not None:
        _verify_files(path, [".metadata"], digests)
    reader = _shard_reader(path, digests)
    prefix = f"{key}."
    whole = {name[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
             for name, meta in reader.read_metadata().state_dict_metadata.items()
             if name.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    if not whole:
        raise checkpoint_io.CheckpointError(f"checkpoint {str(path)!r} holds no tensors under {key!r}")
    try:
        dcp.load({key: whole}, storage_reader=reader, no_dist=True)
    except BaseException as err:  # CheckpointException is a BaseException: `except Exception` would miss it
        if not _is_checkpoint_failure(err):
            raise
        raise _clear_error(err, path, f"checkpoint {str(path)!r} cannot be read: a shard is corrupted or "
                                      "truncated; resume from an earlier checkpoint or delete it") from err
    return whole


def _without_absent_tensor_states(sharded: dict, metadata) -> dict:
    """``sharded`` without the ``TensorState`` entries the checkpoint lacks (written before they existed): those
    keep their tensors, as a checkpoint file does (``checkpoint_io.load_replicated``)."""
    saved = list(metadata.state_dict_metadata)
    return {k: v for k, v in sharded.items()
            if not isinstance(v, checkpoint_io.TensorState) or any(fqn.startswith(f"{k}.") for fqn in saved)}


class _ModelState:
    """DCP ``Stateful`` view of a (sharded) module: its keys are the module's own FQNs."""

    def __init__(self, module, strict: bool = True) -> None:
        self.module, self.strict = module, strict

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_state_dict(self, state_dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        from torch.distributed.checkpoint.state_dict import StateDictOptions

        set_model_state_dict(self.module, state_dict, options=StateDictOptions(strict=self.strict))


class _OptimizerState:
    """DCP ``Stateful`` view of an optimizer, keyed by parameter FQNs of ``module`` (not ids)."""

    def __init__(self, module, optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state_dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, state_dict)


class DCPCheckpointer:
    """Save and load a state dict of modules, optimizers and plain values as a DCP directory.

    Args:
        rank: this process's global rank (rank zero writes the extra file and renames).
        strategy: the strategy's name, for error messages.
        before: called before every save and load (fsdp reshards its root modules there).
    """

    def __init__(self, rank: int, strategy: str, before: Callable[[], None] = lambda: None) -> None:
        self.rank, self.strategy, self.before = rank, strategy, before
        self._pending: AsyncSave | None = None  # the background save in flight

    def _split(self, state: dict, strict: bool = True):
        """DCP ``Stateful``s for modules (``strict``: as their ``load_state_dict``'s), optimizers and
        ``TensorState``s; everything else goes to the extra file."""
        import torch

        modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
        sharded, extra = {}, {}
        for key, value in state.items():
            if isinstance(value, torch.nn.Module):
                sharded[key] = _ModelState(value, strict)
            elif isinstance(value, torch.optim.Optimizer):
                sharded[key] = _OptimizerState(self._owner(key, value, modules), value)
            elif isinstance(value, checkpoint_io.TensorState):  # e.g. an average of the weights: sharded alike
                sharded[key] = value
            else:
                extra[key] = value
        return sharded, extra

    def save(self, path: Any, state: dict, async_group: Any = None) -> AsyncSave | None:
        """Write ``path/``: each rank its shards, rank zero the other entries; all ranks must call it. A save
        in flight is published first.

        A failed write (a full disk: "no space left on device") raises on every rank and removes the
        temporary directory.

        Args:
            async_group: None: write before returning. A gloo process group of all ranks: return once the
                state is staged (copied to host memory) and the extra file written; the shards are written
                by a background thread (``dcp.async_save``, its collectives on this group) and published by
                the returned :class:`AsyncSave`'s ``wait()``.

        Raises:
            CheckpointError: rank zero could not write the extra file (raised on every rank), or the save
                in flight before failed.
        """
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.wait()
        path = Path(path)
        tmp = path.parent / f".{path.name}.tmp"
        self.before()
        sharded, extra = self._split(state)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        try:
            self._save_extra(extra, tmp / EXTRA)
            if async_group is not None:
                future = dcp.async_save(sharded, storage_writer=_shard_writer(tmp), process_group=async_group)
                self._pending = AsyncSave(future, tmp, path, self.rank)
                return self._pending
            dcp.save(sharded, storage_writer=_shard_writer(tmp))  # raises on every rank when one rank's write fails
        except BaseException as err:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if not _is_checkpoint_failure(err) or isinstance(err, checkpoint_io.CheckpointError):
                raise
            raise _clear_error(err, path, f"the write of checkpoint {str(path)!r} failed") from err
        if self.rank == 0:
            _publish(tmp, path)
        return None

    def wait(self) -> None:
        """Publish the background save in flight, if any (:meth:`AsyncSave.wait`)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def _save_extra(self, extra: dict, path: Path) -> None:
        """Rank zero writes ``extra``; its error, if any, is raised on every rank (in place of a barrier,
        which would leave the others waiting for a rank that has raised)."""
        import torch.distributed as dist

        error = [None]
        if self.rank == 0:
            try:
                checkpoint_io.save_file({k: (v.state_dict() if checkpoint_io._is_stateful(v) else v)
                                         for k, v in extra.items()}, path)
            except Exception as err:  # noqa: BLE001 - sent to the other ranks, raised below
                error = [f"{type(err).__name__}: {err}"]
                dist.broadcast_object_list(error, src=0)
                raise
        dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise checkpoint_io.CheckpointError(f"rank 0 failed to write the checkpoint: {error[0]}")

    def load(self, path: Any, state: dict, verify: bool = True,
             before_restore: Callable[[dict], None] | None = None, strict: bool = True) -> dict:
        """Restore the modules and optimizers of ``state`` from ``path`` (any world size or mesh; DCP reshards,
        the optimizer state through ``set_optimizer_state_dict``), the other stateful objects from its extra
        file; return the plain entries. ``before_restore(entries)`` sees the extra file's entries as soon as it is
        read, before any tensor or object is restored (the weights are not among them: Lightning's sharded load
        gives its ``on_load_checkpoint`` the same), and may change them; an error it raises (on every rank, which
        all read the extra file) leaves the model and optimizers as they were. ``verify``: check the extra
        file's SHA-256, and ``.metadata`` and every shard file this rank reads against the checkpoint's manifest
        (:data:`MANIFEST`); refuse a checkpoint without them. ``strict=False``: the modules' weights the checkpoint
        lacks keep their values (DCP's partial load), its weights no module has are ignored.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            CheckpointError: ``path`` is not a DCP checkpoint directory, a file has no checksum or does not
                match it (``verify=True``, naming the file), a shard file is missing, or it does not fit.
        """
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.wait()
        path = Path(path)
        self._check_directory(path)
        extra = checkpoint_io.load_file(path / EXTRA, verify)
        if before_restore is not None:
            before_restore(extra)
        digests = _read_manifest(path) if verify else None
        if digests is not None:
            _verify_files(path, [".metadata"], digests)
        self.before()
        sharded, others = self._split(state, strict)
        sharded = _without_absent_tensor_states(sharded, _shard_reader(path, None).read_metadata())
        try:  # one process without a process group (strategy "single") reads every shard itself
            dcp.load(sharded, storage_reader=_shard_reader(path, digests), no_dist=not dist.is_initialized(),
                     planner=None if strict else dcp.DefaultLoadPlanner(allow_partial_load=True))
        except BaseException as err:  # DCP raises CheckpointException (a BaseException) / RuntimeError / KeyError
            if not _is_checkpoint_failure(err):
                raise
            raise _clear_error(err, path, f"checkpoint {str(path)!r} does not fit the model or optimizer") from err
        for key, value in others.items():
            if checkpoint_io._is_stateful(value):
                if key not in extra:
                    raise checkpoint_io.CheckpointError(f"checkpoint {str(path)!r} has no entry {key!r}")
                value.load_state_dict(extra[key])
        return {k: v for k, v in extra.items() if not (k in state and checkpoint_io._is_stateful(state[k]))}

    def _check_directory(self, path: Path) -> None:
        """Raise unless ``path`` is a DCP checkpoint directory with its extra file (see :meth:`load`)."""
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
        if path.is_dir() and not (path / ".metadata").is_file():
            raise checkpoint_io.CheckpointError(
                f"checkpoint {str(path)!r} is a directory but not a sharded checkpoint (no .metadata in it); pass "
                f"a checkpoint directory <run>/checkpoints/epoch=E-step=S.ckpt written by strategy={self.strategy!r}, or "
                "ckpt_path='last'")
        if not (path / ".metadata").is_file() or not (path / EXTRA).is_file():
            raise checkpoint_io.CheckpointError(
                f"checkpoint {str(path)!r} is not a sharded (DCP) checkpoint directory written by "
                f"strategy={self.strategy!r}; resume a 'single'/'ddp' checkpoint file with that strategy")

    def _owner(self, key: str, optimizer, modules: dict):
        """The module of ``modules`` that holds all parameters of ``optimizer`` (DCP keys optimizer
        state by that module's parameter names)."""
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module in modules.values():
            if wanted <= {id(p) for p in module.parameters()}:
                return module
        raise ValueError(f"cannot checkpoint optimizer {key!r} under strategy={self.strategy!r}: no module in the "
                         f"same state dict ({', '.join(modules) or 'none'}) holds all its parameters; pass the model too")
