"""Admission queue: a job's priority, and its queue position and reason while it waits.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
# written before the expand-then-contract rule: only its own code runs on it
compatible_since = "0002"
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("priority", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("queue_position", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("queue_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("queue_reason")
        batch.drop_column("queue_position")
        batch.drop_column("priority")
