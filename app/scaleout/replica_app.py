"""One tokenmill server as an ASGI app: its engine (--model), the registry's pool and the gateway.
`tokenmill serve` runs it under uvicorn; each Ray Serve replica (app.scaleout.ray_serve) holds one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI

import app.offline  # Ray Serve replicas start here, not in app.cli.main
import app.openmp  # noqa: F401 - before anything imports torch
from app.settings import Settings

if TYPE_CHECKING:  # imported when called: torch loads after app.openmp
    from engine.async_engine import AsyncEngine


def build_server(
    settings: Settings, *, migrated: bool = False, replica: str | None = None
) -> tuple[FastAPI, AsyncEngine]:
    """The app and its engine (an engine.async_engine.AsyncEngine the caller shuts down after the app's
    lifespan has ended). migrated: the caller ran app.gateway.wiring.prepare_store on this database, so
    the gateway doesn't migrate again. `replica` labels the app's /metrics series (the Ray Serve replica id)."""
    from app.data_dir import make_private
    from app.gateway.wiring import gateway_from_settings
    from app.main import create_app
    from app.registry.loading import embedded_defaults
    from app.registry.pool import ModelPool
    from app.registry.store import RegistryStore
    from engine.async_engine import AsyncEngine

    make_private(settings.data_dir)
    engine = AsyncEngine.start(settings.engine)
    try:
        gateway = gateway_from_settings(settings, migrated=migrated)
        # --model is served as before; every other enabled model of the registry loads in the background.
        pool = ModelPool(
            settings.engine,
            store=RegistryStore(gateway.sessions),
            load_enabled_at_start=True,
            first_start=embedded_defaults(),
            refresh_interval_s=15.0,
        )
        return create_app(settings, engine, gateway=gateway, pool=pool, replica=replica), engine
    except BaseException:
        engine.shutdown()
        raise
