"""The jobs aggregate: a job's row, its transitions, the admission queue's notes, submissions,
restarts and cancels. Which move is legal and what a retry or cancel does is `service.lifecycle`'s
decision; this module records it."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence

from sqlalchemy import ColumnElement, func, select

from service import lifecycle
from service.models import Job, Transition
from service.store.database import Database, add_log, add_transition, next_seq
from service.store.errors import JobNotFound
from service.store.events import transition_event
from service.store.tokens import hash_token
from workers.config import JobSpec
from workers.protocol import JobState


def new_job_id() -> str:
    return "j" + secrets.token_hex(6)


class Jobs:
    def __init__(self, db: Database) -> None:
        self.db = db

    # ---- reads --------------------------------------------------------------------------------
    def get(self, job_id: str, owner: str | None = None) -> Job:
        """The job; JobNotFound also when `owner` is given and it is someone else's."""
        with self.db.read() as s:
            job = s.get(Job, job_id)
            if job is None or (owner is not None and job.owner != owner):
                raise JobNotFound(job_id)
            return job

    def page(
        self,
        owner: str | None,
        state: Sequence[str] | None = None,
        limit: int = 50,
        offset: int = 0,
        where: Sequence[ColumnElement[bool]] = (),
    ) -> tuple[list[Job], int]:
        """A page of jobs, newest first, and the total that match (`where`: more conditions, e.g.
        `service.verification.verification_is`)."""
        q = select(Job).where(*where)
        if owner is not None:
            q = q.where(Job.owner == owner)
        if state:
            q = q.where(Job.state.in_(list(state)))
        with self.db.read() as s:
            total = s.scalar(select(func.count()).select_from(q.subquery())) or 0
            page = q.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit).offset(offset)
            return list(s.scalars(page).all()), total

    def transitions(self, job_id: str) -> list[Transition]:
        q = select(Transition).where(Transition.job_id == job_id).order_by(Transition.seq)
        with self.db.read() as s:
            return list(s.scalars(q))

    def active(self) -> list[Job]:
        """Jobs not yet terminal, oldest first (what the scheduler and reconciler walk)."""
        q = select(Job).where(Job.state.in_([st.value for st in lifecycle.ACTIVE_STATES]))
        with self.db.read() as s:
            return list(s.scalars(q.order_by(Job.created_at)))

    def changed_since(self, t: float) -> dict[str, int]:
        """{job id: next event seq} of the jobs written after `t` (`updated_at`, on the clock of
        the replica that wrote): whichever replica stored their events (`service.tracking`)."""
        q = select(Job.id, Job.next_event_seq).where(Job.updated_at > t)
        with self.db.read() as s:
            return {jid: seq for jid, seq in s.execute(q)}

    def counts_by_state(self) -> dict[str, int]:
        with self.db.read() as s:
            q = select(Job.state, func.count()).group_by(Job.state)
            return {st: n for st, n in s.execute(q)}

    # ---- writes -------------------------------------------------------------------------------
    def create(self, owner: str, spec: JobSpec, ingest_token: str) -> Job:
        """The job QUEUED with its first transition, in one transaction."""
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
        with self.db.write() as (s, out):
            s.add(job)
            t = Transition(
                job_id=job.id,
                seq=next_seq(job),
                time=now,
                from_state=None,
                to_state=JobState.QUEUED.value,
                reason="submitted",
            )
            s.add(t)
            out.append((job.id, [transition_event(t)]))
        return job

    def transition(
        self,
        job_id: str,
        to: JobState,
        reason: str,
        *,
        only_from: set[JobState] | None = None,
        error: str | None = None,
    ) -> bool:
        """Move a job (control-plane side). False when it is not in `only_from` or the move is
        illegal."""
        now = time.time()
        with self.db.write() as (s, out):
            job = self.db.lock_job(s, job_id)
            if not lifecycle.control_move(JobState(job.state), to, only_from):
                return False
            if error is not None:
                job.error = error
            elif to == JobState.FAILED and not job.error:
                job.error = reason
            out.append((job_id, [add_transition(s, job, to, reason, now)]))
            return True

    def set_queue(self, waiting: Mapping[str, tuple[int | None, str | None]]) -> int:
        """Store the scheduler's word on waiting jobs (job id -> queue position, reason; None, None
        once admitted). Only QUEUED rows whose values changed are written, so a steady queue costs
        no writes. Returns rows changed."""
        if not waiting:
            return 0
        changed = 0
        with self.db.write() as (s, _):
            q = select(Job).where(Job.id.in_(list(waiting)), Job.state == JobState.QUEUED.value)
            for job in s.scalars(q if self.db.is_sqlite else q.with_for_update()):
                pos, why = waiting[job.id]
                if (job.queue_position, job.queue_reason) != (pos, why):
                    job.queue_position, job.queue_reason = pos, why
                    changed += 1
        return changed

    def set_submission(self, job_id: str, submission_id: str) -> Job:
        with self.db.write() as (s, _):
            job = self.db.lock_job(s, job_id)
            job.submission_id = submission_id
            job.updated_at = time.time()
            return job

    def set_accelerator(self, job_id: str, accelerator: str) -> None:
        """Store the accelerator `auto` was resolved to (once, at admission when not at submission);
        every driver of the job reads it from the spec, so a retry never re-decides it."""
        with self.db.write() as (s, _):
            job = self.db.lock_job(s, job_id)
            resources = job.spec.get("resources") or {}
            if resources.get("accelerator", "auto") == "auto":
                job.spec = {**job.spec, "resources": {**resources, "accelerator": accelerator}}

    def record_submit_failure(self, job_id: str) -> int:
        with self.db.write() as (s, _):
            job = self.db.lock_job(s, job_id)
            job.submit_failures += 1
            return job.submit_failures

    def retry_driver(
        self,
        job_id: str,
        submission_id: str,
        reason: str,
        *,
        counts: bool = True,
    ) -> bool:
        """The job's driver died without a final report: RETRYING, next attempt, no submission (the
        scheduler submits a new driver). False, changing nothing, when `lifecycle.driver_retry` says
        no (see there; `counts=False` uses no restart)."""
        now = time.time()
        with self.db.write() as (s, out):
            job = self.db.lock_job(s, job_id)
            decision = lifecycle.driver_retry(
                JobState(job.state),
                reason=reason,
                restarts=job.restarts,
                max_restarts=int((job.spec or {}).get("max_restarts", 0)),
                cancel_requested=job.cancel_requested,
                same_driver=job.submission_id == submission_id,
                counts=counts,
            )
            if decision is None:
                return False
            events = [add_transition(s, job, st.state, st.reason, now) for st in decision.steps]
            if decision.note is not None:
                events.append(add_log(s, job, "control-plane", decision.note, now))
            job.restarts += decision.restarts_used
            job.attempt += 1
            job.submission_id = None
            job.submit_failures = 0
            job.updated_at = now
            out.append((job_id, events))
            return True

    def request_cancel(self, job_id: str) -> Job:
        """Mark cancel requested. A job not yet handed to the cluster is cancelled right here."""
        now = time.time()
        with self.db.write() as (s, out):
            job = self.db.lock_job(s, job_id)
            if lifecycle.is_terminal(job.state):
                return job
            if not job.cancel_requested:
                job.cancel_requested = True
                job.cancel_requested_at = now
                job.updated_at = now
            if lifecycle.cancels_at_once(JobState(job.state), job.submission_id):
                why = "cancelled before placement"
                out.append((job_id, [add_transition(s, job, JobState.CANCELLED, why, now)]))
            return job
