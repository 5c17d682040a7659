"""Batch API: files, batches and their finished lines; usage rows marked as batch; batch prices.

Revision ID: 0010_batches
Revises: 0009_key_in_flight
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_batches"
down_revision = "0009_key_in_flight"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("team_id", sa.Integer, nullable=True),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(256), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_files_team_created", "files", ["team_id", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("team_id", sa.Integer, nullable=True),
        sa.Column("key_id", sa.Integer, nullable=True),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("total", sa.Integer, nullable=False),
        sa.Column("completed", sa.Integer, nullable=False),
        sa.Column("failed", sa.Integer, nullable=False),
        sa.Column("metadata", sa.JSON, nullable=True),
        sa.Column("errors", sa.JSON, nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("expires_at", sa.DateTime, nullable=False),
        *(
            sa.Column(name, sa.DateTime, nullable=True)
            for name in (
                "in_progress_at",
                "finalizing_at",
                "completed_at",
                "failed_at",
                "expired_at",
                "cancelling_at",
                "cancelled_at",
            )
        ),
    )
    op.create_index("ix_batches_team_created", "batches", ["team_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("line_number", sa.Integer, primary_key=True),
        sa.Column("custom_id", sa.String(512), nullable=True),
        sa.Column("status_code", sa.Integer, nullable=False),
        sa.Column("result", sa.JSON, nullable=False),
    )
    with op.batch_alter_table("usage") as usage:
        usage.add_column(sa.Column("batch", sa.Boolean, nullable=False, server_default=sa.false()))
    with op.batch_alter_table("models") as models:
        models.add_column(sa.Column("price_batch_input_per_1m", sa.Float, nullable=True))
        models.add_column(sa.Column("price_batch_output_per_1m", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as models:
        models.drop_column("price_batch_output_per_1m")
        models.drop_column("price_batch_input_per_1m")
    with op.batch_alter_table("usage") as usage:
        usage.drop_column("batch")
    op.drop_table("batch_lines")
    op.drop_index("ix_batches_status", "batches")
    op.drop_index("ix_batches_team_created", "batches")
    op.drop_table("batches")
    op.drop_index("ix_files_team_created", "files")
    op.drop_table("files")
