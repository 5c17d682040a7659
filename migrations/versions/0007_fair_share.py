"""Fair share: a team's scheduling weight and cache group, a key's priority floor.

Revision ID: 0007_fair_share
Revises: 0006_admin_sessions
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_fair_share"
down_revision = "0006_admin_sessions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("teams") as teams:
        teams.add_column(sa.Column("scheduling_weight", sa.Float, nullable=False, server_default="1.0"))
        teams.add_column(sa.Column("cache_group", sa.String(64), nullable=True))
    with op.batch_alter_table("api_keys") as keys:
        keys.add_column(sa.Column("priority_floor", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as keys:
        keys.drop_column("priority_floor")
    with op.batch_alter_table("teams") as teams:
        teams.drop_column("cache_group")
        teams.drop_column("scheduling_weight")
