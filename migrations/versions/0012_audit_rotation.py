"""The audit log (who changed what, before and after), and key rotation: a key's previous secret keeps
working under the same key id until its grace period ends.

Revision ID: 0012_audit_rotation
Revises: 0011_batch_lease
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_audit_rotation"
down_revision = "0011_batch_lease"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("actor_kind", sa.String(16), nullable=False),
        sa.Column("actor_id", sa.String(255), nullable=False),
        sa.Column("actor_display", sa.String(255), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target_type", sa.String(32), nullable=False),
        sa.Column("target_id", sa.String(255), nullable=True),
        sa.Column("before", sa.JSON, nullable=True),
        sa.Column("after", sa.JSON, nullable=True),
    )
    op.create_index("ix_audit_log_created_at", "audit_log", ["created_at"])
    op.create_index("ix_audit_log_actor", "audit_log", ["actor_id", "created_at"])
    op.create_index("ix_audit_log_target", "audit_log", ["target_type", "target_id", "created_at"])
    with op.batch_alter_table("api_keys") as keys:
        keys.add_column(sa.Column("previous_key_hash", sa.String(64), nullable=True))
        keys.add_column(sa.Column("previous_key_prefix", sa.String(24), nullable=True))
        keys.add_column(sa.Column("previous_key_expires_at", sa.DateTime, nullable=True))
        keys.add_column(sa.Column("rotated_at", sa.DateTime, nullable=True))
        keys.create_unique_constraint("uq_api_keys_previous_key_hash", ["previous_key_hash"])


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as keys:
        keys.drop_constraint("uq_api_keys_previous_key_hash", type_="unique")
        keys.drop_column("rotated_at")
        keys.drop_column("previous_key_expires_at")
        keys.drop_column("previous_key_prefix")
        keys.drop_column("previous_key_hash")
    op.drop_index("ix_audit_log_target", table_name="audit_log")
    op.drop_index("ix_audit_log_actor", table_name="audit_log")
    op.drop_index("ix_audit_log_created_at", table_name="audit_log")
    op.drop_table("audit_log")
