"""Dashboard sessions say who is signed in and with what role: the admin key (break-glass) or an SSO
login (the identity provider's subject and email), as admin, viewer or a member of one team.

Revision ID: 0014_sso_sessions
Revises: 0013_models_ui
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_sso_sessions"
down_revision = "0013_models_ui"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("admin_sessions") as sessions:
        # Sessions opened before this migration were all admin-key logins.
        sessions.add_column(sa.Column("role", sa.String(16), nullable=False, server_default="admin"))
        sessions.add_column(sa.Column("subject", sa.String(255), nullable=True))
        sessions.add_column(sa.Column("email", sa.String(320), nullable=True))
        sessions.add_column(sa.Column("team_id", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("admin_sessions") as sessions:
        sessions.drop_column("team_id")
        sessions.drop_column("email")
        sessions.drop_column("subject")
        sessions.drop_column("role")
