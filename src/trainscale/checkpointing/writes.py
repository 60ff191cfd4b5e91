"""The Trainer's checkpoint writes: when each is published and what it cost the loop.

By default a save returns once the checkpoint is on disk, and "last" then names it. With
``Trainer(checkpoint_async=True)`` (sharded strategies: fsdp, model_parallel, hsdp, tp) the Trainer's
scheduled checkpoints (epoch ends, ``checkpoint_every_n_steps``) are written in the background by torch's
``async_save`` (``Runtime.save(asynchronous=True)``): the loop waits only while the state is copied to host
memory, then trains on. The "never corrupt" rule holds: the shards go to a temporary directory that is
renamed, and "last" moved to it (rank zero; then the older checkpoints its ``ModelCheckpoint`` drops are
deleted), only after the write has ended, which
a step finds with a check that never blocks (:meth:`CheckpointWrites.poll`), or the end of ``fit``
(:meth:`CheckpointWrites.wait`). A run killed before that leaves "last" at the previous complete checkpoint;
the next good save removes the temporary directory. At most one write is in flight: a save first waits for
the one before. A checkpoint written on a signal (preemption), or by a direct call of
``Trainer.save_checkpoint``, is written before the call returns.

Measured for every save (seconds, this rank): ``checkpoint_stall_s``, the time the loop was blocked in the
save (waiting for the write before it, collecting and staging the state, rank zero's extra file; the whole
write when synchronous), and for a background write ``checkpoint_write_s``, from its start to its end. Both
go into the next step record; totals into the run summary's ``checkpoints``.
"""

from __future__ import annotations

from time import perf_counter  # bound at import: a test's patch of time.perf_counter (a callback's clock) misses it
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from trainscale.checkpointing import checkpointer, run_dirs as ckpt

if TYPE_CHECKING:
    from trainscale.runtime.runtime import Runtime


class CheckpointWrites:
    """The Trainer's saves, at most one of them in flight.

    Args:
        runtime: the Trainer's ``Runtime``.
        config: the Trainer's ``TrainerConfig``: ``checkpoint_async`` (write scheduled checkpoints in the
            background).
        log: receives ``{"checkpoint_stall_s": s}`` and ``{"checkpoint_write_s": s}`` (``Trainer.log_metrics``).

    Raises:
        ValueError: ``checkpoint_async`` under a strategy that writes one file (single, ddp, dp), on every rank.
    """

    def __init__(self, runtime: Runtime, config: Any, log: Callable[[dict], None]) -> None:
        if config.checkpoint_async:
            runtime.config.strategy_class.check_async_save()
        self.runtime, self.asynchronous, self._log = runtime, config.checkpoint_async, log
        self._pending: tuple[Any, Path | None] | None = None  # (AsyncSave, the "last" pointer's directory or None)
        self._discards: list[Path] = []  # checkpoints to delete once the save in flight is published
        self._links: list[tuple[Path, Path]] = []  # (checkpoint, link) to make once the save in flight is published
        self.stall_s: list[float] = []  # one per save
        self.write_s: list[float] = []  # one per background write, when published
        self.saved_step: int | None = None  # the global step of the newest checkpoint written (or staged)

    def save(self, target: Path, last_dir: Path | None, fit: Any, state: Any, optimizers, schedulers, callbacks: dict,
             on_save: Callable[[dict], None], background: bool, plateau_pending: dict | None = None) -> Path:
        """``checkpointer.save`` to ``target`` (a file, or a directory under a sharding strategy) after the write in
        flight is published; in the background when ``background`` and ``checkpoint_async``. With ``last_dir``,
        ``last_dir/last`` names it once it is published. ``plateau_pending``: as ``checkpointer.save``'s. Returns
        its path."""
        started = perf_counter()
        self.wait()
        target, pending = checkpointer.save(self.runtime, target, fit, state, optimizers, schedulers, callbacks,
                                            on_save, asynchronous=background and self.asynchronous,
                                            plateau_pending=plateau_pending)
        stall = perf_counter() - started
        self.saved_step = state.global_step
        self.stall_s.append(stall)
        self._log({"checkpoint_stall_s": stall})
        if pending is None:
            self._published(target, last_dir)
        else:
            self._pending = (pending, last_dir)
        return target

    def discard(self, paths: list[Path]) -> None:
        """Delete these checkpoints (rank zero) once the save in flight is published; now when none is.
        A save that fails deletes nothing."""
        self._discards.extend(paths)
        if self._pending is None:
            self._delete_discards()

    def link(self, path: Path, link: Path) -> None:
        """Make ``link`` a symbolic link to checkpoint ``path`` (rank zero; ``run_dirs.link_last``) once the save in
        flight is published, before the discards are deleted; now when none is. A save that fails links nothing."""
        self._links.append((path, link))
        if self._pending is None:
            self._make_links()

    def _make_links(self) -> None:
        links, self._links = self._links, []
        if self.runtime.is_rank_zero:
            for path, link in links:
                ckpt.link_last(path, link)

    def _delete_discards(self) -> None:
        paths, self._discards = self._discards, []
        if self.runtime.is_rank_zero:
            for path in paths:
                ckpt.remove_checkpoint(path)

    def poll(self) -> None:
        """Publish the write in flight if it has ended (never blocks; at every step under ``checkpoint_async``)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the write in flight (if any) has ended, then publish it.

        Raises:
            trainscale.runtime.checkpoint_io.CheckpointError: it failed; "last" stays where it was.
        """
        if self._pending is None:
            return
        (pending, last_dir), self._pending = self._pending, None
        try:
            target = pending.wait()
        except BaseException:
            self._discards, self._links = [], []  # the older checkpoints stay: the new one is not on disk
            raise
        self._published(target, last_dir)
        self.write_s.append(pending.write_s)
        self._log({"checkpoint_write_s": pending.write_s})

    def _published(self, target: Path, last_dir: Path | None) -> None:
        if last_dir is not None and self.runtime.is_rank_zero:
            ckpt.mark_last(target, last_dir)
        self._make_links()
        self._delete_discards()

    def summary(self) -> dict:
        """This rank's totals: ``{"async", "saves", "stall_s", "stall_s_max", "write_s"}`` (seconds;
        ``write_s`` sums the background writes, None without ``checkpoint_async``)."""
        return {"async": self.asynchronous, "saves": len(self.stall_s), "stall_s": sum(self.stall_s),
                "stall_s_max": max(self.stall_s, default=None),
                "write_s": sum(self.write_s) if self.asynchronous else None}
