"""Memory accounting (workers/training/memory.py) guards the fast tier lacked: the CPU peak is in
bytes and its reset drops earlier garbage (the `mem_peak_bytes` metric), and `LiveTensors` labels,
exclusions and peak breakdown, checked against byte counts worked out by hand."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from workers.training.memory import LiveTensors, PeakMemory, rss_bytes


def _statm_rss() -> int:
    """Resident bytes from /proc/self/statm (pages): a second reading of the same number."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def test_rss_is_in_bytes() -> None:
    a, b = _statm_rss(), rss_bytes()
    assert abs(b - a) < 0.01 * a, (a, b)


def test_cpu_peak_is_in_bytes_and_reset_forgets_freed_memory() -> None:
    mem = PeakMemory(torch.device("cpu"))
    if not mem.resettable:
        pytest.skip("/proc/self/clear_refs is not writable here")
    big = torch.ones(48 << 20, dtype=torch.uint8)  # 48 MiB, touched
    mem.reset()
    before, with_big, after = rss_bytes(), mem.peak(), rss_bytes()
    # reset: the peak is the RSS of now (a few pages either way: reading /proc allocates)
    assert before - (4 << 20) <= with_big <= after + (4 << 20), (before, with_big, after)
    assert with_big > (48 << 20)
    del big
    mem.reset()  # freed memory went back to the system: the new peak is without it
    assert mem.peak() < with_big - (32 << 20)


def test_live_tensors_peak_breakdown_by_op() -> None:
    with LiveTensors() as t:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # 4000
        del b
        c = torch.zeros(250, dtype=torch.float64)  # 2000
    assert t.peak == 8000 and t.at_peak == {"forward:ones": 4000, "forward:mul": 4000}
    assert c.numel() == 250


def test_live_tensors_skip_excluded_storages_and_their_views() -> None:
    x = torch.ones(100)
    with LiveTensors(exclude=[x]) as t:
        v = x.view(10, 10)
        y = x + 1  # 400 bytes, the only new storage
    assert t.at_peak == {"forward:add": 400} and t.peak == 400
    assert v.shape == (10, 10) and y.sum() == 200


def test_live_tensors_leave_released_storages_out_of_the_breakdown() -> None:
    """A storage resized to nothing (how FSDP frees a gathered parameter) holds no bytes: the
    breakdown at the next peak does not name it."""
    with LiveTensors() as t:
        a = torch.ones(1000)
        a.untyped_storage().resize_(0)
        b = torch.zeros(2000)  # 8000 bytes
    assert t.peak == 8000 and t.at_peak == {"forward:zeros": 8000}
    assert b.numel() == 2000


def test_live_tensors_shapes_only_when_asked() -> None:
    with LiveTensors(shapes=True) as t:
        a = torch.ones(3, 5)
    assert t.at_peak == {"forward:ones(3, 5)": 60} and a.numel() == 15


def test_live_tensors_count_a_refilled_storage_under_the_op_that_refilled_it() -> None:
    """FSDP frees a gathered parameter by resizing its storage to nothing and later resizes it
    back and copies into it (at a new address): the storage then sits in the tracker under both
    addresses, and the next peak counts it once, as the refill."""
    t = LiveTensors()
    with t:
        a = torch.ones(1000)
        old = a.untyped_storage().data_ptr()
        a.untyped_storage().resize_(0)
    blocker = torch.empty(1000)  # untracked: takes the freed block, so the refill lands elsewhere
    with t:
        a.untyped_storage().resize_(8000)  # larger, too: it cannot fit the old block
        a.fill_(2.0)
        b = torch.zeros(10)
    assert a.untyped_storage().data_ptr() != old
    assert t.peak == 8040 and t.at_peak == {"forward:fill_": 8000, "forward:zeros": 40}
    assert blocker.numel() == 1000 and b.numel() == 10
