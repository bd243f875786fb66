"""Evaluations: one row per `POST /v1/evals` (a RULER-style evaluation run on the cluster) with its
progress and report.

Revision ID: 0007_evals
Revises: 0006_schema_compat
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_evals"
down_revision = "0006_schema_compat"
branch_labels = None
depends_on = None
# an expand: a new table, which the code of 0006 never reads
compatible_since = "0005_leader_lease"


def upgrade() -> None:
    op.create_table(
        "evals",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("submission_id", sa.String(200), nullable=True),
        sa.Column("progress", sa.JSON(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_evals_owner_created", "evals", ["owner", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_evals_owner_created", table_name="evals")
    op.drop_table("evals")
