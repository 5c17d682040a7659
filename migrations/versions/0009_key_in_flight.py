"""A key's cap on requests in flight.

Revision ID: 0009_key_in_flight
Revises: 0008_model_sampling_defaults
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_key_in_flight"
down_revision = "0008_model_sampling_defaults"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as keys:
        keys.add_column(sa.Column("max_in_flight", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as keys:
        keys.drop_column("max_in_flight")
