"""The gateway from the app's Settings, and the database steps taken once before a server (or a set of Ray
Serve replicas) starts: migrations, the --api-key, the admin key on first start."""

from __future__ import annotations

from dataclasses import dataclass

from app.data_dir import make_private
from app.db import make_engine, migrate, session_factory
from app.gateway.admin_identity import check_configured_key, ensure_admin_identity, ensure_configured_key
from app.gateway.config import GatewayConfig
from app.gateway.service import TeamGateway
from app.settings import Settings


def gateway_from_settings(settings: Settings, *, migrated: bool = False) -> TeamGateway:
    """migrated: prepare_store ran for this database already, so the gateway's start skips migrations."""
    return TeamGateway(GatewayConfig.from_settings(settings, run_migrations=not migrated))


@dataclass(frozen=True)
class PreparedStore:
    configured_key: str | None  # what became of --api-key, for the start-up line; None without one
    created_admin_key: str | None  # the admin key generated on this first start (to deliver once), else None


def prepare_store(settings: Settings) -> PreparedStore:
    """Migrate once, store --api-key (hashed) under team "default", create the admin key on first start
    (unless TOKENMILL_ADMIN_KEY names it). Raises ValueError for a --api-key too weak to use, before
    anything is written."""
    if settings.api_key:
        check_configured_key(settings.api_key)
    make_private(settings.data_dir)  # the SQLite default lives there: private before it is created
    engine = make_engine(settings.database_url)
    try:
        migrate(engine)
        sessions = session_factory(engine)
        configured = ensure_configured_key(sessions, settings.api_key) if settings.api_key else None
        _, created = ensure_admin_identity(sessions, configured_key=settings.admin_key)
    finally:
        engine.dispose()
    return PreparedStore(configured, created)
