"""Batch leases: which runner holds a batch and until when, so replicas sharing a database never run the
same batch at once.

Revision ID: 0011_batch_lease
Revises: 0010_batches
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_batch_lease"
down_revision = "0010_batches"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batches:
        batches.add_column(sa.Column("runner_id", sa.String(64), nullable=True))
        batches.add_column(sa.Column("lease_expires_at", sa.DateTime, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batches:
        batches.drop_column("lease_expires_at")
        batches.drop_column("runner_id")
