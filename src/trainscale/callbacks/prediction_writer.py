"""Lightning's ``BasePredictionWriter``: a callback that writes ``trainer.predict``'s outputs as they come."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trainscale.callbacks.base import Callback
from trainscale.runtime.batch import to_device

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer

_CPU = torch.device("cpu")
_INTERVALS = ("batch", "epoch", "batch_and_epoch")


class BasePredictionWriter(Callback):
    """``BasePredictionWriter(write_interval="batch")``, as Lightning's ``callbacks.BasePredictionWriter``: subclass
    it and override ``write_on_batch_end`` (``write_interval`` "batch" or "batch_and_epoch") and/or
    ``write_on_epoch_end`` ("epoch" or "batch_and_epoch")::

        class Writer(BasePredictionWriter):
            def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
                torch.save(predictions, f"predictions_{trainer.global_rank}.pt")

        trainer = Trainer(callbacks=[Writer(write_interval="epoch")])
        trainer.predict(model, loader)

    ``write_on_batch_end(trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx)`` runs in
    ``on_predict_batch_end`` with what ``predict_step`` returned for that batch; ``write_on_epoch_end(trainer,
    pl_module, predictions, batch_indices)`` in ``on_predict_epoch_end`` with this rank's per-batch outputs, moved to
    the CPU (one loader: a list with one entry per batch; several: a list of such lists, one per loader), as
    Lightning's ``trainer.predict_loop.predictions``. Each rank writes its own batches (under several processes, name
    the file by ``trainer.global_rank``).

    ``batch_indices``, as Lightning's: in ``write_on_batch_end`` the data set indices of the batch's samples (on
    this rank: under several processes, its share), in ``write_on_epoch_end`` a list per loader of those lists, one
    per batch (dataloaders x batches x samples, one loader too); ``[]`` where the loader has no sampler to tell them
    (an ``IterableDataset``, a loader of another class than ``DataLoader``).

    Raises:
        ValueError: a ``write_interval`` other than "batch", "epoch", "batch_and_epoch" (Lightning:
            ``MisconfigurationException``).
    """

    def __init__(self, write_interval: str = "batch") -> None:
        if write_interval not in _INTERVALS:
            raise ValueError(f"`write_interval` should be one of {list(_INTERVALS)}.")
        self.interval = write_interval
        self._predictions: list[list[Any]] = []  # loaders x batches, when writing at the epoch end

    @property
    def _on_batch(self) -> bool:
        return self.interval in ("batch", "batch_and_epoch")

    @property
    def _on_epoch(self) -> bool:
        return self.interval in ("epoch", "batch_and_epoch")

    def write_on_batch_end(self, trainer: Trainer, pl_module: Any, prediction: Any, batch_indices: Any, batch: Any,
                           batch_idx: int, dataloader_idx: int) -> None:
        """Override with the logic to write one batch's ``prediction``."""
        raise NotImplementedError()

    def write_on_epoch_end(self, trainer: Trainer, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        """Override with the logic to write all of this rank's ``predictions``."""
        raise NotImplementedError()

    def on_predict_epoch_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._predictions = []

    def on_predict_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        if self._on_epoch:
            while len(self._predictions) <= dataloader_idx:
                self._predictions.append([])
            self._predictions[dataloader_idx].append(to_device(outputs, _CPU))  # Lightning: move_data_to_device(.., "cpu")
        if self._on_batch:
            self.write_on_batch_end(trainer, pl_module, outputs, _batch_indices(trainer, dataloader_idx, batch_idx),
                                    batch, batch_idx, dataloader_idx)

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not self._on_epoch:
            return
        predictions, self._predictions = self._predictions, []
        indices = [[_batch_indices(trainer, i, batch_idx) for batch_idx in range(len(per_loader))]
                   for i, per_loader in enumerate(predictions)]
        self.write_on_epoch_end(trainer, pl_module, predictions[0] if len(predictions) == 1 else predictions, indices)



def _batch_indices(trainer: Trainer, dataloader_idx: int, batch_idx: int) -> list[int]:
    """The sample indices of batch ``batch_idx`` of loader ``dataloader_idx`` (``trainer.predict_batch_indices``);
    ``[]`` where that loader's are not known, as Lightning's ``current_batch_indices``."""
    seen = trainer.predict_batch_indices[dataloader_idx] if dataloader_idx < len(trainer.predict_batch_indices) else []
    return seen[batch_idx] if batch_idx < len(seen) else []
