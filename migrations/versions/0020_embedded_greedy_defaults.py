"""The embedded SmolLM2's sampling defaults become the measured ones (bench/defaults_bench.py): greedy,
frequency_penalty 0.5, max_tokens 256, in place of its model card's temperature 0.2 / top_p 0.9, under which
the README's own question ran off to the end of the context in 3 of 10 tries.

Only a row that still holds exactly what migration 0008 (or a registration before this change) gave it is
changed: defaults an admin has set stay as they are.

Revision ID: 0020_embedded_greedy_defaults
Revises: 0019_model_adapters
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020_embedded_greedy_defaults"
down_revision = "0019_model_adapters"
branch_labels = None
depends_on = None

# Frozen here (not imported from app.registry) so that this migration means the same thing forever.
EMBEDDED_CHAT_SOURCE = "default"
MODEL_CARD_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}
MEASURED_DEFAULTS = {"temperature": 0.0, "top_p": 0.9, "frequency_penalty": 0.5, "max_tokens": 256}

models = sa.table(
    "models",
    sa.column("id", sa.Integer()),
    sa.column("kind", sa.String()),
    sa.column("source", sa.String()),
    sa.column("sampling_defaults", sa.JSON()),
)


def _replace(old: dict[str, float | int], new: dict[str, float | int]) -> None:
    connection = op.get_bind()
    embedded = connection.execute(
        sa.select(models.c.id, models.c.sampling_defaults).where(
            models.c.kind == "chat", models.c.source == EMBEDDED_CHAT_SOURCE
        )
    ).all()
    for row_id, defaults in embedded:
        if defaults == old:  # JSON columns compare as values, not text, on every database
            connection.execute(models.update().where(models.c.id == row_id).values(sampling_defaults=new))


def upgrade() -> None:
    _replace(MODEL_CARD_DEFAULTS, MEASURED_DEFAULTS)


def downgrade() -> None:
    _replace(MEASURED_DEFAULTS, MODEL_CARD_DEFAULTS)
