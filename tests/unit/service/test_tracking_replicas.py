"""Tracking export with replicas (service/tracking.py): only the leader exports, from the store, so
a point any replica stored reaches the tracker exactly once, a resume stored elsewhere replaces the
export, and a takeover re-exports from scratch while the deposed leader writes nothing more.

Two replicas are two `Store`s on one SQLite file, each with its own event bus (as two processes
have); the tracker is one `Tracker` both replicas' sinks write to, keeping MLflow's semantics that
matter here: `begin` makes a new run and deletes the job's earlier ones, and a deleted run takes no
more points.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from service.db import make_engine, migrate
from service.store import Store
from service.tracking import Exporter, JobView, Point, Sink
from tests.unit.service.test_store import SPEC, metric, state


@dataclass
class Run:
    by: str
    points: list[tuple[int, str, float]] = field(default_factory=list)
    state: str | None = None
    deleted: bool = False


class Tracker:
    """One tracking server both replicas export to; records who wrote what."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: dict[str, list[Run]] = {}
        self.calls: list[tuple[str, str]] = []  # (replica, call)

    def live(self, job_id: str) -> list[Run]:
        with self.lock:
            return [r for r in self.runs.get(job_id, []) if not r.deleted]


class FakeSink:
    name = "fake"

    def __init__(self, tracker: Tracker, replica: str) -> None:
        self.tracker, self.replica = tracker, replica
        self.run: dict[str, Run] = {}

    def begin(self, job: JobView) -> None:
        with self.tracker.lock:
            self.tracker.calls.append((self.replica, "begin"))
            for old in self.tracker.runs.get(job.id, []):
                old.deleted = True
            run = Run(self.replica)
            self.tracker.runs.setdefault(job.id, []).append(run)
            self.run[job.id] = run

    def write(self, job: JobView, points: Sequence[Point]) -> None:
        with self.tracker.lock:
            self.tracker.calls.append((self.replica, "write"))
            run = self.run[job.id]
            if run.deleted:
                raise RuntimeError("the run must be in the 'active' state")
            run.points += [(p.step, p.tag, p.value) for p in points]

    def finish(self, job: JobView) -> None:
        with self.tracker.lock:
            self.tracker.calls.append((self.replica, "finish"))
            self.run[job.id].state = job.state

    def close(self) -> None:
        self.run.clear()


def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    url = f"sqlite:///{tmp_path}/store.db"
    engines = [make_engine(url), make_engine(url)]
    migrate(engines[0])
    yield Store(engines[0]), Store(engines[1])
    for e in engines:
        e.dispose()


def exporter(
    store: Store, tracker: Tracker, replica: str, sweep_s: float = 0.05
) -> tuple[Exporter, list[int]]:
    made: list[int] = []

    def sinks() -> list[Sink]:
        made.append(1)
        return [FakeSink(tracker, replica)]

    ex = Exporter(
        store,
        sinks,
        model_path=lambda job_id: f"/models/{job_id}",
        note=lambda job_id, line: None,
        flush_s=0.01,
        retry_max_s=0.1,
        sweep_s=sweep_s,
    )
    store.bus.listen("tracking", ex.notify)
    return ex, made


def stored(store: Store, job_id: str) -> list[tuple[int, str, float]]:
    return [(p.step, p.name, float(p.value or 0)) for p in store.metrics.points(job_id)]


def exported_once(tracker: Tracker, store: Store, job_id: str) -> Run:
    (run,) = tracker.live(job_id)  # one live run
    assert sorted(run.points) == sorted(stored(store, job_id))  # every point, none twice
    return run


def test_only_the_leader_exports_and_a_followers_points_reach_it(
    replicas: tuple[Store, Store],
) -> None:
    lead, follow = replicas
    tracker = Tracker()
    a, _ = exporter(lead, tracker, "a")
    b, made_b = exporter(follow, tracker, "b")
    a.start()  # a leads; b follows (never started)
    try:
        job = follow.jobs.create("alice", SPEC, "tok")  # through the follower
        batch = [state(1, "RUNNING"), *[metric(i + 2, i, value=float(i)) for i in range(10)]]
        follow.metrics.apply_report(job.id, batch)  # ingest on the follower: a's bus hears nothing
        until(lambda: sum(len(r.points) for r in tracker.live(job.id)) == 10)
        follow.metrics.apply_report(job.id, [metric(12, 10, value=10.0)])
        a.remote(job.id)  # the follower's notice
        follow.metrics.apply_report(job.id, [state(13, "SUCCEEDED", reason="done")])
        until(lambda: any(r.state == "SUCCEEDED" for r in tracker.live(job.id)))
        run = exported_once(tracker, follow, job.id)
        assert run.by == "a" and len(run.points) == 11
        assert made_b == [1]  # b only checked its sinks at start-up, and never exported
        assert {who for who, _ in tracker.calls} == {"a"}
        until(a.idle)
        n = len(tracker.calls)
        time.sleep(0.3)  # sweeps go on: a finished job is not exported again
        assert len(tracker.calls) == n
    finally:
        a.stop()
        b.stop()  # never started: nothing to stop


def test_a_resume_stored_by_a_follower_replaces_the_export(replicas: tuple[Store, Store]) -> None:
    lead, follow = replicas
    tracker = Tracker()
    a, _ = exporter(lead, tracker, "a", sweep_s=60)  # no sweep after the first: notices only
    a.start()
    try:
        job = follow.jobs.create("alice", SPEC, "tok")
        batch = [state(1, "RUNNING"), *[metric(i + 2, i, value=float(i)) for i in range(10)]]
        follow.metrics.apply_report(job.id, batch)
        a.remote(job.id)
        until(lambda: sum(len(r.points) for r in tracker.live(job.id)) == 10)
        resume = [state(12, "RETRYING", reason="rank lost", resume_step=4), state(13, "RUNNING")]
        redo = [metric(14 + i, 5 + i, value=100.0 + i) for i in range(3)]
        follow.metrics.apply_report(job.id, [*resume, *redo])  # steps 5..9 superseded
        a.remote(job.id)  # says nothing of the resume: the exporter reads it from the store
        until(lambda: [len(r.points) for r in tracker.live(job.id)] == [8])
        run = exported_once(tracker, follow, job.id)
        assert (5, "loss", 100.0) in run.points and (9, "loss", 9.0) not in run.points
        assert len(tracker.runs[job.id]) == 2  # the first run was replaced, not added to
    finally:
        a.stop()


def test_a_takeover_exports_from_scratch_and_the_deposed_leader_writes_nothing_more(
    replicas: tuple[Store, Store],
) -> None:
    one, two = replicas
    tracker = Tracker()
    leads = threading.Event()
    leads.set()
    a, _ = exporter(one, tracker, "a")
    b, _ = exporter(two, tracker, "b")
    a.start(leads.is_set)
    try:
        running = one.jobs.create("alice", SPEC, "tok")
        ending = one.jobs.create("alice", SPEC, "tok")
        for job in (running, ending):
            first = [state(1, "RUNNING"), *[metric(i + 2, i) for i in range(5)]]
            one.metrics.apply_report(job.id, first)
        until(lambda: all(len(tracker.live(j.id)) == 1 for j in (running, ending)))
        until(lambda: sum(len(r.points) for r in tracker.live(running.id)) == 5)
        leads.clear()  # a's term is over (it may still be running: cut off, not dead)
        n = len([c for c in tracker.calls if c[0] == "a"])
        # reports keep landing, on either replica, while nobody leads
        one.metrics.apply_report(running.id, [metric(7 + i, 5 + i) for i in range(3)])
        two.metrics.apply_report(ending.id, [metric(7, 5), state(8, "SUCCEEDED", reason="ok")])
        time.sleep(0.3)
        assert len([c for c in tracker.calls if c[0] == "a"]) == n  # a wrote nothing more
        a.stop()
        b.start()  # the new leader: every active job, and the one that just ended, from scratch
        until(lambda: any(r.state == "SUCCEEDED" for r in tracker.live(ending.id)))
        until(lambda: sum(len(r.points) for r in tracker.live(running.id)) == 8)
        for job in (running, ending):
            run = exported_once(tracker, two, job.id)
            assert run.by == "b"
        two.metrics.apply_report(running.id, [metric(10, 8), state(11, "SUCCEEDED")])
        until(lambda: any(r.state == "SUCCEEDED" for r in tracker.live(running.id)))
        assert exported_once(tracker, two, running.id).points[-1][0] == 8
    finally:
        a.stop()
        b.stop()
