"""Fencing a job's checkpoint directory: once a newer attempt takes the lease, an older attempt's ranks (cut off
by a partition, say) write nothing more — no checkpoint, no rotation, no journal line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.trainutil import one_thread, tiny_spec
from workers.protocol import MetricPoint
from workers.training.checkpoint import list_steps
from workers.training.journal import read_journal
from workers.training.lease import Fenced, Lease
from workers.training.trainer import run_training

assert one_thread  # autouse fixture, imported to apply to this module


def test_the_newest_taker_holds_the_lease(tmp_path: Path) -> None:
    old = Lease.take(tmp_path, "d0-r0")
    assert old.held()
    new = Lease.take(tmp_path, "d0-r1")
    assert new.held() and not old.held() and new.token != old.token
    with pytest.raises(Fenced):
        old.check()
    new.check()


def test_a_fenced_trainer_stops_writing(tmp_path: Path) -> None:
    spec = tiny_spec(train={"steps": 6}, checkpoint={"every_steps": 1, "keep": 10})
    lease = Lease.take(tmp_path, "d0-r0")
    seen: list[MetricPoint] = []

    def emit(p: MetricPoint) -> None:
        seen.append(p)
        if p.step == 2 and p.name == "loss":
            Lease.take(
                tmp_path, "d1-r0"
            )  # a resubmitted driver takes the directory while this attempt runs

    with pytest.raises(Fenced):
        run_training(spec, checkpoint_dir=tmp_path, emit=emit, lease=lease)
    assert list_steps(tmp_path) == [1]  # step 2's checkpoint was refused, nothing after it
    assert max(p.step for p in read_journal(tmp_path, 0)) == 2
    assert max(p.step for p in seen) == 2

    unfenced = tmp_path / "plain"  # without a lease (torchrun) nothing changes
    result = run_training(spec, checkpoint_dir=unfenced, emit=lambda p: None, max_steps=3)
    assert result.final_step == 3 and list_steps(unfenced) == [1, 2, 3]
