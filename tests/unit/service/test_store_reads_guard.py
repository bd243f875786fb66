"""The store's read side on SQLite, one fact per test with known answers: which jobs changed since
a time, the queue notes written only when they change and only for QUEUED jobs, counts by state,
a metric series' points through a seq, a log's tail, and the steps delivered by every series."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.store import Store
from tests.support.stores import sqlite_store
from tests.unit.service.test_store import SPEC, metric, state
from workers.protocol import JobState, LogItem


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with sqlite_store(tmp_path) as store:
        yield store


def test_changed_since_is_strictly_after_and_gives_the_next_seq(store: Store) -> None:
    old = store.jobs.create("alice", SPEC, "tok")
    time.sleep(0.02)
    new = store.jobs.create("alice", SPEC, "tok")
    t_new = store.jobs.get(new.id).updated_at
    assert store.jobs.changed_since(t_new) == {}  # written at t, not after it
    store.metrics.apply_report(new.id, [state(1, "RUNNING"), metric(2, 1), metric(3, 2)])
    got = store.jobs.changed_since(t_new)
    assert got == {new.id: store.jobs.get(new.id).next_event_seq} and old.id not in got
    assert (
        got[new.id] == 6
    )  # QUEUED 1, PLACING 2 and RUNNING 3 (RUNNING passes PLACING), points 4, 5


def test_queue_notes_are_written_only_when_they_change(store: Store) -> None:
    a = store.jobs.create("alice", SPEC, "tok")
    b = store.jobs.create("alice", SPEC, "tok")
    assert store.jobs.set_queue({}) == 0
    assert store.jobs.set_queue({a.id: (1, "waiting"), b.id: (2, "waiting")}) == 2
    assert store.jobs.set_queue({a.id: (1, "waiting"), b.id: (1, "next")}) == 1
    assert store.jobs.set_queue({b.id: (1, "next: 2 GPUs short")}) == 1  # the reason alone
    assert store.jobs.transition(a.id, JobState.PLACING, "placed")
    assert store.jobs.set_queue({a.id: (5, "late"), b.id: (1, "next: 2 GPUs short")}) == 0  # a left
    assert store.jobs.get(a.id).queue_position is None
    assert (store.jobs.get(b.id).queue_position, store.jobs.get(b.id).queue_reason) == (
        1,
        "next: 2 GPUs short",
    )
    assert store.jobs.counts_by_state() == {"QUEUED": 1, "PLACING": 1}


def test_series_through_a_seq_and_the_log_tail(store: Store) -> None:
    job = store.jobs.create("alice", SPEC, "tok")
    items = [state(1, "RUNNING"), metric(2, 1, value=3.0), metric(3, 1, "mem", 8.0, 1)]
    items += [metric(4, 2, value=2.5), metric(5, 1, "mem", 9.0, 0)]
    now = time.time()
    items += [LogItem(seq=6 + i, source="driver", line=f"line {i}", time=now) for i in range(4)]
    store.metrics.apply_report(job.id, items)
    # event seqs: QUEUED 1, PLACING 2, RUNNING 3, points 4..7, log lines 8..11
    series = store.metrics.series(job.id, through=5)
    assert [(s.name, s.rank, s.steps, s.values) for s in series] == [
        ("loss", None, [1], [3.0]),
        ("mem", 1, [1], [8.0]),
    ]
    series = store.metrics.series(job.id, through=7)
    assert [(s.name, s.rank, s.steps) for s in series] == [
        ("loss", None, [1, 2]),
        ("mem", 0, [1]),
        ("mem", 1, [1]),
    ]
    assert [r.line for r in store.metrics.log_tail(job.id, through=10, n=2)] == ["line 1", "line 2"]
    assert [r.line for r in store.metrics.log_tail(job.id, through=100, n=10)] == [
        f"line {i}" for i in range(4)
    ]
    assert store.metrics.log_tail(job.id, through=100, n=0) == []
    store.metrics.apply_report(job.id, [metric(10, 2, "act", 4.0, 1)])  # ordered by name first
    assert [(s.name, s.rank) for s in store.metrics.series(job.id, through=100)] == [
        ("act", 1),
        ("loss", None),
        ("mem", 0),
        ("mem", 1),
    ]


def test_delivered_through_is_the_slowest_series_less_one(store: Store) -> None:
    job = store.jobs.create("alice", SPEC, "tok")
    items = [state(1, "RUNNING")]
    seq = 2
    for step in range(1, 6):  # global loss to step 5, rank 0 to step 5, rank 1 to step 3
        for rank in (None, 0, 1):
            if rank == 1 and step > 3:
                continue
            items.append(metric(seq, step, "loss" if rank is None else "mem", 1.0, rank))
            seq += 1
    store.metrics.apply_report(job.id, items)
    assert store.metrics.delivered_through(job.id, world_size=2) == 2
    assert store.metrics.delivered_through(job.id, world_size=1) == 4
    assert store.metrics.delivered_through(job.id, world_size=3) == 0  # rank 2 sent nothing
