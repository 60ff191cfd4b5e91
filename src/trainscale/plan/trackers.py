"""PyTorch's memory trackers, keeping the tracker-wide peak only.

``MemTracker`` and ``FSDPMemTracker`` (``torch.distributed._tools``) call ``_update_peak_stats`` after every
operator: it raises the peak of the whole tracker and, for each module that is running, that module's own peak
(``memory_tracking[module].local_peak``), walking the statistics of every module seen so far to find them. The plan
reads the tracker-wide snapshots only (``get_tracker_snapshot("current")`` and ``("peak")``), never the per-module
peaks. docs/plan.md's worked example (GPT-124M, ddp, fsdp and 8 pipeline stages) took 40-42 s here with PyTorch's
trackers and 26-28 s with these, the same table printed byte for byte (2026-11-28, torch 2.13, 2 cores shared with
other jobs, runs alternated). The snapshots and every byte count are those of PyTorch's trackers: only the
per-module peaks, which nothing here reads, stay unset.
"""

from __future__ import annotations

from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker

_TOTAL = "Total"  # the key of a snapshot's sum of all reference types (mem_tracker._TOTAL_KEY)


class _TrackerPeak:
    """``_update_peak_stats`` as PyTorch's trackers define it, without its per-module part (units: bytes)."""

    _curr_mem_snap: dict
    _peak_mem: dict
    _peak_mem_snap: dict

    def _update_peak_stats(self, peak_state) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL]:
                self._peak_mem[device] = snapshot[_TOTAL]
                self._peak_mem_snap[device] = dict(snapshot)  # bytes per reference type: ints, a shallow copy


class PeakMemTracker(_TrackerPeak, MemTracker):
    """``MemTracker`` whose ``get_tracker_snapshot("peak")`` is kept, the per-module peaks not."""


class PeakFSDPMemTracker(_TrackerPeak, FSDPMemTracker):
    """``FSDPMemTracker(mod, optm)`` whose ``get_tracker_snapshot("peak")`` is kept, the per-module peaks not."""
