"""The parent of a "ddp_notebook" job forks its ranks, which cannot use CUDA once the parent initialised it: building
the Runtime and the Trainer there must leave CUDA alone. CUDA is faked: every torch.cuda call that initialises it
goes through ``torch.cuda._lazy_init``, recorded here."""

import torch

from trainscale.runtime import devices
from trainscale.runtime.runtime import Runtime


def test_a_ddp_notebook_parent_does_not_initialise_cuda(monkeypatch, tmp_path):
    """Under "32-true" the constructors read the GPU's compute capability (for the TF32 note), which
    initialises CUDA: in a spawning parent they must not."""
    from trainscale import Trainer

    initialised = []
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: initialised.append(True))

    def capability(device=None):
        torch.cuda._lazy_init()
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    rt = Runtime(accelerator="cuda", devices=2, strategy="ddp_notebook")
    assert rt.spawns and initialised == []
    Trainer(accelerator="cuda", devices=2, strategy="ddp_notebook", default_root_dir=tmp_path,
            enable_progress_bar=False)
    assert initialised == []
    Runtime(accelerator="cuda", devices=1)  # a process that owns its GPU asks it (and says the note)
    assert initialised == [True]


def test_counting_gpus_does_not_ask_cuda_is_available(monkeypatch):
    """``torch.cuda.is_available()`` initialises the CUDA driver (``cudaGetDeviceCount``) unless told to use NVML;
    ``device_count()`` asks NVML first."""
    def is_available():
        raise AssertionError("torch.cuda.is_available() called")

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert devices.cuda_device_count() == 3
