"""Model registry: a model's own hardware cost per hour (the real-cost view).

Revision ID: 0003_model_hardware_cost
Revises: 0002_models
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_model_hardware_cost"
down_revision = "0002_models"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("hardware_cost_per_hour", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("hardware_cost_per_hour")
