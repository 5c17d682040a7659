"""Puts the gateway into a FastAPI app: app.state.gateway, the admin and team routers, the
x-ratelimit-* headers middleware, and start / stop around the app's lifespan (stop flushes usage)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError

from app.errors import invalid_request
from app.lifespan import around_lifespan

from app.api import admin, usage
from app.gateway.headers import RateLimitHeadersMiddleware
from app.gateway.service import Gateway


async def _out_of_range(request: Request, error: Exception) -> JSONResponse:
    """An id or limit beyond what the database stores (SQLite: int64) is the caller's error, not ours."""
    return invalid_request("A number in the request is out of range.", code="out_of_range").response()


def install_gateway(app: FastAPI, gateway: Gateway) -> None:
    app.state.gateway = gateway
    app.add_exception_handler(OverflowError, _out_of_range)
    app.add_exception_handler(DataError, _out_of_range)
    app.include_router(admin.router)
    app.include_router(usage.router)
    app.add_middleware(RateLimitHeadersMiddleware)
    around_lifespan(app, gateway.astart, gateway.astop)


def gateway_from_settings(settings) -> Gateway:  # noqa: ANN001 - app.settings.Settings
    from app.gateway.config import GatewayConfig

    return Gateway(GatewayConfig.from_settings(settings))


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
