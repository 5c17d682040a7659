"""Stored responses keep their own turn's input only and name the previous response: a 12-turn conversation
stored every earlier turn again with each response (1.5 MB for 0.23 MB sent).

Revision ID: 0018_chained_responses
Revises: 0017_team_file_quota
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018_chained_responses"
down_revision = "0017_team_file_quota"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("responses") as responses:
        responses.add_column(sa.Column("chained", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("responses") as responses:
        responses.drop_column("chained")
