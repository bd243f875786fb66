"""The durable job store: every write is one transaction, so a failed request leaves nothing behind.

Each metric point, state transition and log line of a job takes its event `seq` from the job's own
counter (`jobs.next_event_seq`): strictly increasing, never reused, also after superseded points are
deleted. Writes on one job are serialised (a process lock on SQLite, `SELECT … FOR UPDATE` on
PostgreSQL); `on_events` is called after each commit, in seq order, to feed the live hub.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import ColumnElement, Engine, delete, func, insert, select, text
from sqlalchemy.orm import Session, sessionmaker

from service import lifecycle
from service.models import AuditEvent, Job, LogLine, MetricPointRow, Transition
from workers.config import JobSpec
from workers.protocol import JobState, LogItem, MetricItem, ReportItem, StateItem


class StoreError(RuntimeError):
    """The database could not be reached or refused the write (→ 503)."""


class JobNotFound(LookupError):
    pass


class ReportGap(Exception):
    """The first new item skips sequence numbers: the driver must resend from `acked_seq + 1`."""

    def __init__(self, acked_seq: int) -> None:
        super().__init__(f"report sequence gap after {acked_seq}")
        self.acked_seq = acked_seq


class JobEnded(Exception):
    """A report for a job that is already terminal: nothing is applied (its ingest token has stopped working)."""

    def __init__(self, state: str) -> None:
        super().__init__(f"the job has ended ({state})")
        self.state = state


@dataclass(frozen=True)
class Event:
    """One entry of a job's event stream: kind is "state", "metric" or "log"."""

    seq: int
    kind: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Series:
    """One metric series (a name, and a rank for per-rank metrics) in seq order; NaN/inf were stored as None."""

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


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_job_id() -> str:
    return "j" + secrets.token_hex(6)


def finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def metric_event(p: MetricPointRow) -> Event:
    return Event(
        p.seq,
        "metric",
        {"seq": p.seq, "step": p.step, "name": p.name, "value": finite(p.value), "rank": p.rank, "time": p.time},
    )


def transition_event(t: Transition) -> Event:
    data: dict[str, Any] = {"seq": t.seq, "time": t.time, "from": t.from_state, "to": t.to_state, "reason": t.reason}
    if t.resume_step is not None:
        data["resume_step"] = t.resume_step
    return Event(t.seq, "state", data)


def log_event(r: LogLine) -> Event:
    return Event(r.seq, "log", {"seq": r.seq, "time": r.time, "source": r.source, "line": r.line})


class Store:
    def __init__(self, engine: Engine, on_events: Callable[[str, list[Event]], None] | None = None) -> None:
        self.engine = engine
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        self.is_sqlite = engine.dialect.name == "sqlite"
        self._write_lock = threading.RLock() if self.is_sqlite else None
        self.on_events = on_events

    # ---- plumbing -------------------------------------------------------------------------------
    @contextmanager
    def _read(self) -> Iterator[Session]:
        try:
            with self.sessions() as s:
                yield s
        except (JobNotFound, lifecycle.InvalidTransition):
            raise
        except Exception as e:  # driver/DB errors
            if _is_db_error(e):
                raise StoreError(str(e).splitlines()[0]) from e
            raise

    @contextmanager
    def _write(self) -> Iterator[tuple[Session, list[tuple[str, list[Event]]]]]:
        """One transaction; events collected inside are published after the commit, under the lock."""
        lock = self._write_lock or nullcontext()
        with lock:
            out: list[tuple[str, list[Event]]] = []
            try:
                with self.sessions() as s, s.begin():
                    yield s, out
            except Exception as e:
                if _is_db_error(e):
                    raise StoreError(str(e).splitlines()[0]) from e
                raise
            if self.on_events:
                for job_id, events in out:
                    if events:
                        self.on_events(job_id, events)

    def _lock_job(self, s: Session, job_id: str) -> Job:
        q = select(Job).where(Job.id == job_id)
        if not self.is_sqlite:
            q = q.with_for_update()
        job = s.scalars(q).one_or_none()
        if job is None:
            raise JobNotFound(job_id)
        return job

    @staticmethod
    def _next_seq(job: Job) -> int:
        seq = job.next_event_seq
        job.next_event_seq = seq + 1
        return seq

    def _transition(
        self, s: Session, job: Job, to: JobState, reason: str, now: float, resume_step: int | None = None
    ) -> Event:
        t = Transition(
            job_id=job.id,
            seq=self._next_seq(job),
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

    def ping(self) -> None:
        with self._read() as s:
            s.execute(text("SELECT 1"))

    # ---- jobs -----------------------------------------------------------------------------------
    def create_job(self, owner: str, spec: JobSpec, ingest_token: str) -> Job:
        now = time.time()
        job = Job(
            id=new_job_id(),
            name=spec.name,
            owner=owner,
            state=JobState.QUEUED.value,
            spec=spec.model_dump(mode="json"),
            ingest_token_hash=hash_token(ingest_token),
            attempt=0,
            step=0,
            total_steps=spec.train.steps,
            restarts=0,
            last_report_seq=0,
            next_event_seq=1,
            submit_failures=0,
            cancel_requested=False,
            created_at=now,
            updated_at=now,
            priority=spec.priority,
        )
        with self._write() as (s, out):
            s.add(job)
            t = Transition(
                job_id=job.id,
                seq=self._next_seq(job),
                time=now,
                from_state=None,
                to_state=JobState.QUEUED.value,
                reason="submitted",
            )
            s.add(t)
            out.append((job.id, [transition_event(t)]))
        return job

    def get_job(self, job_id: str, owner: str | None = None) -> Job:
        with self._read() as s:
            job = s.get(Job, job_id)
            if job is None or (owner is not None and job.owner != owner):
                raise JobNotFound(job_id)
            return job

    def list_jobs(
        self,
        owner: str | None,
        state: Sequence[str] | None = None,
        limit: int = 50,
        offset: int = 0,
        where: Sequence[ColumnElement[bool]] = (),  # more conditions (service.verification)
    ) -> tuple[list[Job], int]:
        q = select(Job).where(*where)
        if owner is not None:
            q = q.where(Job.owner == owner)
        if state:
            q = q.where(Job.state.in_(list(state)))
        with self._read() as s:
            total = s.scalar(select(func.count()).select_from(q.subquery())) or 0
            rows = s.scalars(q.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit).offset(offset)).all()
            return list(rows), total

    def transitions(self, job_id: str) -> list[Transition]:
        with self._read() as s:
            return list(s.scalars(select(Transition).where(Transition.job_id == job_id).order_by(Transition.seq)))

    def active_jobs(self) -> list[Job]:
        with self._read() as s:
            q = select(Job).where(Job.state.in_([st.value for st in lifecycle.ACTIVE_STATES]))
            return list(s.scalars(q.order_by(Job.created_at)))

    def counts_by_state(self) -> dict[str, int]:
        with self._read() as s:
            return {st: n for st, n in s.execute(select(Job.state, func.count()).group_by(Job.state))}

    def check_ingest_token(self, job_id: str, token: str) -> bool:
        """Whether the token is the job's current one (each driver attempt gets a new one). A terminal job's
        token still matches here; `apply_report` refuses its reports (`JobEnded`)."""
        import hmac

        with self._read() as s:
            h = s.scalar(select(Job.ingest_token_hash).where(Job.id == job_id))
        # compare even when the job is unknown, so timing says nothing about which ids exist
        return hmac.compare_digest(h or "0" * 64, hash_token(token)) and h is not None

    # ---- control-plane writes -------------------------------------------------------------------
    def transition(
        self,
        job_id: str,
        to: JobState,
        reason: str,
        *,
        only_from: set[JobState] | None = None,
        error: str | None = None,
    ) -> bool:
        """Move a job (control-plane side). False when it is not in `only_from` or the move is illegal."""
        now = time.time()
        with self._write() as (s, out):
            job = self._lock_job(s, job_id)
            cur = JobState(job.state)
            if only_from is not None and cur not in only_from:
                return False
            if not lifecycle.allowed(cur, to):
                return False
            if error is not None:
                job.error = error
            elif to == JobState.FAILED and not job.error:
                job.error = reason
            out.append((job_id, [self._transition(s, job, to, reason, now)]))
            return True

    def set_queue(self, waiting: dict[str, tuple[int | None, str | None]]) -> int:
        """Store the scheduler's word on waiting jobs (job id → queue position, reason; None, None once admitted).
        Only QUEUED rows whose values changed are written, so a steady queue costs no writes. Returns rows changed."""
        if not waiting:
            return 0
        changed = 0
        with self._write() as (s, _):
            q = select(Job).where(Job.id.in_(list(waiting)), Job.state == JobState.QUEUED.value)
            for job in s.scalars(q if self.is_sqlite else q.with_for_update()):
                pos, why = waiting[job.id]
                if (job.queue_position, job.queue_reason) != (pos, why):
                    job.queue_position, job.queue_reason = pos, why
                    changed += 1
        return changed

    def set_submission(self, job_id: str, submission_id: str) -> Job:
        with self._write() as (s, _):
            job = self._lock_job(s, job_id)
            job.submission_id = submission_id
            job.updated_at = time.time()
            return job

    def set_accelerator(self, job_id: str, accelerator: str) -> None:
        """Store the accelerator `auto` was resolved to (once, at admission when not at submission); every driver
        of the job reads it from the spec, so a retry never re-decides it."""
        with self._write() as (s, _):
            job = self._lock_job(s, job_id)
            if (job.spec.get("resources") or {}).get("accelerator", "auto") == "auto":
                job.spec = {**job.spec, "resources": {**(job.spec.get("resources") or {}), "accelerator": accelerator}}

    def set_ingest_token_hash(self, job_id: str, token_hash: str) -> None:
        with self._write() as (s, _):
            self._lock_job(s, job_id).ingest_token_hash = token_hash

    def record_submit_failure(self, job_id: str) -> int:
        with self._write() as (s, _):
            job = self._lock_job(s, job_id)
            job.submit_failures += 1
            return job.submit_failures

    def retry_driver(self, job_id: str, submission_id: str, reason: str, *, counts: bool = True) -> bool:
        """The job's driver died without a final report: RETRYING, next attempt, no submission (the scheduler
        submits a new driver). False, changing nothing, when no restart is left, a cancel was asked for, the job
        ended, or another driver already replaced that one. `counts=False`: the cluster lost the driver, not the
        job (a replaced local head): no restart is used."""
        now = time.time()
        with self._write() as (s, out):
            job = self._lock_job(s, job_id)
            cur = JobState(job.state)
            max_restarts = int((job.spec or {}).get("max_restarts", 0))
            if (
                cur.terminal
                or job.cancel_requested
                or job.submission_id != submission_id
                or (counts and job.restarts >= max_restarts)
            ):
                return False
            events: list[Event] = []
            if counts:
                why = f"{reason}; restart {job.restarts + 1}/{max_restarts}: resubmitting the driver"
            else:
                why = f"{reason}: resubmitting the driver (no restart used)"
            for st in [] if cur == JobState.RETRYING else lifecycle.path(cur, JobState.RETRYING):
                events.append(
                    self._transition(
                        s, job, st, why if st == JobState.RETRYING else "implied by the driver's loss", now
                    )
                )
            if cur == JobState.RETRYING:  # it died while re-reserving: no new transition, but say so
                r = LogLine(job_id=job.id, seq=self._next_seq(job), time=now, source="control-plane", line=why)
                s.add(r)
                events.append(log_event(r))
            job.restarts += int(counts)
            job.attempt += 1
            job.submission_id = None
            job.submit_failures = 0
            job.updated_at = now
            out.append((job_id, events))
            return True

    def request_cancel(self, job_id: str) -> Job:
        """Mark cancel requested. A job not yet handed to the cluster is cancelled right here."""
        now = time.time()
        with self._write() as (s, out):
            job = self._lock_job(s, job_id)
            if lifecycle.is_terminal(job.state):
                return job
            if not job.cancel_requested:
                job.cancel_requested = True
                job.cancel_requested_at = now
                job.updated_at = now
            if job.submission_id is None and job.state == JobState.QUEUED.value:
                out.append((job_id, [self._transition(s, job, JobState.CANCELLED, "cancelled before placement", now)]))
            return job

    # ---- reports from the driver ----------------------------------------------------------------
    def add_log(self, job_id: str, source: str, line: str) -> None:
        """A control-plane note in the job's log (e.g. a tracking export that fails), like a driver's line."""
        with self._write() as (s, out):
            job = self._lock_job(s, job_id)
            r = LogLine(job_id=job_id, seq=self._next_seq(job), time=time.time(), source=source, line=line)
            s.add(r)
            out.append((job_id, [log_event(r)]))

    def apply_report(self, job_id: str, items: Sequence[ReportItem]) -> ReportResult:
        """Apply the items with seq > the stored high-water mark, in order, in one transaction.

        Raises ReportGap when the first new item does not follow the mark, and JobEnded when the job is terminal
        (a late report changes nothing; items after a terminal state in the same batch are acknowledged, not
        applied). An internal gap stops the batch there (the prefix is applied; `applied_to` tells the caller to
        answer 409 with it).
        """
        with self._write() as (s, out):
            job = self._lock_job(s, job_id)
            if lifecycle.is_terminal(job.state):
                raise JobEnded(job.state)
            hw = job.last_report_seq
            fresh = sorted((it for it in items if it.seq > hw), key=lambda it: it.seq)
            if not fresh:
                return ReportResult(acked_seq=hw)
            if fresh[0].seq != hw + 1:
                raise ReportGap(hw)
            res = ReportResult(acked_seq=hw)
            now = time.time()
            events: list[Event] = []
            latest = dict(job.latest or {})
            pending: list[dict[str, Any]] = []

            def flush() -> None:  # metric points go in as one multi-row insert
                if pending:
                    s.execute(insert(MetricPointRow), pending)
                    pending.clear()

            held = self._held_keys(s, job_id, [it for it in fresh if isinstance(it, MetricItem) and it.replay])
            for it in fresh:
                if it.seq == res.acked_seq:  # duplicate inside the batch
                    continue
                if lifecycle.is_terminal(job.state) and it.seq == res.acked_seq + 1:
                    res.acked_seq = it.seq  # after the job's end in this batch: acknowledged, not applied
                    continue
                if it.seq != res.acked_seq + 1:
                    res.applied_to = res.acked_seq
                    break
                if isinstance(it, MetricItem) and held is not None:
                    key = (it.step, it.name, it.rank)
                    if it.replay and key in held:  # a re-sent point the store already holds: acknowledged, skipped
                        res.acked_seq = it.seq
                        continue
                    held.add(key)
                if isinstance(it, MetricItem):
                    seq, value = self._next_seq(job), finite(it.value)
                    point = {
                        "seq": seq,
                        "step": it.step,
                        "name": it.name,
                        "value": value,
                        "rank": it.rank,
                        "time": it.time,
                    }
                    pending.append({"job_id": job_id, **point})
                    events.append(Event(seq, "metric", point))
                    res.points += 1
                    job.step = it.step
                    if it.rank is None:
                        latest[it.name] = {"step": it.step, "value": value, "seq": seq, "time": it.time}
                elif isinstance(it, LogItem):
                    r = LogLine(job_id=job_id, seq=self._next_seq(job), time=it.time, source=it.source, line=it.line)
                    s.add(r)
                    events.append(log_event(r))
                elif isinstance(it, StateItem):
                    flush()
                    latest = self._apply_state(s, job, it, events, latest, now)
                res.acked_seq = it.seq
            flush()
            job.latest = latest
            job.last_report_seq = res.acked_seq
            job.updated_at = now
            out.append((job_id, events))
            return res

    def _apply_state(
        self, s: Session, job: Job, it: StateItem, events: list[Event], latest: dict[str, Any], now: float
    ) -> dict[str, Any]:
        cur = JobState(job.state)
        if cur.terminal:
            return latest  # terminal states never change; late reports are acknowledged and dropped
        if it.placement is not None:
            job.placement = [p.model_dump(mode="json") for p in it.placement]
        if it.metadata is not None:
            job.meta = {**(job.meta or {}), **it.metadata}
        if it.error is not None:
            job.error = it.error
        target = it.state
        if job.cancel_requested and target == JobState.FAILED:
            # the user asked for a stop: a driver that dies while stopping ends CANCELLED, not FAILED
            target = JobState.CANCELLED
            it = it.model_copy(
                update={
                    "state": target,
                    "error": None,
                    "reason": f"cancelled (the driver reported while stopping: "
                    f"{(it.reason or it.error or 'failure')[:500]})",
                }
            )
            job.error = None
        resume = None
        if it.resume_step is not None:  # RETRYING after a lost rank, or a resubmitted driver's first PLACING
            resume = it.resume_step
            s.flush()
            s.execute(delete(MetricPointRow).where(MetricPointRow.job_id == job.id, MetricPointRow.step > resume))
            latest = self._recompute_latest(s, job.id)
            job.step = resume
        try:
            route = lifecycle.path(cur, it.state)
        except lifecycle.InvalidTransition as e:
            r = LogLine(
                job_id=job.id,
                seq=self._next_seq(job),
                time=now,
                source="control-plane",
                line=f"ignored state report {it.state} ({e})",
            )
            s.add(r)
            events.append(log_event(r))
            return latest
        for st in route:
            reason = it.reason if st == it.state else f"implied by the driver's {it.state} report"
            if st == JobState.RETRYING:
                job.restarts += 1
            if st == JobState.FAILED and not job.error:
                job.error = it.reason or "the driver reported failure"
            events.append(
                self._transition(
                    s, job, st, reason or st.value.lower(), now, resume_step=resume if st == it.state else None
                )
            )
        return latest

    @staticmethod
    def _held_keys(s: Session, job_id: str, replays: Sequence[MetricItem]) -> set[tuple[int, str, int | None]] | None:
        """(step, name, rank) of the stored points in the replayed steps' range; None when nothing is replayed."""
        if not replays:
            return None
        lo, hi = min(it.step for it in replays), max(it.step for it in replays)
        rows = s.execute(
            select(MetricPointRow.step, MetricPointRow.name, MetricPointRow.rank).where(
                MetricPointRow.job_id == job_id, MetricPointRow.step >= lo, MetricPointRow.step <= hi
            )
        )
        return {(int(step), str(name), rank) for step, name, rank in rows}

    @staticmethod
    def _recompute_latest(s: Session, job_id: str) -> dict[str, Any]:
        sub = (
            select(MetricPointRow.name, func.max(MetricPointRow.seq).label("seq"))
            .where(MetricPointRow.job_id == job_id, MetricPointRow.rank.is_(None))
            .group_by(MetricPointRow.name)
            .subquery()
        )
        rows = s.scalars(
            select(MetricPointRow)
            .join(sub, (MetricPointRow.seq == sub.c.seq) & (MetricPointRow.name == sub.c.name))
            .where(MetricPointRow.job_id == job_id)
        )
        return {p.name: {"step": p.step, "value": finite(p.value), "seq": p.seq, "time": p.time} for p in rows}

    def delivered_through(self, job_id: str, world_size: int) -> int:
        """N such that every point of steps 1..N is stored: the global series and each rank's own (every rank emits
        one per step), less one because the newest stored step of a series may have arrived only in part. A
        resubmitted driver replays the points after N from its ranks' journals; the store skips those it holds."""
        with self._read() as s:
            rows = s.execute(
                select(MetricPointRow.rank, func.max(MetricPointRow.step))
                .where(MetricPointRow.job_id == job_id)
                .group_by(MetricPointRow.rank)
            ).all()
        newest = {rank: int(step) for rank, step in rows}
        return max(0, min([newest.get(None, 0), *(newest.get(r, 0) for r in range(world_size))]) - 1)

    # ---- reads of the event stream --------------------------------------------------------------
    def metrics(
        self, job_id: str, after: int = 0, limit: int = 1000, names: Sequence[str] | None = None
    ) -> list[MetricPointRow]:
        q = select(MetricPointRow).where(MetricPointRow.job_id == job_id, MetricPointRow.seq > after)
        if names:
            q = q.where(MetricPointRow.name.in_(list(names)))
        with self._read() as s:
            return list(s.scalars(q.order_by(MetricPointRow.seq).limit(limit)))

    def logs(self, job_id: str, after: int = 0, limit: int = 1000) -> list[LogLine]:
        q = select(LogLine).where(LogLine.job_id == job_id, LogLine.seq > after).order_by(LogLine.seq).limit(limit)
        with self._read() as s:
            return list(s.scalars(q))

    def metric_series(self, job_id: str, through: int) -> list[Series]:
        """Every metric series of the job as of event seq `through`, ordered by name then rank."""
        M = MetricPointRow
        upto = (M.job_id == job_id, M.seq <= through)
        with self._read() as s:
            keys = s.execute(select(M.name, M.rank).where(*upto).group_by(M.name, M.rank).order_by(M.name, M.rank))
            out = []
            for name, rank in keys.all():
                same_rank = M.rank.is_(None) if rank is None else M.rank == rank
                q = select(M.step, M.value).where(*upto, M.name == name, same_rank).order_by(M.seq)
                rows = s.connection().execute(q).all()  # plain rows: ~100k per series, no ORM processing
                out.append(Series(name, rank, [r[0] for r in rows], [r[1] for r in rows]))
            return out

    def log_tail(self, job_id: str, through: int, n: int) -> list[LogLine]:
        """The last `n` log lines with seq ≤ `through`, oldest first."""
        if n <= 0:
            return []
        q = select(LogLine).where(LogLine.job_id == job_id, LogLine.seq <= through).order_by(LogLine.seq.desc())
        with self._read() as s:
            return list(reversed(s.scalars(q.limit(n)).all()))

    def events_after(self, job_id: str, after: int, limit: int = 1000) -> list[Event]:
        """Stored events with seq > after, in seq order (at most `limit`)."""
        with self._read() as s:
            evs = [
                transition_event(t)
                for t in s.scalars(
                    select(Transition)
                    .where(Transition.job_id == job_id, Transition.seq > after)
                    .order_by(Transition.seq)
                    .limit(limit)
                )
            ]
            evs += [
                metric_event(p)
                for p in s.scalars(
                    select(MetricPointRow)
                    .where(MetricPointRow.job_id == job_id, MetricPointRow.seq > after)
                    .order_by(MetricPointRow.seq)
                    .limit(limit)
                )
            ]
            evs += [
                log_event(r)
                for r in s.scalars(
                    select(LogLine)
                    .where(LogLine.job_id == job_id, LogLine.seq > after)
                    .order_by(LogLine.seq)
                    .limit(limit)
                )
            ]
        evs.sort(key=lambda e: e.seq)
        return evs[:limit]

    # ---- audit trail ----------------------------------------------------------------------------
    def record_audit(self, **fields: Any) -> None:
        with self._write() as (s, _):
            s.add(AuditEvent(**fields))

    def audit_events(
        self, owner: str | None, job_id: str | None = None, before: int | None = None, limit: int = 100
    ) -> list[AuditEvent]:
        """Newest first; `owner=None` reads every owner's rows."""
        q = select(AuditEvent)
        if owner is not None:
            q = q.where(AuditEvent.owner == owner)
        if job_id is not None:
            q = q.where(AuditEvent.job_id == job_id)
        if before is not None:
            q = q.where(AuditEvent.id < before)
        with self._read() as s:
            return list(s.scalars(q.order_by(AuditEvent.id.desc()).limit(limit)))


def _is_db_error(e: BaseException) -> bool:
    from sqlalchemy.exc import DBAPIError, OperationalError

    return isinstance(e, OperationalError | DBAPIError)
