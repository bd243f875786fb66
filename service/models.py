"""SQLAlchemy 2 storage models (the API's response schemas live in `api.schemas`, separately).

Times are unix seconds (float). Every metric point, state transition and log line of a job carries
an event `seq` drawn from the job's single counter `next_event_seq`: strictly increasing, never
reused.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite only auto-increments INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    owner: Mapped[str] = mapped_column(String(200), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    ingest_token_hash: Mapped[str] = mapped_column(String(64))
    submission_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int] = mapped_column(BigInteger, default=0)
    total_steps: Mapped[int] = mapped_column(BigInteger, default=0)
    placement: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    meta: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    latest: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    last_report_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    next_event_seq: Mapped[int] = mapped_column(BigInteger, default=1)
    submit_failures: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    cancel_requested_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    updated_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # the admission queue (service.admission): order, and what the scheduler last said about a
    # waiting job
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    queue_position: Mapped[int | None] = mapped_column(Integer, nullable=True)
    queue_reason: Mapped[str | None] = mapped_column(Text, nullable=True)


class Transition(Base):
    __tablename__ = "transitions"
    __table_args__ = (UniqueConstraint("job_id", "seq", name="uq_transitions_job_seq"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    time: Mapped[float] = mapped_column(Float)
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    resume_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class MetricPointRow(Base):
    __tablename__ = "metric_points"
    __table_args__ = (
        UniqueConstraint("job_id", "seq", name="uq_metric_points_job_seq"),
        Index("ix_metric_points_job_step", "job_id", "step"),
        Index("ix_metric_points_job_name_seq", "job_id", "name", "seq"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int] = mapped_column(BigInteger)
    name: Mapped[str] = mapped_column(String(200))
    value: Mapped[float | None] = mapped_column(Float, nullable=True)  # NaN/inf are stored as NULL
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    time: Mapped[float] = mapped_column(Float)


class LogLine(Base):
    __tablename__ = "logs"
    __table_args__ = (UniqueConstraint("job_id", "seq", name="uq_logs_job_seq"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    time: Mapped[float] = mapped_column(Float)
    source: Mapped[str] = mapped_column(String(100))
    line: Mapped[str] = mapped_column(Text)


class AuditEvent(Base):
    """Who did what through the API, when, from where, and how it ended: one row per authenticated
    request that could change something (create, cancel, …), failed ones included. No foreign key:
    a refused create has no job, and the trail outlives the jobs it names."""

    __tablename__ = "audit_events"
    __table_args__ = (
        Index("ix_audit_events_owner_id", "owner", "id"),
        Index("ix_audit_events_job_id_id", "job_id", "id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    time: Mapped[float] = mapped_column(Float)
    owner: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(64))
    method: Mapped[str] = mapped_column(String(8))
    route: Mapped[str] = mapped_column(String(200))
    job_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    status: Mapped[int] = mapped_column(Integer)
    outcome: Mapped[str] = mapped_column(String(64))
    client: Mapped[str] = mapped_column(String(100))


class LeaderLease(Base):
    """A named lease (one row, `controller`): which replica leads the control plane until when.
    `epoch` grows by one on every acquisition, so a write checked against it (`service.leader`)
    is refused once another replica has taken over. Times are the database's clock."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str | None] = mapped_column(String(200), nullable=True)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    expires_at: Mapped[float] = mapped_column(Float, default=0.0)
    renewed_at: Mapped[float] = mapped_column(Float, default=0.0)
    host: Mapped[str | None] = mapped_column(String(200), nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)


class DatasetRow(Base):
    """One `POST /v1/datasets`: a prepare run on the cluster (`service.datasets`), its request,
    the submission that runs it, its last progress and, once done, the dataset's summary."""

    __tablename__ = "datasets"
    __table_args__ = (Index("ix_datasets_owner_created", "owner", "created_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(16))
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    submission_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class EvalRow(Base):
    """One `POST /v1/evals`: a RULER-style evaluation of a model run on the cluster
    (`service.evals`), its request, the submission that runs it, its progress and, once done, the
    report `python -m workers.evals` printed."""

    __tablename__ = "evals"
    __table_args__ = (Index("ix_evals_owner_created", "owner", "created_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(16))
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    submission_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
