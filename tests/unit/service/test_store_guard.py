"""The jobs aggregate's bookkeeping on SQLite, one fact per test: what each transition records, what a
cancel and a lost driver change, and what report ingestion keeps. Known answers, no server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.db import make_engine, migrate
from service.store import Store
from tests.support.api_harness import TINY_SPEC
from workers.config import JobSpec
from workers.protocol import JobState, MetricItem, StateItem

SPEC = JobSpec.model_validate({**TINY_SPEC, "max_restarts": 2})


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    engine = make_engine(f"sqlite:///{tmp_path}/store.db")
    migrate(engine)
    yield Store(engine)
    engine.dispose()


def state(seq: int, st: str, **kw: object) -> StateItem:
    return StateItem(seq=seq, state=JobState(st), time=time.time(), **kw)  # type: ignore[arg-type]


def metric(
    seq: int, step: int, name: str = "loss", rank: int | None = None, replay: bool = False
) -> MetricItem:
    value = 1.0 + step
    return MetricItem(
        seq=seq, step=step, name=name, value=value, rank=rank, time=time.time(), replay=replay
    )


def test_a_transition_records_where_from_where_to_when_and_why(store: Store) -> None:
    """Each stored transition names the state it left (not the one it entered) and the time of the
    move (not the job's creation); a terminal one also stamps finished_at."""
    job = store.jobs.create("alice", SPEC, "tok")
    time.sleep(0.05)
    before = time.time()
    assert store.jobs.transition(job.id, JobState.PLACING, "handed to Ray")
    assert store.jobs.transition(job.id, JobState.FAILED, "Ray said no")
    after = time.time()
    rows = [(t.from_state, t.to_state, t.reason) for t in store.jobs.transitions(job.id)]
    assert rows == [
        (None, "QUEUED", "submitted"),
        ("QUEUED", "PLACING", "handed to Ray"),
        ("PLACING", "FAILED", "Ray said no"),
    ]
    times = [t.time for t in store.jobs.transitions(job.id)]
    assert times[0] < before <= times[1] <= times[2] <= after
    got = store.jobs.get(job.id)
    assert got.finished_at is not None and before <= got.finished_at <= after


def test_a_job_leaving_the_queue_drops_its_position_and_reason(store: Store) -> None:
    """A waiting job cancelled (or placed) is no longer in the queue: position and reason go."""
    job = store.jobs.create("alice", SPEC, "tok")
    assert store.jobs.set_queue({job.id: (2, "waiting for capacity")}) == 1
    assert store.jobs.get(job.id).queue_position == 2
    cancelled = store.jobs.request_cancel(job.id)
    assert cancelled.state == "CANCELLED"
    got = store.jobs.get(job.id)
    assert (got.queue_position, got.queue_reason) == (None, None)


def test_a_control_plane_failure_keeps_the_error_the_driver_reported(store: Store) -> None:
    """The first error is the cause: a later FAILED from the reconciler does not overwrite it."""
    job = store.jobs.create("alice", SPEC, "tok")
    store.metrics.apply_report(job.id, [state(1, "RUNNING", error="rank 1: CUDA out of memory")])
    assert store.jobs.transition(job.id, JobState.FAILED, "driver exited without a final state")
    assert store.jobs.get(job.id).error == "rank 1: CUDA out of memory"


def test_a_repeated_cancel_keeps_the_first_request_time(store: Store) -> None:
    """The grace period before a forced stop counts from the first cancel: asking again must not
    restart it."""
    job = store.jobs.create("alice", SPEC, "tok")
    store.jobs.set_submission(job.id, "sub-1")
    store.metrics.apply_report(job.id, [state(1, "RUNNING")])
    first = store.jobs.request_cancel(job.id).cancel_requested_at
    assert first is not None
    time.sleep(0.05)
    again = store.jobs.request_cancel(job.id)
    assert again.cancel_requested and again.cancel_requested_at == first


def test_cancelling_an_ended_job_changes_nothing(store: Store) -> None:
    job = store.jobs.create("alice", SPEC, "tok")
    store.metrics.apply_report(job.id, [state(1, "SUCCEEDED", reason="done")])
    got = store.jobs.request_cancel(job.id)
    assert got.state == "SUCCEEDED" and not got.cancel_requested
    assert got.cancel_requested_at is None and len(store.jobs.transitions(job.id)) == 4


def test_a_lost_driver_makes_a_new_attempt_without_a_submission(store: Store) -> None:
    """retry_driver: RETRYING, attempt 0 -> 1, one restart used, and the submission cleared so that the
    scheduler submits the new driver; the old driver's id no longer matches (no second retry)."""
    job = store.jobs.create("alice", SPEC, "tok")
    store.jobs.set_submission(job.id, "sub-0")
    store.metrics.apply_report(job.id, [state(1, "RUNNING")])
    assert store.jobs.retry_driver(job.id, "sub-0", "driver lost")
    got = store.jobs.get(job.id)
    assert (got.state, got.attempt, got.restarts, got.submission_id) == ("RETRYING", 1, 1, None)
    last = store.jobs.transitions(job.id)[-1]
    assert (last.from_state, last.to_state) == ("RUNNING", "RETRYING")
    assert last.reason == "driver lost; restart 1/2: resubmitting the driver"
    assert not store.jobs.retry_driver(job.id, "sub-0", "driver lost again")
    assert store.jobs.get(job.id).attempt == 1


def test_a_seq_sent_twice_in_one_batch_is_applied_once(store: Store) -> None:
    """A batch that repeats an item (seq 2 twice) is not a gap: everything applies, the repeat once."""
    job = store.jobs.create("alice", SPEC, "tok")
    res = store.metrics.apply_report(
        job.id, [metric(1, 0), metric(2, 1), metric(2, 1), metric(3, 2)]
    )
    assert (res.acked_seq, res.applied_to, res.points) == (3, None, 3)
    assert [p.step for p in store.metrics.points(job.id)] == [0, 1, 2]


def test_a_resume_rewinds_the_step_and_latest_to_the_checkpoint(store: Store) -> None:
    """RETRYING with resume_step 3 after steps 0..6: the job's step is 3 again and its latest loss is
    step 3's (1.0 + 3), not the superseded step 6's; per-rank points never enter `latest`."""
    job = store.jobs.create("alice", SPEC, "tok")
    items = [state(1, "RUNNING")]
    items += [metric(2 + s, s) for s in range(7)]
    items += [metric(9, 2, "mem_peak_bytes", rank=0), metric(10, 6, "mem_peak_bytes", rank=0)]
    store.metrics.apply_report(job.id, items)
    assert set(store.jobs.get(job.id).latest) == {"loss"}
    store.metrics.apply_report(job.id, [state(11, "RETRYING", reason="rank lost", resume_step=3)])
    got = store.jobs.get(job.id)
    assert got.step == 3 and got.latest["loss"]["step"] == 3 and got.latest["loss"]["value"] == 4.0
    assert set(got.latest) == {"loss"}


def test_a_later_failure_report_keeps_the_first_error(store: Store) -> None:
    """A FAILED report without an error of its own does not replace the error the job already has."""
    job = store.jobs.create("alice", SPEC, "tok")
    store.metrics.apply_report(
        job.id, [state(1, "RUNNING"), state(2, "RETRYING", error="rank 1: segfault", resume_step=0)]
    )
    store.metrics.apply_report(job.id, [state(3, "FAILED", reason="no restarts left")])
    got = store.jobs.get(job.id)
    assert got.state == "FAILED" and got.error == "rank 1: segfault"


def test_events_after_a_transition_exclude_it_and_honour_the_limit(store: Store) -> None:
    """Resuming after a state event's seq (SSE Last-Event-ID) starts at the next event; `limit` caps the
    page. Events: 1 QUEUED, 2 PLACING, 3 RUNNING (implied and reported), 4..6 three points."""
    job = store.jobs.create("alice", SPEC, "tok")
    store.metrics.apply_report(
        job.id, [state(1, "RUNNING"), metric(2, 0), metric(3, 1), metric(4, 2)]
    )
    assert [e.seq for e in store.metrics.events_after(job.id, 3)] == [4, 5, 6]
    assert [(e.seq, e.kind) for e in store.metrics.events_after(job.id, 1, limit=2)] == [
        (2, "state"),
        (3, "state"),
    ]


def test_delivered_through_waits_for_the_slowest_rank(store: Store) -> None:
    """World 2: global series at step 5, rank 0 at 5, rank 1 only at 2: steps 1..1 are certain."""
    job = store.jobs.create("alice", SPEC, "tok")
    items = [metric(s, s) for s in range(1, 6)]
    items += [metric(5 + s, s, "mem_peak_bytes", rank=0) for s in range(1, 6)]
    items += [metric(10 + s, s, "mem_peak_bytes", rank=1) for s in range(1, 3)]
    store.metrics.apply_report(job.id, items)
    assert store.metrics.delivered_through(job.id, 2) == 1


def test_series_through_a_seq_includes_that_seq(store: Store) -> None:
    """`series(job, through=N)` is the snapshot as of event N: the point with seq N is in it."""
    job = store.jobs.create("alice", SPEC, "tok")
    store.metrics.apply_report(job.id, [metric(1, 0), metric(2, 1), metric(3, 2)])
    seqs = [p.seq for p in store.metrics.points(job.id)]
    [loss] = store.metrics.series(job.id, through=seqs[1])
    assert (loss.name, loss.rank, loss.steps, loss.values) == ("loss", None, [0, 1], [1.0, 2.0])
