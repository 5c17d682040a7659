"""Gateway: teams, API keys, admin credential, usage rows and daily roll-ups.

Revision ID: 0001_gateway
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_gateway"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _limits() -> list[sa.Column]:
    return [
        sa.Column("allowed_models", sa.JSON(), nullable=False),
        sa.Column("rpm_limit", sa.Integer(), nullable=True),
        sa.Column("tpm_limit", sa.Integer(), nullable=True),
        sa.Column("max_budget_usd", sa.Float(), nullable=True),
        sa.Column("budget_period", sa.String(8), nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        *_limits(),
        sa.Column("blocked", sa.Boolean(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("last_used_at", sa.DateTime(), nullable=True),
        sa.Column("deleted_at", sa.DateTime(), nullable=True),
    )
    op.create_index(
        "uq_teams_live_name",
        "teams",
        ["name"],
        unique=True,
        sqlite_where=sa.text("deleted_at IS NULL"),
        postgresql_where=sa.text("deleted_at IS NULL"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("team_id", sa.Integer(), sa.ForeignKey("teams.id"), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("key_prefix", sa.String(24), nullable=False),
        *_limits(),
        sa.Column("expires_at", sa.DateTime(), nullable=True),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("last_used_at", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_api_keys_team_id", "api_keys", ["team_id"])
    op.create_table(
        "admin_credentials",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("key_prefix", sa.String(24), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    op.create_table(
        "usage",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("team_id", sa.Integer(), nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("latency_ms", sa.Integer(), nullable=False),
        sa.Column("ttft_ms", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("cost_nano_usd", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_usage_created_at", "usage", ["created_at"])
    op.create_index("ix_usage_team_created", "usage", ["team_id", "created_at"])
    op.create_index("ix_usage_key_created", "usage", ["key_id", "created_at"])
    op.create_table(
        "usage_daily",
        sa.Column("day", sa.Date(), primary_key=True),
        sa.Column("key_id", sa.Integer(), primary_key=True),
        sa.Column("model", sa.String(128), primary_key=True),
        sa.Column("team_id", sa.Integer(), nullable=False),
        *[
            sa.Column(name, sa.BigInteger(), nullable=False)
            for name in ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_nano_usd")
        ],
    )
    op.create_index("ix_usage_daily_team_day", "usage_daily", ["team_id", "day"])
    op.create_index("ix_usage_daily_key_day", "usage_daily", ["key_id", "day"])


def downgrade() -> None:
    op.drop_table("usage_daily")
    op.drop_table("usage")
    op.drop_table("admin_credentials")
    op.drop_table("api_keys")
    op.drop_table("teams")
