"""Model registry: each model's own sampling defaults (what a request that sets none gets).

Rows registered before have none (their checkpoints are not re-read here; an admin may set them), except
the embedded SmolLM2, which gets its model card's values, as a fresh registration does.

Revision ID: 0008_model_sampling_defaults
Revises: 0007_fair_share
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_model_sampling_defaults"
down_revision = "0007_fair_share"
branch_labels = None
depends_on = None

# Frozen here (not imported from app.registry) so that this migration means the same thing forever.
EMBEDDED_CHAT_SOURCE = "default"
EMBEDDED_CHAT_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}

models = sa.table(
    "models",
    sa.column("kind", sa.String()),
    sa.column("source", sa.String()),
    sa.column("sampling_defaults", sa.JSON()),
)


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("sampling_defaults", sa.JSON(), nullable=True))
    op.execute(models.update().values(sampling_defaults={}))
    op.execute(
        models.update()
        .where(models.c.kind == "chat", models.c.source == EMBEDDED_CHAT_SOURCE)
        .values(sampling_defaults=EMBEDDED_CHAT_DEFAULTS)
    )
    with op.batch_alter_table("models") as batch:
        batch.alter_column("sampling_defaults", existing_type=sa.JSON(), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("sampling_defaults")
