"""LoRA adapters in the model registry: a row with `adapter_of` is an adapter (its `source` a PEFT folder)
served on that base model's engine.

Revision ID: 0019_model_adapters
Revises: 0018_chained_responses
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019_model_adapters"
down_revision = "0018_chained_responses"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("adapter_of", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("adapter_of")
