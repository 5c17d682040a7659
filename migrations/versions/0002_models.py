"""Model registry: the models table.

Revision ID: 0002_models
Revises: 0001_gateway
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_models"
down_revision = "0001_gateway"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("source", sa.String(1024), nullable=False),
        sa.Column("architecture", sa.String(64), nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("max_model_len", sa.Integer(), nullable=True),
        sa.Column("engine_settings", sa.JSON(), nullable=False),
        sa.Column("aliases", sa.JSON(), nullable=False),
        sa.Column("price_input_per_1m", sa.Float(), nullable=True),
        sa.Column("price_cached_input_per_1m", sa.Float(), nullable=True),
        sa.Column("price_output_per_1m", sa.Float(), nullable=True),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("models")
