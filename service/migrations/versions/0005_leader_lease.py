"""Leader lease: the row that names the replica that schedules and reconciles, with a fencing epoch.

Revision ID: 0005_leader_lease
Revises: 0004_datasets
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0005_leader_lease"
down_revision = "0004_datasets"
branch_labels = None
# written before the expand-then-contract rule: only its own code runs on it
compatible_since = "0005_leader_lease"
depends_on = None


def upgrade() -> None:
    leases = op.create_table(
        "leases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(200), nullable=True),
        sa.Column("epoch", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("expires_at", sa.Float(), nullable=False, server_default="0"),
        sa.Column("renewed_at", sa.Float(), nullable=False, server_default="0"),
        sa.Column("host", sa.String(200), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
    )
    row = {"name": "controller", "epoch": 0, "expires_at": 0.0, "renewed_at": 0.0}
    op.bulk_insert(leases, [row])


def downgrade() -> None:
    op.drop_table("leases")
