"""The FastAPI app: OpenAI routes over a pool of loaded models (app.registry.pool)."""
from __future__ import annotations

import gc

from fastapi import FastAPI
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from app.serving.body_limit import install_body_limit
from app.observability.costs import HardwareCostMeter
from app.dashboard.wiring import install_dashboard
from app.serving.context import ServerContext
from app.errors import install_error_handlers
from app.gateway.contract import Gateway, SingleKeyGateway
from app.lifespan import around_lifespan
from app.registry.pool import ModelPool
from app.registry.store import RegistryStore
from app.api import chat, completions, embeddings, models, operations, responses, tokenize
from app.serving.responses.store import response_store
from app.settings import Settings


def create_app(settings: Settings, engine=None, *, gateway: Gateway | None = None,
               pool: ModelPool | None = None) -> FastAPI:
    """Serves the models in `pool`, or a pool of one: `engine`, an engine.async_engine.AsyncEngine the
    caller started (and will shut down). `gateway` authenticates, admits and meters requests (see
    app.gateway.contract); by default a single key from settings.api_key, or none. With the real gateway
    the registry lives in its database and /admin/api/models manages it."""
    gateway = gateway if gateway is not None else SingleKeyGateway(settings.api_key)
    if pool is None:
        sessions = getattr(gateway, "sessions", None)
        pool = ModelPool(settings.engine, store=RegistryStore(sessions) if sessions is not None else None)
    if engine is not None:
        pool.add_loaded(engine)
    # /docs loads Swagger UI from a CDN and, like /openapi.json, maps every route for anyone: both are off
    # unless --api-docs turns them on. (app.openapi() still builds the schema, for tests and tools.)
    docs = {} if settings.api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="tokenmill", summary="OpenAI-compatible API over the tokenmill engine", **docs)
    around_lifespan(app, freeze_startup_heap, thaw)  # wrapped first, so it runs once all the rest has started
    pool.cost_meter = HardwareCostMeter(settings.hardware_cost_per_hour)
    stored_responses = response_store(getattr(gateway, "sessions", None), settings.response_retention_s)
    app.state.context = ServerContext(settings=settings, models=pool, gateway=gateway, cost_meter=pool.cost_meter,
                                      responses=stored_responses)
    install_error_handlers(app)
    for module in (models, chat, completions, embeddings, operations, responses, tokenize):
        app.include_router(module.router)
    around_lifespan(app, pool.start, pool.stop)  # inside the gateway's: the registry's tables exist by then
    install = getattr(gateway, "install", None)
    if install is not None:  # the gateway's admin and usage routes, headers, start and flush with the lifespan
        install(app)
        from app.api import admin_models

        app.include_router(admin_models.router)
    install_dashboard(app)  # /admin pages, where the gateway (admin key, teams, usage) is installed
    install_body_limit(app, settings.max_request_bytes)  # last added runs first: before any other middleware
    if settings.forwarded_allow_ips:  # the client address the trusted proxies vouch for, before any route sees it
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=settings.forwarded_allow_ips)
    return app


async def freeze_startup_heap() -> None:
    """What is alive once the app has started (modules, models, tokenizers) lives about as long as the
    process: take it out of the garbage collector's scans. Otherwise every full collection walks all of
    it (about 250 ms with torch and transformers loaded) while every request in flight waits. Only the
    young generations are collected first: a full collection here would cost the same 250 ms per start."""
    gc.collect(1)
    gc.freeze()


async def thaw() -> None:
    gc.unfreeze()
