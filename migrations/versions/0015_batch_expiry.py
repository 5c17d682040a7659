"""File expiry: when a file of the Files API expires (a batch's output_expires_after, an upload's
expires_after), and the policy a batch gives the output and error files it writes.

Revision ID: 0015_batch_expiry
Revises: 0014_sso_sessions
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015_batch_expiry"
down_revision = "0014_sso_sessions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("files") as files:
        files.add_column(sa.Column("expires_at", sa.DateTime, nullable=True))
        files.create_index("ix_files_expires_at", ["expires_at"])
    with op.batch_alter_table("batches") as batches:
        batches.add_column(sa.Column("output_expires_after_s", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batches:
        batches.drop_column("output_expires_after_s")
    with op.batch_alter_table("files") as files:
        files.drop_index("ix_files_expires_at")
        files.drop_column("expires_at")
