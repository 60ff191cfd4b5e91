"""Peak memory of this process's device, in the spirit of fastai's ``PeakMemMetric``.

On CUDA: the peak bytes held by tensors (``torch.cuda.max_memory_allocated``) and by PyTorch's
caching allocator (``torch.cuda.max_memory_reserved``) on this rank's GPU.
https://pytorch.org/docs/stable/generated/torch.cuda.max_memory_allocated.html
On CPU (and MPS): the process's peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``,
KiB on Linux, bytes on macOS). RSS counts everything the process maps (the Python interpreter,
torch's libraries, the data set), not only tensors, and cannot be reset.
"""

from __future__ import annotations

import sys
from typing import Any


class PeakMemory:
    """Read (and on CUDA reset) the peak memory of this rank.

    Args:
        device: this rank's device (``torch.device`` or str).

    Attributes:
        kind: "cuda_allocated" or "rss" — what :meth:`peak_bytes` measures.
    """

    def __init__(self, device: Any) -> None:
        self.device = device
        self.cuda = str(device).startswith("cuda")
        self.kind = "cuda_allocated" if self.cuda else "rss"
        self._getrusage = None
        if not self.cuda:  # imported here, not at the first reading: loading the extension took ~1 ms,
            import resource  # paid inside a training step when the first record was made there

            self._getrusage = resource.getrusage  # a function, not the module: the sampler pickles (torch.save)
            self._rusage_self = resource.RUSAGE_SELF

    def peak_bytes(self) -> int:
        """Peak bytes since the start (or the last :meth:`reset`); no host-device sync."""
        if self.cuda:
            import torch

            return int(torch.cuda.max_memory_allocated(self.device))
        rss = self._getrusage(self._rusage_self).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)

    def peak_reserved_bytes(self) -> int | None:
        """Peak bytes reserved by the CUDA caching allocator; None on CPU."""
        if not self.cuda:
            return None
        import torch

        return int(torch.cuda.max_memory_reserved(self.device))

    def reset(self) -> None:
        """Start a new peak (CUDA only; the RSS peak of a process cannot be reset). Before CUDA is initialised
        there is no peak to reset (the caching allocator's statistics do not exist yet, and torch raises
        "Invalid device argument")."""
        if self.cuda:
            import torch

            if torch.cuda.is_initialized():
                torch.cuda.reset_peak_memory_stats(self.device)
