"""A team's storage quota for the Files API (None: the server's --default-file-quota-bytes).

Revision ID: 0017_team_file_quota
Revises: 0016_shared_reservations
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017_team_file_quota"
down_revision = "0016_shared_reservations"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("teams") as teams:
        teams.add_column(sa.Column("file_quota_bytes", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("teams") as teams:
        teams.drop_column("file_quota_bytes")
