"""Server settings changed at run time: the server's hardware cost per hour, set on the Models page or
with PATCH /admin/api/costs, outlives a restart and reaches every replica.

Revision ID: 0013_models_ui
Revises: 0012_audit_rotation
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_models_ui"
down_revision = "0012_audit_rotation"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "server_settings",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("server_settings")
