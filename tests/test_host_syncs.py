"""Host-sync audit of the Trainer's step on CPU: every Python-level read of a tensor's value on the host
(``item``, ``tolist``, ``bool``, ``float``, ``int``, ``cpu``, ``numpy``) is recorded with its caller, and each optimizer
step's reads are collected between two ``on_train_batch_end`` calls. On a GPU each of these waits for the device;
trainscale's own must happen only at log intervals and at the fault-tolerance check, never in an ordinary step.
(torch's own reads, e.g. the optimizer's ``.item()`` of its step count, a CPU tensor on GPUs too, are not
trainscale's.)"""

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainscale import Trainer
from trainscale.callbacks import Callback

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")
PACKAGE = str(Path(__import__("trainscale").__file__).parent)


class StepWindows(Callback):
    """The reads recorded during each optimizer step: from the end of the previous step (or the epoch's start)."""

    def __init__(self, reads: list) -> None:
        self.reads = reads
        self.per_step: list[list] = []
        self._start = 0

    def on_train_epoch_start(self, trainer, module) -> None:
        self._start = len(self.reads)

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.is_step_end:
            self.per_step.append(self.reads[self._start:])
            self._start = len(self.reads)


def _record_reads(monkeypatch) -> list:
    reads = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def recorded(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE):
                reads.append((_name, Path(caller).name))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, recorded)
    return reads


@pytest.mark.parametrize("accumulate, precision", [(1, "32-true"), (2, "bf16-mixed")])
def test_trainscale_reads_tensors_on_the_host_only_at_log_intervals_and_checks(monkeypatch, tmp_path, accumulate,
                                                                               precision):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    data = TensorDataset(torch.randn(4 * accumulate * 12, 8), torch.randint(0, 3, (4 * accumulate * 12,)))
    windows = StepWindows([])
    trainer = Trainer(accelerator="cpu", max_steps=10, log_every_n_steps=4, enable_progress_bar=False,
                      enable_checkpointing=False, default_root_dir=tmp_path, logger=False, callbacks=[windows],
                      gradient_clip_val=1.0, accumulate_grad_batches=accumulate, precision=precision)
    windows.reads = _record_reads(monkeypatch)  # the fit is audited, not the construction
    trainer.fit(model, DataLoader(data, batch_size=4), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    monkeypatch.undo()
    by_step = {step: sorted({file for _, file in got}) for step, got in enumerate(windows.per_step, 1) if got}
    # A step's window holds what ran after the previous step's on_train_batch_end: the log of step 4 shows in
    # step 5's window. Log records after steps 4 and 8 (the loss, the telemetry's numbers); the fault check after
    # step 1 and then every log_every_n_steps steps (world size 1): 1, 5, 9. Nothing else, in any step.
    assert by_step == {2: ["tolerance.py"], 5: ["processor.py", "records.py"], 6: ["tolerance.py"],
                       9: ["processor.py", "records.py"], 10: ["tolerance.py"]}
    assert len(windows.per_step) == 10
