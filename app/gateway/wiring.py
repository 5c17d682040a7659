"""The gateway from the app's Settings, and the database steps `tokenmill serve` takes before it starts
serving (migrations, the --api-key, the admin key)."""
from __future__ import annotations

from app.gateway.service import TeamGateway


def gateway_from_settings(settings) -> TeamGateway:  # noqa: ANN001 - app.settings.Settings
    from app.gateway.config import GatewayConfig

    return TeamGateway(GatewayConfig.from_settings(settings))


def provision_configured_key(settings) -> str | None:  # noqa: ANN001
    """For `tokenmill serve --api-key`: store that key (hashed) under team "default"; None without one."""
    if not settings.api_key:
        return None
    from pathlib import Path

    from app.db import make_engine, migrate, session_factory
    from app.gateway.admin_identity import ensure_configured_key

    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)  # the SQLite default lives there
    engine = make_engine(settings.database_url)
    try:
        migrate(engine)
        return ensure_configured_key(session_factory(engine), settings.api_key)
    finally:
        engine.dispose()


def provision_admin_key(settings) -> str | None:  # noqa: ANN001
    """For `tokenmill serve`: migrate, and create the admin key on first start. Returns the plaintext
    once (the caller prints it), None when it exists already or TOKENMILL_ADMIN_KEY names it."""
    from app.db import make_engine, migrate, session_factory
    from app.gateway.admin_identity import ensure_admin_identity

    engine = make_engine(settings.database_url)
    try:
        migrate(engine)
        _, created = ensure_admin_identity(session_factory(engine), configured_key=settings.admin_key)
    finally:
        engine.dispose()
    return created
