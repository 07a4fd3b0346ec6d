"""The most memory one request needed, as the actor can measure it.

On a GPU: the CUDA caching allocator's peak of allocated bytes since the request began
(`torch.cuda.reset_peak_memory_stats` at its start). On a CPU: the process's peak resident
set since the request began — Linux resets the high-water mark (VmHWM) when "5" is
written to /proc/self/clear_refs. That is the whole process (Python, torch, weights, KV
cache, activations), which is what the slot has to hold. Where neither works the figure
is None, never a guess.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


class PeakMemory:
    def __init__(self, is_cuda: bool) -> None:
        self.is_cuda = is_cuda
        self._is_supported = True

    def reset(self) -> None:
        if self.is_cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
            return
        try:
            _CLEAR_REFS.write_text("5")
        except OSError:  # not Linux, or a kernel without it: no per-request figure
            self._is_supported = False

    def read(self) -> int | None:
        if self.is_cuda:
            import torch

            return int(torch.cuda.max_memory_allocated())
        if not self._is_supported:
            return None
        try:
            for line in _STATUS.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
        except OSError:
            pass
        return None
