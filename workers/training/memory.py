"""Per-step peak memory of this rank (the `mem_peak_bytes` metric), and what a step's memory is made
of.

What `mem_peak_bytes` measures:

- CUDA: `torch.cuda.max_memory_allocated` over the step (live tensors; the caching allocator's
  reserve and NCCL's buffers are not in it).
- CPU: the process's peak resident set size over the step (Linux VmHWM, reset before the step
  through /proc/self/clear_refs), i.e. everything the process holds: the interpreter and torch
  libraries (~0.3 GB), the training state, the step's tensors, and whatever the C allocator keeps
  after tensors are freed. Where the reset is impossible it is the lifetime peak (getrusage maxrss).

The last part made the CPU figure dishonest: glibc serves tensors below its mmap threshold (dynamic,
up to 32 MiB) from arenas and keeps freed chunks there, so a step's peak RSS also held the garbage
of earlier steps and of FSDP's transient gathers. `bound_allocator_retention` fixes the threshold at
1 MiB (every tensor larger than that is its own mapping, returned to the system when freed), and
`reset` trims what the arenas still hold before the peak is reset, so the peak is the step's own.
`RINGTRAIN_MALLOC=glibc` keeps glibc's default behaviour (for comparisons).

`LiveTensors` (a dispatch mode) attributes a step's live tensor bytes to what created them;
`bench/memory.py --breakdown` uses it."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import re
import resource
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
MMAP_THRESHOLD_BYTES = 1 << 20


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def bound_allocator_retention() -> bool:
    """Large allocations become their own mappings (freed memory goes back at once). False if not
    glibc."""
    if os.environ.get("RINGTRAIN_MALLOC", "") == "glibc":
        return False
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    return bool(ok and libc.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES) == 1)


def release_freed_memory() -> None:
    """Collect garbage and hand the C allocator's free pages back to the system."""
    gc.collect()
    if os.environ.get("RINGTRAIN_MALLOC", "") == "glibc":
        return
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def rss_bytes() -> int:
    m = re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(m.group(1)) * 1024 if m else 0


class PeakMemory:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.resettable = device.type != "cuda" and self._clear_refs()
        if device.type != "cuda":
            bound_allocator_retention()

    @staticmethod
    def _clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the VmHWM high-water mark (Linux >= 4.0)
            return True
        except OSError:
            return False

    @contextlib.contextmanager
    def steady(self) -> Iterator[None]:
        """The training loop: what exists when it starts (modules, the model, the loaded state) is
        frozen out of the garbage collector, so `reset`'s collection each step walks only the
        objects made since. A full collection walks every object in the process: 0.2-0.8 s a step
        (more in a long-lived process), which was most of a small CPU step."""
        if not self.resettable:
            yield
            return
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            release_freed_memory()
            self._clear_refs()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.resettable:
            m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
            if m:
                return int(m.group(1)) * 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class LiveTensors(TorchDispatchMode):
    """Live bytes of the tensors created while active, by label (`phase` set by the caller, plus the
    op, and with `shapes` the created tensor's shape).

    Each new storage is counted from the op that created it until it is freed (a weakref finalizer)
    or resized to nothing (FSDP frees a gathered parameter that way while its storage object lives
    on, and counted once when it is resized back); `at_peak` is the breakdown when the total was
    highest. Tensors created before (parameters, optimizer state) are not counted: add them from
    their own metrics. A view of one of them is the first time the tracker sees its storage, so pass
    them as `exclude` where they matter (a module's parameters)."""

    def __init__(self, shapes: bool = False, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.phase = "forward"
        self.shapes = shapes
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.total = self.peak = 0  # `total` counts every storage at its size when created
        self.at_peak: dict[str, int] = {}
        self._live: dict[int, tuple[weakref.ref[torch.UntypedStorage], str, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                shape = tuple(t.shape) if self.shapes else ""
                self._track(t, f"{self.phase}:{func.overloadpacket.__name__}{shape}")
        return out

    def _track(self, t: torch.Tensor, label: str) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        nbytes = storage.nbytes()
        if key == 0 or nbytes == 0 or key in self._excluded:
            return
        if key in self._live:
            held = self._live[key][0]()
            if held is not None and held.data_ptr() == key:
                return  # a view of a storage already counted
            self.total -= self._live.pop(key)[2]  # that storage was resized away: this one is new
        self._live[key] = (weakref.ref(storage), label, nbytes)
        self.total += nbytes
        if self.total > self.peak:  # an upper bound: recount at today's sizes before taking it
            self._recount()
        weakref.finalize(storage, self._free, key, nbytes)

    def _recount(self) -> None:
        live: Counter[str] = Counter()
        seen: set[int] = set()
        # newest first: a storage FSDP resized away and back (a re-gathered parameter) sits under
        # its old and its new address; it counts once, under the label of the op that refilled it
        for ref, label, _ in reversed(self._live.values()):
            storage = ref()
            if storage is not None and id(storage) not in seen:
                seen.add(id(storage))
                live[label] += storage.nbytes()
        now = sum(live.values())
        if now > self.peak:
            self.peak, self.at_peak = now, {k: v for k, v in live.items() if v}

    def _free(self, key: int, nbytes: int) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[2] == nbytes and entry[0]() is None:
            del self._live[key]
            self.total -= nbytes
