"""Prepared datasets: one row per `POST /v1/datasets` (a prepare run on the cluster) with its
progress.

Revision ID: 0004_datasets
Revises: 0003
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_datasets"
down_revision = "0003"
branch_labels = None
# written before the expand-then-contract rule: only its own code runs on it
compatible_since = "0004_datasets"
depends_on = None


def upgrade() -> None:
    op.create_table(
        "datasets",
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
    op.create_index("ix_datasets_owner_created", "datasets", ["owner", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_datasets_owner_created", table_name="datasets")
    op.drop_table("datasets")
