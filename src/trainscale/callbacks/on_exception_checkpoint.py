"""Lightning's ``OnExceptionCheckpoint``: a checkpoint of the state at the moment a stage raised."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainscale.callbacks.base import Callback

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer


class OnExceptionCheckpoint(Callback):
    """``OnExceptionCheckpoint(dirpath, filename="on_exception")``, as Lightning's
    ``callbacks.OnExceptionCheckpoint``: when ``fit`` (or ``validate``, ``test``, ``predict`` after a fit) raises,
    ``on_exception`` writes ``trainer.save_checkpoint(<dirpath>/<filename>.ckpt)`` (``ckpt_path``), from which
    ``fit(ckpt_path=callback.ckpt_path)`` resumes; a stage that ends normally removes that file in ``teardown`` (rank
    zero), as Lightning's, so the file exists only after a failure. Unlike Lightning, which removes whatever file is
    there, only a file this callback wrote, or the one this Trainer's fit resumed from (``trainer.ckpt_path``), is
    removed: a file another process left there stays.

    An existing file at ``ckpt_path`` is replaced (``save_checkpoint(overwrite=True)``), as Lightning's, except one
    inside another run's directory, which trainscale never overwrites nor removes: that save is skipped with a
    ``RuntimeWarning`` naming the file. A save that cannot be made (no fit has run on this Trainer, so there is no
    state; a full disk; a rank that died, under several ranks, where the save is a collective every rank must reach)
    is a ``RuntimeWarning`` too: the stage's own exception goes on either way.

    Raises:
        ValueError: an empty ``filename`` (Lightning's message).
    """

    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str | os.PathLike, filename: str = "on_exception") -> None:
        if not filename:
            raise ValueError("The filename cannot be empty")
        self.dirpath = dirpath  # given up front: an exception may come at any moment, before setup
        self.filename = filename
        self._wrote: Path | None = None

    @property
    def ckpt_path(self) -> str:
        """``<dirpath>/<filename>.ckpt``: where the checkpoint is written."""
        return os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        try:
            self._wrote = trainer.save_checkpoint(self.ckpt_path, overwrite=True)
        except Exception as err:  # the stage's exception matters more than this save's
            warnings.warn(f"OnExceptionCheckpoint could not save {self.ckpt_path} after {type(exception).__name__}: "
                          f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=2)

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        path = Path(self.ckpt_path)
        ours = {Path(p).resolve() for p in (self._wrote, trainer.ckpt_path) if p is not None}
        if not trainer.is_global_zero or path.resolve() not in ours:
            return
        if path.is_dir():
            shutil.rmtree(path)  # a sharded checkpoint
        elif path.exists() or path.is_symlink():
            path.unlink()
        self._wrote = None
