"""Reservation holds shared by replicas through the database (when Redis is not configured): what each
process has set aside per scope for its requests in flight, and until when it is known alive.

Revision ID: 0016_shared_reservations
Revises: 0015_batch_expiry
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016_shared_reservations"
down_revision = "0015_batch_expiry"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "reservation_holds",
        sa.Column("scope", sa.String(96), primary_key=True),
        sa.Column("holder", sa.String(96), primary_key=True),
        sa.Column("amount", sa.BigInteger, nullable=False),
        sa.Column("alive_until", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("reservation_holds")
