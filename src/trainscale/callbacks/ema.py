"""An exponential moving average (EMA) of the model's weights, kept as shards beside sharded parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import torch

from trainscale.callbacks.base import Callback
from trainscale.runtime.checkpoint_io import TensorState

if TYPE_CHECKING:
    from trainscale.loop.trainer import Trainer


class EMA(Callback):
    """Keep ``average = decay × average + (1 − decay) × weights`` after optimizer steps; validate with the
    average; end ``fit`` with the average in the model. Lightning's ``EMAWeightAveraging`` (``decay``,
    ``update_every_n_steps``, ``update_starting_at_step``, ``use_buffers``), which builds on torch's
    ``AveragedModel`` with ``get_ema_avg_fn``: its first update copies the weights, each later one blends them in.

    Under fsdp, hsdp and tp the average of a ``DTensor`` parameter is a ``DTensor`` with the same placements:
    updates, the swaps for validation and the checkpoint (through DCP, each rank its shards; resharded on
    another mesh) touch only each rank's shards, without gathering (the memory: one more copy of this rank's
    parameter shards, in their dtype: under "bf16-true" the average is bf16, and a ``decay`` near 1 loses most
    of each step's blend to rounding). Under ddp and single the average is a plain tensor beside each weight.

    1. After an optimizer step (``on_train_batch_end`` where ``trainer.is_step_end``): ``step_idx`` =
       ``global_step − 1``; the average is updated when ``step_idx >= start_step`` and ``step_idx %
       every_n_steps == 0`` (Lightning's ``should_update``).
    2. ``on_validation_epoch_start``/``_end``: the weights and the average swap places in place, so validation
       (and ``validate()`` after fit) sees the average and training continues from its own weights.
    3. ``on_train_end``: the average is copied into the model (Lightning's ``WeightAveraging``), so after ``fit``
       the model holds the average; checkpoints keep the trained weights as ``model`` and the average under
       ``callbacks/EMA/average``.

    Args:
        decay: weight of the old average, in [0, 1].
        every_n_steps: update every this many optimizer steps (int >= 1).
        start_step: first optimizer step index (0-based) that updates; the average starts as a copy there.
        use_buffers: average floating-point buffers too (e.g. batch-norm statistics; other buffers are copied),
            as Lightning's default; False: parameters only.

    Raises:
        ValueError: a ``decay``, ``every_n_steps`` or ``start_step`` out of range (when built); ``fit`` under
            pipeline parallelism (``pp``: each rank holds a part of the model; not supported).
    """

    def __init__(self, decay: float = 0.999, every_n_steps: int = 1, start_step: int = 0,
                 use_buffers: bool = True) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA(decay={decay!r}) must be a number in [0, 1] (e.g. 0.999: the average moves by "
                             "0.1 % of the difference each update)")
        for name, value, low in (("every_n_steps", every_n_steps, 1), ("start_step", start_step, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"EMA({name}={value!r}) must be an int >= {low}")
        self.decay, self.every_n_steps, self.start_step, self.use_buffers = float(decay), every_n_steps, start_step, use_buffers
        self.n_averaged = 0  # updates so far (0: the average holds no weights yet)
        self.latest_update_step = 0  # global_step of the last update
        self._model: torch.nn.Module | None = None
        self._average: TensorState | None = None
        self._units: list = []  # the model's FSDP modules: resharded before their parameters are read

    # -- the average ------------------------------------------------------------------------------
    def setup_state(self, model: torch.nn.Module) -> None:
        """Make the average's tensors for ``model`` (copies of its weights, shards alike), once per model: at
        ``on_fit_start``, or before a checkpoint is read into them (the checkpointer calls it)."""
        if model is self._model:
            return
        self._model, self.n_averaged, self.latest_update_step = model, 0, 0
        self._units = _fsdp_units(model)
        self._average = TensorState({name: t.detach().clone() for name, t in self._weights(model)})

    def _weights(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The averaged tensors of ``model``: its sharded parameters (FSDP modules resharded first: the root keeps
        its gathered parameters after an evaluation forward) and, with ``use_buffers``, its buffers."""
        for unit in self._units:
            unit.reshard()
        yield from model.named_parameters()
        if self.use_buffers:
            yield from model.named_buffers()

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Blend ``model``'s weights into the average (the first update copies them): ``torch.lerp_`` on each
        tensor, shard by shard for DTensors."""
        average = self._average.tensors
        for name, weight in self._weights(model):
            if self.n_averaged == 0 or not weight.is_floating_point():
                average[name].copy_(weight)
            else:
                average[name].lerp_(weight, 1.0 - self.decay)
        self.n_averaged += 1

    @torch.no_grad()
    def _swap(self, model: torch.nn.Module) -> None:
        average = self._average.tensors
        for name, weight in self._weights(model):
            held = weight.detach().clone()
            weight.detach().copy_(average[name])
            average[name].copy_(held)

    def _ready(self, module: Any) -> bool:
        return module is not None and module is self._model and self.n_averaged > 0

    # -- hooks ----------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, module: Any) -> None:
        if trainer.runtime.strategy.pipelined:
            raise ValueError("EMA does not support pipeline parallelism (strategy 'pp': each rank holds a stage); "
                             "use it with single, ddp, fsdp, hsdp or tp")
        self.setup_state(module)
        # the FSDP modules around the model too (the loop module is the root when it holds parameters of its own)
        self._units = _fsdp_units(trainer.last_setup[2] if trainer.last_setup else module)

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if not trainer.is_step_end or step <= self.latest_update_step:
            return
        step_idx = step - 1
        if step_idx >= self.start_step and step_idx % self.every_n_steps == 0:
            self.update(module)
            self.latest_update_step = step

    def on_validation_epoch_start(self, trainer: Trainer, module: Any) -> None:
        if self._ready(module):
            self._swap(module)

    def on_validation_epoch_end(self, trainer: Trainer, module: Any) -> None:
        if self._ready(module):
            self._swap(module)

    @torch.no_grad()
    def on_train_end(self, trainer: Trainer, module: Any) -> None:
        if self._ready(module):
            average = self._average.tensors
            for name, weight in self._weights(module):
                weight.detach().copy_(average[name])

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The counters, and the average as a ``TensorState`` (saved beside the model, sharded alike)."""
        state = {"decay": self.decay, "n_averaged": self.n_averaged, "latest_update_step": self.latest_update_step}
        if self._average is not None:
            state["average"] = self._average
        return state

    def load_state_dict(self, state: dict) -> None:
        """The counters; the average was read into its tensors with the model. A checkpoint without it (written
        without EMA) starts the average anew at the next update."""
        loaded = self._average is not None and self._average.loaded
        self.n_averaged = int(state.get("n_averaged", 0)) if loaded else 0
        self.latest_update_step = int(state.get("latest_update_step", 0))


def _fsdp_units(module: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]
