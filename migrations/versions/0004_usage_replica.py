"""Usage rows name the replica that served them (Ray Serve replica or pod; NULL for a single process).

Revision ID: 0004_usage_replica
Revises: 0003_model_hardware_cost
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_usage_replica"
down_revision = "0003_model_hardware_cost"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        batch.add_column(sa.Column("replica", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("replica")
