"""The metrics aggregate: a job's event stream of metric points and log lines, written by the
driver's reports (`apply_report`) and read by the API, the SSE replay, the dashboard and the
tracking export. State reports change the job through `service.lifecycle`'s decisions."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from service import lifecycle
from service.models import Job, LogLine, MetricPointRow, Transition
from service.store.database import Database, add_log, add_transition, next_seq
from service.store.errors import JobEnded, ReportGap
from service.store.events import (
    Event,
    latest_entry,
    log_event,
    metric_event,
    metric_point,
    point_of,
    transition_event,
)
from workers.protocol import JobState, LogItem, MetricItem, ReportItem, StateItem

PointKey = tuple[int, str, int | None]  # (step, name, rank): one point of one series


@dataclass(frozen=True)
class Series:
    """One metric series (a name, and a rank for per-rank metrics) in seq order; NaN/inf were stored
    as None."""

    name: str
    rank: int | None
    steps: list[int]
    values: list[float | None]


@dataclass
class ReportResult:
    acked_seq: int
    events: list[Event] = field(default_factory=list)
    points: int = 0
    applied_to: int | None = None  # set when an internal gap stopped the batch early


class _Batch:
    """One report batch being applied inside one transaction: the job's row, the events and points
    it produced so far, and the acknowledgement it will answer with."""

    def __init__(self, s: Session, job: Job, fresh: Sequence[ReportItem], now: float) -> None:
        self.s, self.job, self.now = s, job, now
        self.result = ReportResult(acked_seq=job.last_report_seq)
        self.events: list[Event] = []
        self.latest: dict[str, Any] = dict(job.latest or {})
        self.points: list[dict[str, Any]] = []  # inserted as one multi-row insert
        replays = [it for it in fresh if isinstance(it, MetricItem) and it.replay]
        self.held = _held_keys(s, job.id, replays) if replays else None

    def flush(self) -> None:
        if self.points:
            self.s.execute(insert(MetricPointRow), self.points)
            self.points.clear()

    def apply(self, it: ReportItem) -> bool:
        """Apply one item in order; False when an internal gap stops the batch."""
        res = self.result
        if it.seq == res.acked_seq:  # duplicate inside the batch
            return True
        if lifecycle.is_terminal(self.job.state) and it.seq == res.acked_seq + 1:
            res.acked_seq = it.seq  # after the job's end in this batch: acknowledged, not applied
            return True
        if it.seq != res.acked_seq + 1:
            res.applied_to = res.acked_seq
            return False
        if isinstance(it, MetricItem):
            self.metric(it)
        elif isinstance(it, LogItem):
            self.events.append(add_log(self.s, self.job, it.source, it.line, it.time))
        elif isinstance(it, StateItem):
            self.flush()
            self.state(it)
        res.acked_seq = it.seq
        return True

    def metric(self, it: MetricItem) -> None:
        if self.held is not None:
            key = (it.step, it.name, it.rank)
            if it.replay and key in self.held:  # re-sent, already stored: acknowledged, skipped
                return
            self.held.add(key)
        point = metric_point(next_seq(self.job), it.step, it.name, it.value, it.rank, it.time)
        self.points.append({"job_id": self.job.id, **point})
        self.events.append(metric_event(point))
        self.result.points += 1
        self.job.step = it.step
        if it.rank is None:
            self.latest[it.name] = latest_entry(point)

    def state(self, it: StateItem) -> None:
        job = self.job
        if it.placement is not None:
            job.placement = [p.model_dump(mode="json") for p in it.placement]
        if it.metadata is not None:
            job.meta = {**(job.meta or {}), **it.metadata}
        if it.error is not None:
            job.error = it.error
        report = lifecycle.reported(it.state, it.reason, it.error, job.cancel_requested)
        if report.clears_error:
            job.error = None
        if it.resume_step is not None:  # RETRYING after a lost rank, or a new driver's PLACING
            M = MetricPointRow
            self.s.flush()
            self.s.execute(delete(M).where(M.job_id == job.id, M.step > it.resume_step))
            self.latest = _recompute_latest(self.s, job.id)
            job.step = it.resume_step
        try:
            steps = lifecycle.report_steps(JobState(job.state), report, it.resume_step)
        except lifecycle.InvalidTransition as e:
            line = f"ignored state report {it.state} ({e})"
            self.events.append(add_log(self.s, job, "control-plane", line, self.now))
            return
        for step in steps:
            job.restarts += int(step.counts_restart)
            if step.error is not None and not job.error:
                job.error = step.error
            ev = add_transition(self.s, job, step.state, step.reason, self.now, step.resume_step)
            self.events.append(ev)

    def close(self) -> None:
        self.flush()
        self.job.latest = self.latest
        self.job.last_report_seq = self.result.acked_seq
        self.job.updated_at = self.now


def _held_keys(s: Session, job_id: str, replays: Sequence[MetricItem]) -> set[PointKey]:
    """(step, name, rank) of the stored points in the replayed steps' range."""
    lo, hi = min(it.step for it in replays), max(it.step for it in replays)
    M = MetricPointRow
    q = select(M.step, M.name, M.rank).where(M.job_id == job_id, M.step >= lo, M.step <= hi)
    return {(int(step), str(name), rank) for step, name, rank in s.execute(q)}


def _recompute_latest(s: Session, job_id: str) -> dict[str, Any]:
    """`jobs.latest` rebuilt from the stored global points (after a resume deleted newer ones)."""
    M = MetricPointRow
    sub = (
        select(M.name, func.max(M.seq).label("seq"))
        .where(M.job_id == job_id, M.rank.is_(None))
        .group_by(M.name)
        .subquery()
    )
    newest = select(M).join(sub, (M.seq == sub.c.seq) & (M.name == sub.c.name))
    rows = s.scalars(newest.where(M.job_id == job_id))
    return {p.name: latest_entry(point_of(p)) for p in rows}


class Metrics:
    def __init__(self, db: Database) -> None:
        self.db = db

    # ---- writes -------------------------------------------------------------------------------
    def apply_report(self, job_id: str, items: Sequence[ReportItem]) -> ReportResult:
        """Apply the items with seq > the stored high-water mark, in order, in one transaction.

        Raises ReportGap when the first new item does not follow the mark, and JobEnded when the
        job is terminal (a late report changes nothing; items after a terminal state in the same
        batch are acknowledged, not applied). An internal gap stops the batch there (the prefix is
        applied; `applied_to` tells the caller to answer 409 with it).
        """
        with self.db.write() as (s, out):
            job = self.db.lock_job(s, job_id)
            if lifecycle.is_terminal(job.state):
                raise JobEnded(job.state)
            mark = job.last_report_seq
            fresh = sorted((it for it in items if it.seq > mark), key=lambda it: it.seq)
            if not fresh:
                return ReportResult(acked_seq=mark)
            if fresh[0].seq != mark + 1:
                raise ReportGap(mark)
            batch = _Batch(s, job, fresh, time.time())
            for it in fresh:
                if not batch.apply(it):
                    break
            batch.close()
            out.append((job_id, batch.events))
            return batch.result

    def add_log(self, job_id: str, source: str, line: str) -> None:
        """A control-plane note in the job's log (e.g. a tracking export that fails), like a
        driver's line."""
        with self.db.write() as (s, out):
            job = self.db.lock_job(s, job_id)
            out.append((job_id, [add_log(s, job, source, line, time.time())]))

    # ---- reads --------------------------------------------------------------------------------
    def delivered_through(self, job_id: str, world_size: int) -> int:
        """N such that every point of steps 1..N is stored: the global series and each rank's own
        (every rank emits one per step), less one because the newest stored step of a series may
        have arrived only in part. A resubmitted driver replays the points after N from its ranks'
        journals; the store skips those it holds."""
        M = MetricPointRow
        q = select(M.rank, func.max(M.step)).where(M.job_id == job_id).group_by(M.rank)
        with self.db.read() as s:
            newest = {rank: int(step) for rank, step in s.execute(q).all()}
        series = [newest.get(None, 0), *(newest.get(r, 0) for r in range(world_size))]
        return max(0, min(series) - 1)

    def points(
        self, job_id: str, after: int = 0, limit: int = 1000, names: Sequence[str] | None = None
    ) -> list[MetricPointRow]:
        """Metric points with seq > after, in seq order."""
        M = MetricPointRow
        q = select(M).where(M.job_id == job_id, M.seq > after)
        if names:
            q = q.where(M.name.in_(list(names)))
        with self.db.read() as s:
            return list(s.scalars(q.order_by(M.seq).limit(limit)))

    def logs(self, job_id: str, after: int = 0, limit: int = 1000) -> list[LogLine]:
        q = select(LogLine).where(LogLine.job_id == job_id, LogLine.seq > after)
        with self.db.read() as s:
            return list(s.scalars(q.order_by(LogLine.seq).limit(limit)))

    def series(self, job_id: str, through: int) -> list[Series]:
        """Every metric series of the job as of event seq `through`, ordered by name then rank."""
        M = MetricPointRow
        upto = (M.job_id == job_id, M.seq <= through)
        keys = select(M.name, M.rank).where(*upto).group_by(M.name, M.rank).order_by(M.name, M.rank)
        with self.db.read() as s:
            out = []
            for name, rank in s.execute(keys).all():
                same_rank = M.rank.is_(None) if rank is None else M.rank == rank
                q = select(M.step, M.value).where(*upto, M.name == name, same_rank).order_by(M.seq)
                rows = s.connection().execute(q).all()  # plain rows: ~100k per series, no ORM
                out.append(Series(name, rank, [r[0] for r in rows], [r[1] for r in rows]))
            return out

    def log_tail(self, job_id: str, through: int, n: int) -> list[LogLine]:
        """The last `n` log lines with seq <= `through`, oldest first."""
        if n <= 0:
            return []
        q = select(LogLine).where(LogLine.job_id == job_id, LogLine.seq <= through)
        with self.db.read() as s:
            return list(reversed(s.scalars(q.order_by(LogLine.seq.desc()).limit(n)).all()))

    def events_after(self, job_id: str, after: int, limit: int = 1000) -> list[Event]:
        """Stored events with seq > after, in seq order (at most `limit`)."""
        T, M, L = Transition, MetricPointRow, LogLine
        with self.db.read() as s:
            q_t = select(T).where(T.job_id == job_id, T.seq > after).order_by(T.seq).limit(limit)
            q_m = select(M).where(M.job_id == job_id, M.seq > after).order_by(M.seq).limit(limit)
            q_l = select(L).where(L.job_id == job_id, L.seq > after).order_by(L.seq).limit(limit)
            evs = [transition_event(t) for t in s.scalars(q_t)]
            evs += [metric_event(point_of(p)) for p in s.scalars(q_m)]
            evs += [log_event(r) for r in s.scalars(q_l)]
        evs.sort(key=lambda e: e.seq)
        return evs[:limit]
