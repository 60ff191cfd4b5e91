"""Lightning's ``GradientAccumulationScheduler``: micro-batches per optimizer step as a function of the epoch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainscale.callbacks.base import Callback
from trainscale.utilities.model_helpers import is_overridden
from trainscale.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer


class GradientAccumulationScheduler(Callback):
    """Accumulate the gradients of ``scheduling[e]`` micro-batches per optimizer step from (0-based) epoch ``e`` on,
    as Lightning's ``callbacks.GradientAccumulationScheduler``:

        from trainscale.callbacks import GradientAccumulationScheduler

        # epochs 0-3: a step per batch; 4-7: every 2 batches; from 8: every 4
        trainer = Trainer(callbacks=[GradientAccumulationScheduler(scheduling={0: 1, 4: 2, 8: 4})])

    The Trainer asks :meth:`get_accumulate_grad_batches` at the start of each epoch, on every rank alike
    (``Trainer.accumulate_for``); that factor is then what the epoch's step grouping, loss division, gradient
    sync (all-reduce on each step's last micro-batch only), ``trainer.accumulate_grad_batches`` and
    ``trainer.global_batch_size`` use. Epochs before the first key accumulate 1 (Lightning adds ``{0: 1}``). A
    resumed fit asks again for the epoch it resumes in: the factor is never saved.

    Args:
        scheduling: ``{epoch: factor}``, epochs ints >= 0, factors ints >= 1.

    Raises:
        TypeError: an empty ``scheduling``.
        ValueError: a key that is not an int >= 0 ("Epoch should be an int greater than or equal to 0"), a value
            that is not an int >= 1 ("Accumulation factor should be an int greater than 0"); Lightning's words
            (its ``MisconfigurationException``).
    """

    def __init__(self, scheduling: dict[int, int]) -> None:
        super().__init__()
        if not scheduling:
            raise TypeError("Empty dict cannot be interpreted correct: give GradientAccumulationScheduler "
                            "{epoch: factor}, e.g. {0: 1, 4: 2}")
        if any(not _is_int(key) or key < 0 for key in scheduling):
            raise ValueError(f"Epoch should be an int greater than or equal to 0. Got {list(scheduling.keys())}.")
        if any(not _is_int(value) or value < 1 for value in scheduling.values()):
            raise ValueError(f"Accumulation factor should be an int greater than 0. Got {list(scheduling.values())}.")
        if 0 not in scheduling:  # Lightning's: the epochs before the first key accumulate 1
            scheduling.update({0: 1})
        self.scheduling = scheduling
        self.epochs = sorted(scheduling)

    def going_to_accumulate_grad_batches(self) -> bool:
        """Whether some epoch accumulates more than one micro-batch per step."""
        return any(v > 1 for v in self.scheduling.values())

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        """The factor of (0-based) ``epoch``: that of the largest key <= ``epoch``."""
        return self.scheduling[max(e for e in self.epochs if e <= epoch)]

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        """Lightning's checks before training, with trainscale's ``lr_scaling`` one.

        Raises:
            RuntimeError: the module uses manual optimization (Lightning's words).
            ValueError: ``Trainer(accumulate_grad_batches=k)`` with k != 1 (Lightning's words); ``lr_scaling`` (its
                global batch would change between epochs: whether the learning rate should follow it, as the
                scaling rules say, or stay, as in a batch-size schedule that replaces learning-rate decay, is
                yours to say).
        """
        if not getattr(pl_module, "automatic_optimization", True):
            raise RuntimeError("Automatic gradient accumulation and the `GradientAccumulationScheduler` is not "
                               "supported for manual optimization. Please remove the callback or switch to "
                               "automatic optimization.")
        hooks = [name for name in ("optimizer_step", "optimizer_zero_grad")
                 if getattr(pl_module, name, None) is not None and is_overridden(name, pl_module)]
        if hooks and self.going_to_accumulate_grad_batches():
            rank_zero_warn("When using `Trainer(accumulate_grad_batches != 1)` and overriding "
                           "`LightningModule.optimizer_{step,zero_grad}`, the hooks will not be called on every batch "
                           "(rather, they are called on every optimization step).")
        if trainer.config.accumulate_grad_batches != 1:
            raise ValueError("You have set `accumulate_grad_batches` and are using the `GradientAccumulationScheduler` "
                             "callback. Either remove `accumulate_grad_batches` from the Trainer or remove the "
                             "callback.")
        if trainer.config.lr_scaling is not None:  # which lr a larger batch wants depends on why it grows
            raise ValueError(f"lr_scaling={trainer.config.lr_scaling!r} scales the learning rate to one global batch "
                             f"size, and GradientAccumulationScheduler({self.scheduling}) sets it per epoch: drop "
                             "lr_scaling and set the learning rate yourself (a scheduler on the epoch), or accumulate a "
                             "fixed factor with Trainer(accumulate_grad_batches=k) and no callback")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
