"""Initial schema: jobs, transitions, metric points, logs.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
# written before the expand-then-contract rule: only its own code runs on it
compatible_since = "0001"
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("ingest_token_hash", sa.String(64), nullable=False),
        sa.Column("submission_id", sa.String(200), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("total_steps", sa.BigInteger(), nullable=False),
        sa.Column("placement", sa.JSON(), nullable=True),
        sa.Column("meta", sa.JSON(), nullable=True),
        sa.Column("latest", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("last_report_seq", sa.BigInteger(), nullable=False),
        sa.Column("next_event_seq", sa.BigInteger(), nullable=False),
        sa.Column("submit_failures", sa.Integer(), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("cancel_requested_at", sa.Float(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_jobs_owner", "jobs", ["owner"])
    op.create_index("ix_jobs_state", "jobs", ["state"])
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])
    op.create_table(
        "transitions",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column(
            "job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("from_state", sa.String(16), nullable=True),
        sa.Column("to_state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("resume_step", sa.BigInteger(), nullable=True),
        sa.UniqueConstraint("job_id", "seq", name="uq_transitions_job_seq"),
    )
    op.create_table(
        "metric_points",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column(
            "job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("time", sa.Float(), nullable=False),
        sa.UniqueConstraint("job_id", "seq", name="uq_metric_points_job_seq"),
    )
    op.create_index("ix_metric_points_job_step", "metric_points", ["job_id", "step"])
    op.create_index("ix_metric_points_job_name_seq", "metric_points", ["job_id", "name", "seq"])
    op.create_table(
        "logs",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column(
            "job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("source", sa.String(100), nullable=False),
        sa.Column("line", sa.Text(), nullable=False),
        sa.UniqueConstraint("job_id", "seq", name="uq_logs_job_seq"),
    )


def downgrade() -> None:
    op.drop_table("logs")
    op.drop_table("metric_points")
    op.drop_table("transitions")
    op.drop_table("jobs")
