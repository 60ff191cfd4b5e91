"""NVML finds the GPU that CUDA calls device i by its UUID, whatever CUDA_DEVICE_ORDER
and CUDA_VISIBLE_DEVICES (indices, partial UUIDs) say. pynvml and the CUDA device properties are faked."""

import types

import pytest
import torch

from trainscale.telemetry import nvml

# CUDA's device 0 and 1, and NVML's devices in PCI bus order (the other way round here)
CUDA_UUIDS = ["6f1c2b1e-0000-4000-8000-00000000000b", "6f1c2b1e-0000-4000-8000-00000000000a"]
NVML = {b"GPU-6f1c2b1e-0000-4000-8000-00000000000a": ("pci0", 10.0, 1e9),
        b"GPU-6f1c2b1e-0000-4000-8000-00000000000b": ("pci1", 90.0, 7e9)}


class _NVMLError(Exception):
    pass


def _fake_pynvml():
    def by_uuid(uuid):
        if uuid not in NVML:
            raise _NVMLError(uuid)
        return NVML[uuid]

    def by_index(index):  # NVML's own order; a mapping by index would read the wrong GPU
        return list(NVML.values())[index]

    return types.SimpleNamespace(
        NVMLError=_NVMLError, nvmlInit=lambda: None, nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetHandleByIndex=by_index,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=h[1]),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=h[2]))


@pytest.mark.parametrize("env", [{}, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
                                 {"CUDA_VISIBLE_DEVICES": "GPU-6f1c2b1e-0000-4000-8000-00000000000b,GPU-6f1"}])
def test_each_cuda_device_reads_its_own_gpu(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", _fake_pynvml())
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid=CUDA_UUIDS[i]))
    assert nvml._nvml_reader(0)() == (90.0, 7e9)  # CUDA's device 0 is NVML's "...0b"
    assert nvml._nvml_reader(1)() == (10.0, 1e9)


def test_a_uuid_nvml_does_not_know_means_not_available(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", _fake_pynvml())
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="unknown"))
    assert nvml._nvml_reader(0) is None
