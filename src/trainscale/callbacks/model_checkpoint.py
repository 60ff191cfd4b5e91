"""Keep the best checkpoints by a monitored metric (Lightning's ``ModelCheckpoint``)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

from trainscale.callbacks.base import Callback


class ModelCheckpoint(Callback):
    """Save a full, resumable checkpoint (atomic, with its SHA-256, as the Trainer's own) at each epoch
    end, or every ``every_n_train_steps`` optimizer steps, and keep the ``save_top_k`` best by ``monitor``
    (the newest ones without a monitor). These files are this callback's own: the Trainer's rotation
    (``keep_last``) and ``last`` pointer never touch them.

    Args:
        dirpath: where to write; default ``<run dir>/checkpoints/top``.
        monitor: metric name in ``trainer.callback_metrics`` (e.g. "val_loss"); None: keep the newest.
        mode: "min" or "max".
        save_top_k: checkpoints kept (>= 1).
        every_n_train_steps: save mid-epoch every N optimizer steps instead of at epoch ends.

    Raises:
        ValueError: bad arguments; at a save, a ``monitor`` not among the metrics.
    """

    def __init__(self, dirpath: str | Path | None = None, monitor: str | None = None, mode: str = "min",
                 save_top_k: int = 1, every_n_train_steps: int | None = None) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}; choose 'min' or 'max'")
        for name, value in (("save_top_k", save_top_k), ("every_n_train_steps", every_n_train_steps or 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.monitor, self.mode, self.save_top_k, self.every_n_train_steps = monitor, mode, save_top_k, every_n_train_steps
        self.best_k: dict[str, float] = {}  # path -> score (lower is better after the sign for "max")

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        n = self.every_n_train_steps
        if n is not None and trainer.is_step_end and trainer.global_step % n == 0:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if self.every_n_train_steps is None:
            self._save(trainer)

    def _score(self, trainer: Any) -> float:
        if self.monitor is None:
            return -float(trainer.global_step)  # newest first
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            raise ValueError(f"ModelCheckpoint monitors {self.monitor!r}, which is not among the metrics: "
                             f"{', '.join(sorted(metrics))}")
        value = float(metrics[self.monitor])
        return value if self.mode == "min" else -value

    def _save(self, trainer: Any) -> None:
        score = self._score(trainer)
        if len(self.best_k) >= self.save_top_k and score >= max(self.best_k.values()):
            return  # not among the best: nothing written
        directory = self.dirpath or trainer.run_dir / "checkpoints" / "top"
        name = f"epoch={trainer.current_epoch:04d}-step={trainer.global_step:09d}"
        if self.monitor is not None and math.isfinite(score):
            name += f"-{self.monitor}={abs(score):.6g}"
        path = trainer.save_checkpoint(directory / name)
        self.best_k[str(path)] = score
        while len(self.best_k) > self.save_top_k:
            worst = max(self.best_k, key=self.best_k.get)
            del self.best_k[worst]
            if trainer.runtime.is_rank_zero:
                _remove(Path(worst))

    @property
    def best_model_path(self) -> str | None:
        return min(self.best_k, key=self.best_k.get) if self.best_k else None

    def state_dict(self) -> dict:
        return {"best_k": dict(self.best_k)}

    def load_state_dict(self, state: dict) -> None:
        self.best_k = dict(state["best_k"])


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
        Path(f"{path}.sha256").unlink(missing_ok=True)
