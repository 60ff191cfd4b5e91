"""Peak FLOP/s and MFU: exact product matching, the newer GPUs, TF32 under "32-true",
the user's peak_flops=, and MFU > 1 flagged as a measurement error; and the log interval's one gather and one
host copy. Pure logic: no GPU needed."""

from types import SimpleNamespace

import pytest
import torch

from trainscale.runtime.connector import RunConfig
from trainscale.telemetry import flops
from trainscale.telemetry.processor import _IDX, Telemetry


@pytest.mark.parametrize("name, bf16", [
    ("NVIDIA L4", 121e12), ("NVIDIA L40S", 366e12),           # "L4" is not "L40S"
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A10", 125e12),  # nor "A10" "A100"
    ("NVIDIA RTX A1000", None), ("NVIDIA A10G", None),         # nor "A100" "RTX A1000"; A10G: no NVIDIA data sheet
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA B200", 2250e12), ("NVIDIA H800", 989e12), ("NVIDIA H800 PCIe", 756e12),
    ("NVIDIA A800-SXM4-80GB", 312e12), ("Tesla V100-SXM2-16GB", None), (None, None),
])
def test_products_match_exactly(name, bf16):
    assert flops.peak_flops_per_s(name, "bf16-mixed") == bf16


def test_fp16_and_fp32_peaks_by_form_factor():
    assert flops.peak_flops_per_s("Tesla V100-SXM2-16GB", "16-mixed") == 125e12
    assert flops.peak_flops_per_s("Tesla V100-PCIE-32GB", "16-mixed") == 112e12
    assert flops.peak_flops_per_s("NVIDIA A100-SXM4-80GB", "32-true") == 19.5e12  # TF32 off: the FP32 rate


def test_32_true_uses_the_tf32_peak_for_what_runs_in_tf32():
    h100 = "NVIDIA H100 80GB HBM3"
    assert flops.peak_flops_per_s(h100, "32-true", tf32_matmul=True) == 494e12
    assert flops.peak_flops_per_s(h100, "32-true", tf32_conv=True) == 67e12  # no convolutions: matmuls at FP32
    assert flops.peak_flops_per_s(h100, "32-true", tf32_conv=True, conv_share=1.0) == 494e12
    half = flops.peak_flops_per_s(h100, "32-true", tf32_conv=True, conv_share=0.5)
    assert half == pytest.approx(1 / (0.5 / 494e12 + 0.5 / 67e12))  # the time-weighted (harmonic) peak
    assert flops.peak_flops_per_s("Tesla T4", "32-true", tf32_matmul=True) == 8.1e12  # no TF32 before Ampere


def _telemetry(**kwargs):
    printed = []
    rt = SimpleNamespace(device=torch.device("cpu"), config=RunConfig("cpu", 1, 1, "single", "bf16-mixed"),
                         is_rank_zero=True, world_size=1, data_parallel_size=1, strategy=None, print=printed.append)
    return Telemetry(rt, **kwargs), printed


def _numbers(tele, samples_per_s):
    row = [{"steps": 10.0, "wall": 1.0, "samples": samples_per_s, "loss": float("nan"),
            "gpu_util": float("nan")}.get(name, 0.0) for name in _IDX]
    return tele._numbers([row], per_rank=True)


def test_the_users_peak_flops_gives_the_mfu():
    tele, _ = _telemetry(peak_flops=1e12)
    tele.flops.value = 1e9
    assert _numbers(tele, 500.0)["mfu"] == pytest.approx(0.5)
    assert tele.peak_flops_per_device() == 1e12
    for bad in (0, -1.0, "989e12", True):
        with pytest.raises(ValueError, match="peak_flops=.*positive number of FLOP/s"):
            _telemetry(peak_flops=bad)


def test_mfu_over_one_is_flagged_as_a_measurement_error_once():
    tele, printed = _telemetry(peak_flops=1e12)
    tele.flops.value = 1e10
    first, second = _numbers(tele, 200.0), _numbers(tele, 300.0)
    assert first["mfu"] == pytest.approx(2.0) and first["mfu_error"] == flops.MFU_ERROR
    assert "measurement error" in second["mfu_error"] and len(printed) == 1 and "MFU 2.00" in printed[0]
    assert "mfu_error" not in _numbers(tele, 50.0)


def test_logging_gathers_once_and_copies_to_the_host_once(monkeypatch):
    """W ranks' rows come back with one collective and one device-to-host copy."""
    import torch.distributed as dist

    tele, _ = _telemetry()
    tele.rt.world_size = 4
    collectives, copies = [], []

    def all_gather_single(out, local):  # the 4 ranks' rows: rank r sent local + r
        collectives.append(out.shape)
        out.copy_(torch.cat([local + r for r in range(4)]))

    monkeypatch.setattr(dist, "all_gather_single", all_gather_single, raising=False)
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: copies.append(t.shape) or tolist(t))
    rows = tele._gather([1.0, 2.0, 3.0])
    assert rows == [[1.0 + r, 2.0 + r, 3.0 + r] for r in range(4)]
    assert collectives == [(4, 3)] and copies == [(4, 3)]
