"""Checkpoint files that never corrupt.

A write goes to a temporary file in the target directory, is fsync'ed, then renamed over
the target with ``os.replace`` (atomic on POSIX), and the directory is fsync'ed so the rename
survives a power loss. The SHA-256 of the bytes ``torch.save`` wrote travels inside the file: ``torch.save``
writes a zip archive, and the digest is its archive comment (``trainscale-sha256:<64 hex>``, the last 82 bytes;
the two bytes before them, the comment's length, are 0 in the hashed bytes), which ``torch.load``, Python's
``zipfile`` and ``unzip`` accept and skip. So a checkpoint is one file: copied, moved or listed
(``os.listdir``, as Lightning's tests and users do) without a file beside it, and replaced in one atomic
rename with its digest, never with a digest of other bytes. It is checked on load; a file without it (and
without the ``<name>.sha256`` file beside it that trainscale wrote before) is refused unless the caller passes
``verify=False``. (A ``torch.save`` that writes no zip archive, torch's legacy format, gets its digest in
``<name>.sha256`` beside it, as before.) Loads use ``torch.load(weights_only=True)``, which refuses to run
arbitrary pickled code (https://pytorch.org/docs/stable/generated/torch.load.html).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import pickle
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, tampered with, or does not fit the model."""


class NoDigestError(CheckpointError):
    """A checkpoint file records no SHA-256 (a plain ``torch.save`` file: re-saved after an edit, or written by
    another library), so its bytes cannot be verified."""


# fsync of a directory: EINVAL or ENOTSUP on filesystems that cannot sync one (some NFS/FUSE/CIFS
# mounts, per fsync(2)); the rename is then as durable as that filesystem makes it.
_DIR_FSYNC_UNSUPPORTED = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# chmod refused by filesystems without POSIX modes (CIFS/SMB, FUSE buckets): the file keeps mkstemp's 0600
_CHMOD_UNSUPPORTED = (errno.EPERM, errno.EACCES, errno.ENOTSUP, errno.EOPNOTSUPP)


def _readable_by_all(tmp: str) -> None:
    """Mode 0644 for a file ``mkstemp`` made 0600, where the filesystem has modes (:data:`_CHMOD_UNSUPPORTED`:
    the file is written with the mode it was given, as ``torch.save`` would write it there)."""
    try:
        os.chmod(tmp, 0o644)
    except OSError as err:
        if err.errno not in _CHMOD_UNSUPPORTED:
            raise


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def disk_full_is_clear(path: Path) -> Iterator[None]:
    """Turn "no space left on device" (ENOSPC, or EDQUOT: over quota) raised inside the block into a
    :class:`CheckpointError` that says where and what to do.

    Raises:
        CheckpointError: the disk (or quota) holding ``path`` is full; chained to the ``OSError``.
    """
    try:
        yield
    except OSError as err:
        if err.errno not in _DISK_FULL:
            raise
        raise disk_full_error(path, err) from err


def disk_full_error(path: Path, err: OSError) -> CheckpointError:
    """The error of a write of ``path`` that met a full disk (or quota): where, how much is free, what to do."""
    free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
    why = err.strerror or os.strerror(err.errno)
    return CheckpointError(f"no space left on device while writing {str(path)!r} ({why}; "
                           f"{free / 2**20:.1f} MiB free on the disk holding {str(path.parent)!r}); the "
                           "file there before is unchanged and 'last' still names the previous checkpoint. "
                           "Free space there, lower keep_last, or set default_root_dir to a larger disk")


def _write_event(stage: str, path: Path) -> None:
    """Called at each stage of a write ("partial", "digest": a checkpoint's bytes written, before its digest,
    "before-rename", "after-rename"). A no-op: the
    save-crash tests replace it to kill the process at that exact point."""


def is_url(path: Any) -> bool:
    """Whether ``path`` (a str as given: ``Path`` folds its ``//``) names a remote or in-memory file system
    (``protocol://...``, as fsspec's paths: ``s3://bucket/runs``, ``memory://x``)."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(path)) is not None


def refuse_url(what: str, path: Any) -> None:
    """Raise ``ValueError`` naming ``what`` when ``path`` is a URL (:func:`is_url`): runs and checkpoints are written
    and read on local file paths only (Lightning goes through fsspec), and ``Path("s3://b")`` would be the local
    directory ``s3:/b``."""
    if isinstance(path, str) and is_url(path):
        raise ValueError(f"{what}={path!r} is a URL: trainscale writes and reads runs and checkpoints on local file "
                         "paths only (Lightning writes through fsspec); give a local directory (a mounted bucket, "
                         "for instance) and copy the files from it")


@contextlib.contextmanager
def _atomic_open(path: Path) -> Iterator[BinaryIO]:
    """A temporary file beside ``path``, fsync'ed and renamed over ``path`` when the block ends
    without an error (deleted when it raises; a full disk raised as a clear :class:`CheckpointError`)."""
    with disk_full_is_clear(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            _readable_by_all(tmp)
            _write_event("before-rename", path)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    _write_event("after-rename", path)
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part."""
    path = Path(path)
    with _atomic_open(path) as f:
        view = memoryview(data)  # slices of a memoryview are not copies
        f.write(view[: len(view) // 2])
        f.flush()
        _write_event("partial", path)
        f.write(view[len(view) // 2:])


class _HashingWriter:
    """A write-only file object that hashes what it passes on, so that ``torch.save`` streams to
    disk: no copy of the checkpoint is held in memory (a ``BytesIO`` and its ``getvalue()`` held
    two, i.e. host memory of twice the checkpoint's size at every save)."""

    def __init__(self, f: BinaryIO, path: Path) -> None:
        self._f, self._path, self._written = f, path, 0
        self.sha256 = hashlib.sha256()
        self.tail = b""  # the last bytes written: the archive's end record, where the digest goes

    def write(self, data) -> int:
        self.sha256.update(data)
        self.tail = (self.tail + bytes(memoryview(data)[-_END_RECORD:]))[-_END_RECORD:]
        n = self._f.write(data)
        if self._written == 0:  # the file now holds a part of the checkpoint
            self._f.flush()
            _write_event("partial", self._path)
        self._written += len(data)
        return n

    def flush(self) -> None:
        self._f.flush()


# The zip archive ``torch.save`` writes ends with its end-of-central-directory record (22 bytes: signature ...
# comment length), then the comment (APPNOTE.TXT 4.3.16, https://pkware.cachefly.net/webdocs/casestudies/APPNOTE.TXT).
_END_RECORD = 22
_END_SIGNATURE = b"PK\x05\x06"
_DIGEST_TAG = b"trainscale-sha256:"
_DIGEST_LEN = len(_DIGEST_TAG) + 64  # the comment: the tag and the hex digest


def save_file(obj: Any, path: str | os.PathLike) -> None:
    """Serialize ``obj`` with ``torch.save`` atomically, streamed to disk, with its SHA-256 as the archive's
    comment (module docstring): the file and its digest appear together, in one rename."""
    import torch

    path = Path(path)
    try:
        with _atomic_open(path) as f:
            writer = _HashingWriter(f, path)
            torch.save(obj, writer)
            f.flush()
            _write_event("digest", path)
            embedded = _append_digest(f, writer)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        if "pickle" not in str(err):
            raise
        raise TypeError(f"{_unpicklable_entry(obj)}cannot be saved ({err}): a checkpoint holds tensors, modules, "
                        "optimizers and plain values (numbers, strings, lists, dicts); save what a lambda or a local "
                        "function computes, not the function") from err
    if not embedded:  # not a zip archive (torch's legacy format, a replaced torch.save): the digest goes beside it
        try:
            atomic_write_bytes(f"{os.fspath(path)}.sha256", writer.sha256.hexdigest().encode() + b"\n")
        except Exception:
            path.unlink(missing_ok=True)  # without its checksum it would be refused: free its space now
            raise


def _append_digest(f: BinaryIO, writer: _HashingWriter) -> bool:
    """Make the digest of the bytes written so far the archive's comment: its length into the end record's last two
    bytes (0 as ``torch.save`` wrote them), the comment after them. False (nothing appended) when the bytes do not
    end with a zip end record without a comment."""
    tail = writer.tail
    if len(tail) < _END_RECORD or tail[:4] != _END_SIGNATURE or tail[-2:] != b"\x00\x00":
        return False
    f.seek(-2, os.SEEK_END)
    f.write(struct.pack("<H", _DIGEST_LEN))
    f.seek(0, os.SEEK_END)
    f.write(_DIGEST_TAG + writer.sha256.hexdigest().encode())
    return True


def embedded_digest(data: bytes) -> tuple[str, str] | None:
    """``(recorded, actual)`` SHA-256 hex digests of checkpoint bytes written by :func:`save_file`: the one its
    archive comment records and the one of its archive bytes (the comment left out, its length 0); None for bytes
    without such a comment (a plain ``torch.save`` file, or one written with a ``.sha256`` file beside it)."""
    view = memoryview(data)
    start = len(view) - _DIGEST_LEN  # where the comment starts
    end = start - _END_RECORD
    if (end < 0 or bytes(view[start:start + len(_DIGEST_TAG)]) != _DIGEST_TAG
            or bytes(view[end:end + 4]) != _END_SIGNATURE or bytes(view[start - 2:start]) != struct.pack("<H", _DIGEST_LEN)):
        return None
    actual = hashlib.sha256(view[:start - 2])
    actual.update(b"\x00\x00")
    return bytes(view[start + len(_DIGEST_TAG):]).decode("ascii", "replace"), actual.hexdigest()


def _unpicklable_entry(obj: Any) -> str:
    """``"checkpoint entry 'KEY' "`` for the first top-level entry of the dict ``obj`` that ``torch.save`` cannot
    write (each tried into a writer that keeps nothing), else ``"the checkpoint "``."""
    import torch

    class Discard:
        def write(self, data) -> int:
            return len(data)

        def flush(self) -> None:
            pass

    for key, value in (obj.items() if isinstance(obj, dict) else ()):
        try:
            torch.save(value, Discard())
        except Exception:
            return f"checkpoint entry {key!r} "
    return "the checkpoint "


def load_file(path: str | os.PathLike, verify: bool = True, read: Callable | None = None,
              map_location: Any = "cpu") -> Any:
    """Load a file written by :func:`save_file` on the CPU (or where ``map_location`` says: ``torch.load``'s
    argument), verifying its checksum.

    Args:
        verify: check the bytes against ``<path>.sha256`` and refuse a file without one (the default).
            ``False`` loads without any check: only for a file you trust that was written some other
            way (e.g. a plain ``torch.save``); a flipped bit then goes unnoticed.
        read: ``read(path, verify) -> bytes`` in place of :func:`read_checked` (a strategy's ranks may
            share one read per node: ``strategies.node_read``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: ``path`` is a directory; the checksum file is missing (``verify=True``); the
            bytes do not match the recorded SHA-256; they hold objects a weights-only load refuses (a file written
            by other means, e.g. by Lightning with objects of your classes in it: :func:`_weights_only_refusal`); or
            torch cannot read them (corrupted, truncated).
    """
    import torch

    path = Path(path)
    data = (read or read_checked)(path, verify)
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        if (refusal := _weights_only_refusal(path, err)) is None:
            raise _unreadable(path, err) from err
        raise refusal from err
    except Exception as err:  # torch raises several types for bad bytes
        raise _unreadable(path, err) from err


# what torch's weights-only unpickler says of a global (a class, a function) it does not allow
_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _weights_only_refusal(path: Path, err: pickle.UnpicklingError) -> CheckpointError | None:
    """The error for a file ``torch.load(weights_only=True)`` refused because it holds an object of a class it does
    not allow (``err`` names it), which is no sign of damage; None for another ``UnpicklingError``."""
    found = _REFUSED_GLOBAL.search(str(err))
    if found is None:
        return None
    return CheckpointError(f"checkpoint {str(path)!r} holds objects that a weights-only load (torch.load(..., "
                           f"weights_only=True), which runs no pickled code) refuses, such as {found.group(1)}: it was "
                           "written without keeping them apart as trainscale does (by Lightning, say, with objects of "
                           "your classes in it); this is no sign of damage. If you trust the file, read it with "
                           "torch.load(path, weights_only=False) (this runs its pickled code) and take what you need, "
                           "e.g. model.load_state_dict(checkpoint['state_dict'])")


def _unreadable(path: Path, err: Exception) -> CheckpointError:
    """The error for bytes torch cannot decode (a zip error, a cut pickle): damage, or no checkpoint at all."""
    return CheckpointError(f"checkpoint {str(path)!r} cannot be read ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}); it is corrupted, truncated "
                           "or not a trainscale checkpoint: resume from an earlier one or delete it")


def read_checked(path: Path, verify: bool = True) -> bytes:
    """The bytes of checkpoint file ``path``, checked against ``<path>.sha256`` when ``verify``. Raises as
    :func:`load_file` does before decoding. A symbolic link (``last.ckpt``) reads its target, with the target's
    checksum file."""
    path = path.resolve() if path.is_symlink() else path
    check_is_file(path)
    data = path.read_bytes()
    if verify:
        _verify(path, data)
    return data


def check_is_file(path: Path) -> None:
    """Raise unless ``path`` is a file: FileNotFoundError, or CheckpointError for a directory (a sharded
    checkpoint or another one), each naming what to pass instead."""
    if path.is_dir() and (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is a directory: a sharded checkpoint written by "
                              "strategy='fsdp' or 'model_parallel', not a file; load it with Runtime.load or "
                              "Trainer.fit(ckpt_path=...), which read it under any strategy")
    if path.name.endswith(".sha256") and Path(str(path)[:-len(".sha256")]).exists():
        raise CheckpointError(f"{str(path)!r} is the checksum file of checkpoint {str(path)[:-len('.sha256')]!r}, "
                              "not a checkpoint; pass that path")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a directory, not a checkpoint; pass a checkpoint file "
                              "(<run>/checkpoints/epoch=E-step=S.ckpt) or ckpt_path='last'")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist; pass an existing file, "
                                "ckpt_path='last' to resume the newest run, or ckpt_path=None to start fresh")


def _verify(path: Path, data: bytes) -> None:
    """Raise unless ``data`` (the bytes of ``path``) match the SHA-256 recorded in them (:func:`embedded_digest`),
    or, for a file written before the digest moved inside, in ``<path>.sha256``."""
    digest_file = Path(f"{path}.sha256")
    embedded = embedded_digest(data)
    if embedded is None and not digest_file.is_file():
        raise NoDigestError(f"checkpoint {str(path)!r} records no SHA-256 (neither inside the file nor in "
                              f"{digest_file.name!r} beside it), so it cannot be verified: it is corrupted or "
                              "truncated (its digest is its last bytes), or it was not written by trainscale (a flipped bit would load silently); resume from an earlier "
                              "checkpoint, or, if you trust this file, load it unverified with verify=False")
    if embedded is not None:
        expected, actual = embedded
    else:
        expected, actual = digest_file.read_text().strip(), hashlib.sha256(data).hexdigest()
    if expected != actual:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupted or truncated ({len(data)} bytes, "
                              f"sha256 {actual[:12]}… but {expected[:12]}… was recorded when it was "
                              "written); resume from an earlier checkpoint or delete it")


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


class TensorState:
    """Tensors laid out like the model's parameters (e.g. an average of the weights), as one checkpoint entry:
    under the sharded strategies (fsdp, hsdp, tp) written by every rank through DCP, each its own shards of
    its DTensors, and read back into them (resharded on another mesh), as the model is; under the others in the
    checkpoint file. A DCP ``Stateful``: :meth:`state_dict` is ``tensors`` itself, :meth:`load_state_dict`
    copies into them in place. A checkpoint without this entry (written before it existed) leaves the tensors
    as they are and :attr:`loaded` False.

    Args:
        tensors: name -> tensor (a ``DTensor`` under a sharding strategy), read and written in place.
    """

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors
        self.loaded = False

    def state_dict(self) -> dict:
        return self.tensors

    def load_state_dict(self, state: dict) -> None:
        missing = sorted(set(self.tensors) - set(state))
        if missing:
            raise KeyError(f"the saved tensors lack {missing[:3]} ({len(missing)} in all): saved for another model")
        for name, tensor in self.tensors.items():
            if state[name] is not tensor:  # DCP reads into the tensors themselves
                tensor.detach().copy_(state[name])
        self.loaded = True


def save_replicated(path, state: dict, world, unwrap: Callable) -> None:
    """Save where every rank holds the full state: rank 0 writes, the others write nothing.

    Modules (unwrapped from DDP), optimizers, schedulers and scalers are stored as their
    ``state_dict()``; other values as they are.
    """
    if world.rank != 0:
        return
    import torch

    out = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            value = unwrap(value)
        out[key] = value.state_dict() if _is_stateful(value) else value
    save_file(out, path)


# Entries a checkpoint file may hold under a former name, read there when the current name is absent: the model's
# weights, "state_dict" (Lightning's key) since the Trainer writes it, "model" in the files it wrote before.
FORMER_NAMES = {"state_dict": "model"}


def _rename_former_entries(loaded: dict, state: dict) -> None:
    """Move each entry of ``loaded`` written under its :data:`FORMER_NAMES` name to the key ``state`` uses."""
    for key, former in FORMER_NAMES.items():
        if key in state and key not in loaded and former in loaded:
            loaded[key] = loaded.pop(former)


def load_replicated(path, state: dict, unwrap: Callable, verify: bool = True, read: Callable | None = None,
                    before_restore: Callable[[dict], None] | None = None, strict: bool = True) -> dict:
    """Load ``path`` on every rank (``verify``, ``read``: as in :func:`load_file`); restore stateful objects
    of ``state`` in place (an entry absent under its key is read under its :data:`FORMER_NAMES` name).
    ``before_restore(entries)`` sees every entry as read (the model's weights as a state dict) and may change them
    before anything is restored from them (what Lightning's ``on_load_checkpoint`` may do to a checkpoint file), or
    raise: nothing is restored then. ``strict``: given to each module's ``load_state_dict`` (False: weights missing
    from the file keep their values, and the file's other weights are ignored).

    Returns:
        The checkpoint's entries whose keys are not stateful objects in ``state``.

    Raises:
        CheckpointError: as :func:`load_file`; a key of ``state`` is missing from the file, or the
            model's tensors do not match (the message names the first mismatch).
    """
    import torch

    loaded = load_file(path, verify, read)
    _rename_former_entries(loaded, state)
    if before_restore is not None:
        before_restore(loaded)
    for key, value in state.items():
        if not _is_stateful(value) or (key not in loaded and isinstance(value, TensorState)):
            continue
        if key not in loaded:
            raise CheckpointError(f"checkpoint {str(path)!r} has no entry {key!r} (it has {sorted(loaded)})")
        target = unwrap(value) if isinstance(value, torch.nn.Module) else value
        try:
            if isinstance(value, torch.nn.Module):
                target.load_state_dict(loaded[key], strict=strict)
            else:
                target.load_state_dict(loaded[key])
        except (RuntimeError, ValueError, KeyError) as err:
            raise CheckpointError(f"checkpoint {str(path)!r} entry {key!r} does not fit: "
                                  f"{str(err).splitlines()[0]}") from err
    return {k: v for k, v in loaded.items() if not (k in state and _is_stateful(state[k]))}
