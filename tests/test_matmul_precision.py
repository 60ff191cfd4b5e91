"""float32_matmul_precision=: resolved with the other flags, applied with
torch.set_float32_matmul_precision, and a "32-true" run on an Ampere-or-newer GPU left at "highest" says so once.
The GPU is faked (device count and compute capability); nothing here needs one."""

import pytest
import torch

from trainscale.runtime import devices
from trainscale.runtime.connector import resolve
from trainscale.runtime.precision import float32_matmul_note
from trainscale.runtime.runtime import Runtime


@pytest.fixture(autouse=True)
def _keep_matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_the_flag_is_resolved():
    assert resolve(float32_matmul_precision="high").float32_matmul_precision == "high"
    assert resolve().float32_matmul_precision is None
    with pytest.raises(ValueError, match="unknown float32_matmul_precision='low'.*'highest', 'high', 'medium'"):
        resolve(float32_matmul_precision="low")


def test_the_note_only_for_32_true_on_ampere_or_newer_at_highest():
    assert "float32_matmul_precision='high'" in float32_matmul_note("32-true", "cuda", (8, 0), "highest")
    assert float32_matmul_note("32-true", "cuda", (9, 0), "highest") is not None
    assert float32_matmul_note("32-true", "cuda", (7, 0), "highest") is None  # V100: no TF32
    assert float32_matmul_note("bf16-mixed", "cuda", (9, 0), "highest") is None
    assert float32_matmul_note("32-true", "cuda", (9, 0), "high") is None
    assert float32_matmul_note("32-true", "cpu", None, "highest") is None


def _fake_gpu(monkeypatch, capability):
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_runtime_applies_the_flag_and_says_nothing(monkeypatch, capsys):
    _fake_gpu(monkeypatch, (9, 0))
    torch.set_float32_matmul_precision("highest")
    Runtime(accelerator="cuda", float32_matmul_precision="high")
    assert torch.get_float32_matmul_precision() == "high"
    assert capsys.readouterr().out == ""


def test_runtime_says_once_that_float32_matmuls_run_at_full_precision(monkeypatch, capsys):
    _fake_gpu(monkeypatch, (8, 0))
    torch.set_float32_matmul_precision("highest")
    Runtime(accelerator="cuda")
    out = capsys.readouterr().out
    assert out.count("float32 matmuls run at full precision") == 1
    assert torch.get_float32_matmul_precision() == "highest"  # nothing changed without the flag
    Runtime(accelerator="cuda", precision="bf16-mixed")
    assert capsys.readouterr().out == ""
