"""Stored responses of the Responses API and their input items.

Revision ID: 0005_responses
Revises: 0004_usage_replica
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_responses"
down_revision = "0004_usage_replica"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("team_id", sa.Integer, nullable=True),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("expires_at", sa.DateTime, nullable=False),
        sa.Column("body", sa.JSON, nullable=False),
    )
    op.create_index("ix_responses_team_created", "responses", ["team_id", "created_at"])
    op.create_index("ix_responses_expires_at", "responses", ["expires_at"])
    op.create_table(
        "response_input_items",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("response_id", sa.String(64), sa.ForeignKey("responses.id", ondelete="CASCADE"), nullable=False),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("item", sa.JSON, nullable=False),
    )
    op.create_index(
        "uq_response_input_items_position", "response_input_items", ["response_id", "position"], unique=True
    )


def downgrade() -> None:
    op.drop_index("uq_response_input_items_position", table_name="response_input_items")
    op.drop_table("response_input_items")
    op.drop_index("ix_responses_expires_at", table_name="responses")
    op.drop_index("ix_responses_team_created", table_name="responses")
    op.drop_table("responses")
