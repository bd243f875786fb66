"""Per-step peak memory of this rank (the `mem_peak_bytes` metric).

On CUDA, `torch.cuda.max_memory_allocated` over the step. On CPU, the process's peak resident set size
over the step (Linux VmHWM, reset before the step through /proc/self/clear_refs); that includes the
interpreter and torch libraries (~0.3 GB), so compare differences. Where the reset is impossible it
is the lifetime peak (getrusage maxrss).
"""

from __future__ import annotations

import re
import resource
from pathlib import Path

import torch


class PeakMemory:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.resettable = device.type != "cuda" and self._clear_refs()

    @staticmethod
    def _clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the VmHWM high-water mark (Linux ≥ 4.0)
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            self._clear_refs()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.resettable:
            m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
            if m:
                return int(m.group(1)) * 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
