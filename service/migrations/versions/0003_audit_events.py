"""Audit trail: who created or cancelled what, when, from where, and the outcome.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
# written before the expand-then-contract rule: only its own code runs on it
compatible_since = "0003"
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("method", sa.String(8), nullable=False),
        sa.Column("route", sa.String(200), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=True),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("outcome", sa.String(64), nullable=False),
        sa.Column("client", sa.String(100), nullable=False),
    )
    op.create_index("ix_audit_events_owner_id", "audit_events", ["owner", "id"])
    op.create_index("ix_audit_events_job_id_id", "audit_events", ["job_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_audit_events_job_id_id", table_name="audit_events")
    op.drop_index("ix_audit_events_owner_id", table_name="audit_events")
    op.drop_table("audit_events")
