"""What every aggregate shares: sessions, one transaction per write, the per-job write lock, the
job's event counter, and publishing committed events.

Each metric point, state transition and log line of a job takes its event `seq` from the job's own
counter (`jobs.next_event_seq`): strictly increasing, never reused, also after superseded points are
deleted. Writes on one job are serialised (a process lock on SQLite, `SELECT ... FOR UPDATE` on
PostgreSQL); the bus publishes each write's events after its commit, in seq order.

`WRITE_GUARD`: while a context (the leader's control loops, `service.leader`) sets it, every write
in that context first runs the guard inside its own transaction; a guard that raises (the replica
no longer leads) leaves nothing written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

from sqlalchemy import Engine, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from service.models import Job, LogLine, Transition
from service.store.errors import JobNotFound, StoreError
from service.store.events import Event, EventBus, log_event, transition_event
from workers.protocol import JobState

Published = list[tuple[str, list[Event]]]
WriteGuard = Callable[[Session], None]
WRITE_GUARD: ContextVar[WriteGuard | None] = ContextVar("ringtrain_write_guard", default=None)


class Database:
    """One engine's sessions and transactions, shared by the aggregates built on it."""

    def __init__(self, engine: Engine, bus: EventBus) -> None:
        self.engine = engine
        self.bus = bus
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        self.is_sqlite = engine.dialect.name == "sqlite"
        # SQLite has no row locks: one process-wide lock orders the writes instead
        self._write_lock = threading.RLock() if self.is_sqlite else None

    @contextmanager
    def read(self) -> Iterator[Session]:
        try:
            with self.sessions() as s:
                yield s
        except DBAPIError as e:
            raise StoreError(str(e).splitlines()[0]) from e

    @contextmanager
    def write(self) -> Iterator[tuple[Session, Published]]:
        """One transaction; the (job id, events) pairs appended inside are published after the
        commit, under the lock, so listeners see every job's events in seq order."""
        with self._write_lock or nullcontext():
            out: Published = []
            try:
                with self.sessions() as s, s.begin():
                    if (guard := WRITE_GUARD.get()) is not None:
                        guard(s)
                    yield s, out
            except DBAPIError as e:
                raise StoreError(str(e).splitlines()[0]) from e
            for job_id, events in out:
                self.bus.publish(job_id, events)

    def lock_job(self, s: Session, job_id: str) -> Job:
        """The job's row, locked for this transaction (PostgreSQL; SQLite: by the write lock)."""
        q = select(Job).where(Job.id == job_id)
        if not self.is_sqlite:
            q = q.with_for_update()
        job = s.scalars(q).one_or_none()
        if job is None:
            raise JobNotFound(job_id)
        return job

    def ping(self) -> None:
        with self.read() as s:
            s.execute(text("SELECT 1"))


def next_seq(job: Job) -> int:
    """Take the job's next event seq (the caller holds the job's row)."""
    seq = job.next_event_seq
    job.next_event_seq = seq + 1
    return seq


def add_transition(
    s: Session, job: Job, to: JobState, reason: str, now: float, resume_step: int | None = None
) -> Event:
    """Record a move of the job (legality is the caller's, decided by `service.lifecycle`)."""
    t = Transition(
        job_id=job.id,
        seq=next_seq(job),
        time=now,
        from_state=job.state,
        to_state=to.value,
        reason=reason,
        resume_step=resume_step,
    )
    s.add(t)
    job.state = to.value
    job.updated_at = now
    if to != JobState.QUEUED:  # out of the admission queue
        job.queue_position = job.queue_reason = None
    if to.terminal:
        job.finished_at = now
    return transition_event(t)


def add_log(s: Session, job: Job, source: str, line: str, now: float) -> Event:
    r = LogLine(job_id=job.id, seq=next_seq(job), time=now, source=source, line=line)
    s.add(r)
    return log_event(r)
