"""Schema compatibility: the row naming the current revision, the oldest revision whose code runs on
it, and the release that wrote it (service/migrations/env.py). Only ever grows: older releases read
it to decide whether they may run on a newer schema.

Revision ID: 0006_schema_compat
Revises: 0005_leader_lease
Create Date: 2026-12-08
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_schema_compat"
down_revision = "0005_leader_lease"
branch_labels = None
depends_on = None
# an expand: a new table, which the code of 0005 never reads
compatible_since = "0005_leader_lease"


def upgrade() -> None:
    op.create_table(
        "schema_compat",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("revision", sa.String(64), nullable=False),
        sa.Column("compatible_since", sa.String(64), nullable=False),
        sa.Column("written_by", sa.String(64), nullable=False),
        sa.Column("written_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("schema_compat")
