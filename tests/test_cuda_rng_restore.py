"""CUDA RNG states saved by a process that saw the whole node restore on one that sees fewer GPUs, e.g. one GPU
bound per SLURM task. torch.cuda's RNG calls are faked; nothing here needs a GPU."""

import pytest
import torch

from trainscale.checkpointing import rng


class FakeCuda:
    """``count`` visible devices, each with a settable RNG state; the real calls' index checks."""

    def __init__(self, monkeypatch, count, current):
        self.states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(count)}
        self.current = current
        for name in ("is_available", "device_count", "current_device", "get_rng_state_all", "set_rng_state",
                     "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self):
        return True

    def device_count(self):
        return len(self.states)

    def current_device(self):
        return self.current

    def get_rng_state_all(self):
        return [self.states[i].clone() for i in range(len(self.states))]

    def set_rng_state(self, state, device=None):
        device = self.current if device is None else device
        if device not in self.states:
            raise RuntimeError(f"invalid device ordinal {device}")
        self.states[device] = state.clone()

    def set_rng_state_all(self, states):
        for i, state in enumerate(states):
            self.set_rng_state(state, i)


def test_a_rank_restores_its_own_gpus_state_when_it_sees_one_gpu(monkeypatch):
    FakeCuda(monkeypatch, count=8, current=3)  # saved by local rank 3 of a node whose tasks saw all 8 GPUs
    saved = rng.rng_state()
    assert saved["cuda_device"] == 3 and len(saved["cuda"]) == 8
    now = FakeCuda(monkeypatch, count=1, current=0)  # restarted with one GPU bound per task
    rng.set_rng_state(saved)
    assert now.states[0].item() == 3


def test_as_many_gpus_restore_every_state(monkeypatch):
    FakeCuda(monkeypatch, count=2, current=1)
    saved = rng.rng_state()
    now = FakeCuda(monkeypatch, count=2, current=1)
    now.states = {0: torch.tensor([9], dtype=torch.uint8), 1: torch.tensor([9], dtype=torch.uint8)}
    rng.set_rng_state(saved)
    assert [now.states[i].item() for i in (0, 1)] == [0, 1]


def test_an_older_checkpoint_without_the_device_restores_the_first_states(monkeypatch):
    FakeCuda(monkeypatch, count=4, current=0)
    saved = rng.rng_state()
    del saved["cuda_device"]
    now = FakeCuda(monkeypatch, count=2, current=0)
    rng.set_rng_state(saved)  # no IndexError / invalid device ordinal
    assert [now.states[i].item() for i in (0, 1)] == [0, 1]
