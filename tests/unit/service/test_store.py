"""The durable job store on SQLite always, and on PostgreSQL when a server is available.

PostgreSQL: `RINGTRAIN_TEST_POSTGRES_URL`, or a throwaway server started from the local binaries
(`/usr/lib/postgresql/*/bin/initdb`) on a temp dir and a free port, as a non-root user: the
session's `postgres_server` (tests.support.pg), one database per test.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import event, inspect, text

from service.db import alembic_config, make_engine, migrate
from service.models import Transition
from service.store import JobNotFound, ReportGap, Store
from tests.support.api_harness import TINY_SPEC
from tests.support.pg import fresh_pg_database
from workers.config import JobSpec
from workers.protocol import JobState, LogItem, MetricItem, StateItem

SPEC = JobSpec.model_validate(TINY_SPEC)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/store.db"
    else:
        url = fresh_pg_database(request.getfixturevalue("postgres_server"))
    engine = make_engine(url)
    migrate(engine)
    migrate(engine)  # idempotent
    published: list[tuple[str, list]] = []
    s = Store(engine)
    s.bus.listen("test", lambda jid, evs: published.append((jid, evs)))
    s.published = published  # type: ignore[attr-defined]
    yield s
    engine.dispose()


def metric(
    seq: int, step: int, name: str = "loss", value: float = 1.0, rank: int | None = None
) -> MetricItem:
    return MetricItem(seq=seq, step=step, name=name, value=value, rank=rank, time=time.time())


def state(seq: int, st: str, **kw) -> StateItem:
    return StateItem(seq=seq, state=JobState(st), time=time.time(), **kw)


def test_schema_and_create(store: Store):
    insp = inspect(store.db.engine)
    assert {"jobs", "transitions", "metric_points", "logs", "alembic_version"} <= set(
        insp.get_table_names()
    )
    job = store.jobs.create("alice", SPEC, "tok")
    got = store.jobs.get(job.id, "alice")
    assert (
        got.state == "QUEUED"
        and got.spec["name"] == "tiny"
        and got.total_steps == 5
        and got.next_event_seq == 2
    )
    with pytest.raises(JobNotFound):
        store.jobs.get(job.id, "bob")
    assert store.tokens.check(job.id, "tok") and not store.tokens.check(job.id, "nope")
    assert not store.tokens.check("jmissing", "tok")
    [t] = store.jobs.transitions(job.id)
    assert (t.from_state, t.to_state, t.seq, t.reason) == (None, "QUEUED", 1, "submitted")
    assert store.published[0][1][0].kind == "state"


def test_report_semantics(store: Store):
    job = store.jobs.create("alice", SPEC, "tok")
    batch = [
        state(1, "RUNNING", reason="placed"),
        *[metric(i + 2, i, value=float(i)) for i in range(10)],
        LogItem(seq=12, time=time.time(), line="hi"),
    ]
    assert store.metrics.apply_report(job.id, batch).acked_seq == 12
    assert store.metrics.apply_report(job.id, batch).acked_seq == 12  # idempotent
    assert len(store.metrics.points(job.id)) == 10 and len(store.metrics.logs(job.id)) == 1
    with pytest.raises(ReportGap) as gap:
        store.metrics.apply_report(job.id, [metric(14, 10)])
    assert gap.value.acked_seq == 12
    # overlap: items ≤ high-water ignored, the rest applied in order
    res = store.metrics.apply_report(job.id, [metric(12, 99), metric(13, 10), metric(14, 11)])
    assert res.acked_seq == 14 and res.points == 2
    before = max(p.seq for p in store.metrics.points(job.id))
    # supersede: resume from step 4
    store.metrics.apply_report(
        job.id, [state(15, "RETRYING", reason="rank lost", resume_step=4), state(16, "RUNNING")]
    )
    assert [p.step for p in store.metrics.points(job.id)] == [0, 1, 2, 3, 4]
    store.metrics.apply_report(job.id, [metric(17 + i, 5 + i, value=100.0 + i) for i in range(3)])
    pts = store.metrics.points(job.id)
    assert [p.step for p in pts] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert min(p.seq for p in pts if p.step >= 5) > before  # seqs never reused
    j = store.jobs.get(job.id)
    assert j.restarts == 1 and j.step == 7 and j.latest["loss"]["value"] == 102.0
    assert [t.to_state for t in store.jobs.transitions(job.id)] == [
        "QUEUED",
        "PLACING",
        "RUNNING",
        "RETRYING",
        "RUNNING",
    ]
    # NaN is stored as null; per-rank metrics keep their rank
    store.metrics.apply_report(
        job.id, [metric(20, 8, value=math.nan), metric(21, 8, "mem_peak_bytes", 1e9, rank=1)]
    )
    p = store.metrics.points(job.id, names=["loss"])[-1]
    assert p.step == 8 and p.value is None
    assert store.metrics.points(job.id, names=["mem_peak_bytes"])[0].rank == 1
    # terminal states never change
    store.metrics.apply_report(
        job.id,
        [
            state(22, "SUCCEEDED", reason="done"),
            state(23, "RUNNING"),
            state(24, "FAILED", error="late"),
        ],
    )
    j = store.jobs.get(job.id)
    assert j.state == "SUCCEEDED" and j.error is None and j.finished_at is not None
    assert not store.jobs.transition(job.id, JobState.FAILED, "reconciler")
    assert store.jobs.request_cancel(job.id).state == "SUCCEEDED"
    events = store.metrics.events_after(job.id, 0, 1000)
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs))
    assert store.metrics.events_after(job.id, seqs[-3], 2) == events[-2:]


def test_invalid_driver_transition_is_logged_not_applied(store: Store):
    job = store.jobs.create("alice", SPEC, "tok")
    store.metrics.apply_report(
        job.id, [state(1, "SUCCEEDED", reason="fast")]
    )  # implied PLACING and RUNNING
    assert [t.to_state for t in store.jobs.transitions(job.id)] == [
        "QUEUED",
        "PLACING",
        "RUNNING",
        "SUCCEEDED",
    ]
    job2 = store.jobs.create("alice", SPEC, "tok")
    store.metrics.apply_report(
        job2.id, [state(1, "RUNNING"), state(2, "QUEUED", reason="?")]
    )  # nothing goes back to QUEUED
    assert store.jobs.get(job2.id).state == "RUNNING"
    assert "ignored state report" in store.metrics.logs(job2.id)[0].line


def test_failed_write_leaves_nothing(store: Store):
    def boom(session, ctx, instances):
        if any(isinstance(o, Transition) for o in session.new):
            raise RuntimeError("disk on fire")

    event.listen(store.db.sessions, "before_flush", boom)
    try:
        with pytest.raises(RuntimeError):
            store.jobs.create("alice", SPEC, "tok")
    finally:
        event.remove(store.db.sessions, "before_flush", boom)
    assert store.jobs.page("alice") == ([], 0)
    job = store.jobs.create("alice", SPEC, "tok")
    bad = [metric(1, 0), metric(2, 1)]

    def always(session, ctx, instances):
        raise RuntimeError("x")

    event.listen(store.db.sessions, "before_flush", always)
    try:
        with pytest.raises(RuntimeError):
            store.metrics.apply_report(job.id, bad)
    finally:
        event.remove(store.db.sessions, "before_flush", always)
    assert store.metrics.points(job.id) == [] and store.jobs.get(job.id).last_report_seq == 0


def test_concurrent_reports_apply_once(store: Store):
    jobs = [store.jobs.create("alice", SPEC, "tok") for _ in range(3)]
    batches = [[metric(s, s) for s in range(1, k + 1)] for k in range(5, 45, 5)]
    errors: list[BaseException] = []

    def worker(jid: str, seed: int) -> None:
        try:
            for b in batches[seed % 3 :] + batches:
                with contextlib.suppress(ReportGap):
                    store.metrics.apply_report(jid, b)
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(j.id, i)) for j in jobs for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for j in jobs:
        pts = store.metrics.points(j.id)
        assert [p.step for p in pts] == list(range(1, 41))
        assert store.jobs.get(j.id).last_report_seq == 40


def test_listing_and_control_plane_transitions(store: Store):
    ids = [store.jobs.create("alice" if i % 2 == 0 else "bob", SPEC, "t").id for i in range(6)]
    jobs, total = store.jobs.page("alice", limit=2)
    assert total == 3 and [j.id for j in jobs] == [ids[4], ids[2]]
    assert store.jobs.transition(ids[0], JobState.PLACING, "submitted", only_from={JobState.QUEUED})
    assert not store.jobs.transition(ids[0], JobState.PLACING, "again", only_from={JobState.QUEUED})
    assert store.jobs.transition(ids[0], JobState.FAILED, "Ray said no")
    assert store.jobs.get(ids[0]).error == "Ray said no"
    assert store.jobs.counts_by_state() == {"QUEUED": 5, "FAILED": 1}
    assert len(store.jobs.active()) == 5
    c = store.jobs.request_cancel(ids[2])
    assert c.state == "CANCELLED" and c.cancel_requested
    store.jobs.set_submission(ids[4], "sub-4")
    assert (
        store.jobs.request_cancel(ids[4]).state == "QUEUED"
    )  # handed to Ray: the driver must confirm
    assert store.jobs.page(None, ["CANCELLED"])[1] == 1
    store.db.ping()
    with store.db.engine.connect() as conn:
        head = ScriptDirectory.from_config(alembic_config()).get_current_head()
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == head


def test_cancel_requested_failure_ends_cancelled(store: Store):
    job = store.jobs.create("alice", SPEC, "tok")
    store.jobs.set_submission(job.id, "sub")
    store.metrics.apply_report(job.id, [state(1, "RUNNING")])
    store.jobs.request_cancel(job.id)
    store.metrics.apply_report(
        job.id, [state(2, "FAILED", reason="driver could not run: SystemExit", error="tb")]
    )
    j = store.jobs.get(job.id)
    assert j.state == "CANCELLED" and j.error is None
    assert "while stopping" in store.jobs.transitions(job.id)[-1].reason


def test_every_named_listener_gets_the_events_the_store_replays(
    store: Store, caplog: pytest.LogCaptureFixture
):
    """Live events (the bus) and replayed ones (`events_after`) come from the same builders: equal."""
    seen: list[tuple[str, list]] = []
    store.bus.listen("second", lambda jid, evs: seen.append((jid, evs)))
    with pytest.raises(ValueError, match="'second' is already registered"):
        store.bus.listen("second", lambda jid, evs: None)

    def broken(jid: str, evs: list) -> None:
        raise RuntimeError("listener bug")

    job = store.jobs.create("alice", SPEC, "tok")
    store.bus.listen("broken", broken)
    assert store.bus.names() == ["test", "second", "broken"]
    items = [
        state(1, "RUNNING"),
        metric(2, 1, value=0.5),
        metric(3, 1, "mem", math.inf, rank=1),
        LogItem(seq=4, time=12.5, source="driver", line="hello"),
        state(5, "SUCCEEDED"),
    ]
    with caplog.at_level("ERROR", logger="ringtrain.store"):
        res = store.metrics.apply_report(
            job.id, items
        )  # a failing listener does not fail the write
    assert res.acked_seq == 5 and store.jobs.get(job.id).state == "SUCCEEDED"
    assert [r.getMessage() for r in caplog.records] == [
        f"event listener 'broken' failed on job {job.id}"
    ]
    live = [e for jid, evs in store.published for e in evs if jid == job.id]
    assert [e for jid, evs in seen for e in evs if jid == job.id] == live
    assert live == store.metrics.events_after(job.id, 0)
    kinds = [(e.seq, e.kind) for e in live]
    assert kinds == [
        (1, "state"),
        (2, "state"),
        (3, "state"),
        (4, "metric"),
        (5, "metric"),
        (6, "log"),
        (7, "state"),
    ]
    assert live[4].data == {
        "seq": 5,
        "step": 1,
        "name": "mem",
        "value": None,
        "rank": 1,
        "time": items[2].time,
    }


def test_the_app_needs_an_upgraded_database(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Building the app never migrates: it refuses an old schema naming the fix, `ringtrain db upgrade`."""
    from api.app import create_app
    from api.cli import main
    from service.db import SchemaOutdated
    from tests.support.api_harness import RecordingLauncher, make_settings

    settings = make_settings(tmp_path)
    with pytest.raises(
        SchemaOutdated, match=r"at schema revision \(none\), not .*ringtrain db upgrade"
    ):
        create_app(settings, RecordingLauncher())
    assert main(["db", "upgrade", "--database-url", settings.database_url]) == 0
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert capsys.readouterr().out == f"database schema at revision {head}\n"
    assert main(["db", "upgrade", "--database-url", settings.database_url]) == 0  # idempotent
    app = create_app(settings, RecordingLauncher())
    assert app.state.ctx.store.bus.names() == ["sse"]  # no tracker configured: the hub only
