"""float32_matmul_precision=: resolved with the other flags, applied with
torch.set_float32_matmul_precision, and a "32-true" run on an Ampere-or-newer GPU left at "highest" says so once.
The GPU is faked (device count and compute capability); nothing here needs one."""

import pytest
import torch

from trainscale.runtime import devices
from trainscale.runtime.connector import resolve
from trainscale.runtime.precision import float32_matmul_note, tf32_enabled
from trainscale.runtime.runtime import Runtime


NEW_API = hasattr(torch.backends, "fp32_precision")  # torch >= 2.9: per-backend fp32_precision


@pytest.fixture(autouse=True)
def _keep_matmul_precision():
    before = torch.get_float32_matmul_precision()
    conv = torch.backends.cudnn.conv.fp32_precision if NEW_API else None
    yield
    torch.set_float32_matmul_precision(before)  # the legacy setter also resets the per-backend matmul value
    if NEW_API:
        torch.backends.cudnn.conv.fp32_precision = conv


def test_the_flag_is_resolved():
    assert resolve(float32_matmul_precision="high").float32_matmul_precision == "high"
    assert resolve().float32_matmul_precision is None
    with pytest.raises(ValueError, match="unknown float32_matmul_precision='low'.*'highest', 'high', 'medium'"):
        resolve(float32_matmul_precision="low")


def test_the_note_only_for_32_true_on_ampere_or_newer_at_full_precision():
    assert "float32_matmul_precision='high'" in float32_matmul_note("32-true", "cuda", (8, 0), False)
    assert float32_matmul_note("32-true", "cuda", (9, 0), False) is not None
    assert float32_matmul_note("32-true", "cuda", (7, 0), False) is None  # V100: no TF32
    assert float32_matmul_note("bf16-mixed", "cuda", (9, 0), False) is None
    assert float32_matmul_note("32-true", "cuda", (9, 0), True) is None  # TF32 on already
    assert float32_matmul_note("32-true", "cpu", None, False) is None


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


new_api_only = pytest.mark.skipif(not NEW_API, reason="torch < 2.9 has no per-backend fp32_precision")


@new_api_only
def test_tf32_is_read_through_the_per_backend_api_once_it_is_set():
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.get_float32_matmul_precision()  # what trainscale read before: the reproduction
    assert tf32_enabled() == (True, True)  # cuDNN convolutions: TF32 by default
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    assert tf32_enabled() == (False, False)
    torch.set_float32_matmul_precision("high")  # the legacy setter reads back through the new API
    assert tf32_enabled()[0] is True


@new_api_only
def test_runtime_and_trainer_start_after_the_new_api_was_used(monkeypatch, capsys, tmp_path):
    from trainscale import Trainer

    torch.backends.cuda.matmul.fp32_precision = "tf32"
    Runtime(accelerator="cpu")  # raised "mix of the legacy and new APIs"
    Trainer(accelerator="cpu", default_root_dir=tmp_path, enable_progress_bar=False)
    _fake_gpu(monkeypatch, (9, 0))
    Runtime(accelerator="cuda")
    assert capsys.readouterr().out == ""  # TF32 is on: no note
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    Runtime(accelerator="cuda")
    assert capsys.readouterr().out.count("float32 matmuls run at full precision") == 1


@new_api_only
def test_the_peak_flops_follow_the_new_api():
    from trainscale.telemetry.processor import Telemetry

    tele = Telemetry(Runtime(accelerator="cpu"))
    tele._device_name = "NVIDIA H100 80GB HBM3"  # the table's row of a GPU, read on CPU
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert tele.peak_flops_per_device() == 494e12  # raised "mix of the legacy and new APIs"
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    assert tele.peak_flops_per_device() == 67e12
    tele.close()



@pytest.mark.gpu
@new_api_only
def test_on_a_gpu_tf32_set_through_the_new_api_is_read(capsys, tmp_path):
    from trainscale import Trainer

    torch.backends.cuda.matmul.fp32_precision = "tf32"
    Runtime(accelerator="cuda", devices=1)
    Trainer(accelerator="cuda", devices=1, default_root_dir=tmp_path, enable_progress_bar=False)
    assert "full precision" not in capsys.readouterr().out
