"""Every run is measured: step-phase timers, throughput and MFU, memory, NVML, stragglers, metrics.jsonl.

``Telemetry`` (processor.py) is the one object a loop talks to; the pieces live one per file:
timers.py, flops.py, memory.py, nvml.py, stragglers.py, sinks.py (metrics.jsonl), report.py (plots of a run), account.py (where a
multi-device run's speed-up went, in terms that add up), and throughput.py (Lightning's ``Throughput``, ``measure_flops``).
Importing this package imports nothing heavy; ``Telemetry`` and ``StepTimer`` load on first use.
"""

_LAZY = {"Telemetry": "trainscale.telemetry.processor", "StepTimer": "trainscale.telemetry.timers"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trainscale.telemetry' has no attribute {name!r}")
