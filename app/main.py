"""The FastAPI app: OpenAI routes over a pool of loaded models (app.registry.pool), the gateway in front,
and the one lifespan that starts and stops its parts in a stated order."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, TypedDict

from fastapi import FastAPI
from sqlalchemy.exc import DataError
from starlette.types import Lifespan
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from app.api import (
    admin,
    admin_models,
    audit,
    batches,
    chat,
    completions,
    embeddings,
    files,
    lora_adapters,
    models,
    operations,
    responses,
    tokenize,
    usage,
)
from app.batches.service import BatchService
from app.dashboard.wiring import install_dashboard
from app.errors import install_error_handlers, out_of_range
from app.gateway.audit_log import AuditPruner
from app.gateway.contract import Gateway, SingleKeyGateway
from app.gateway.headers import RateLimitHeadersMiddleware
from app.gateway.service import TeamGateway
from app.observability.costs import HardwareCostMeter
from app.observability.metrics import ModelReading, app_registry
from app.registry.pool import ModelPool
from app.registry.store import RegistryStore
from app.serving.body_limit import install_body_limit
from app.serving.context import ServerContext
from app.serving.responses.store import response_store
from app.settings import Settings

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine

log = logging.getLogger("tokenmill.app")

# How long one part may take to stop before the shutdown logs it and goes on: a stop that never returns
# would otherwise hold the process until a supervisor kills it, and the parts after it would never stop
# (the gateway's usage flush among them). The slowest honest stops (the gateway's drain, the engine's
# shutdown) take seconds.
STOP_TIMEOUT_S = 60.0


class DocsUrls(TypedDict, total=False):  # FastAPI's keywords for its docs pages (None: off)
    docs_url: str | None
    redoc_url: str | None
    openapi_url: str | None


def create_app(
    settings: Settings,
    engine: AsyncEngine | None = None,
    *,
    gateway: Gateway | None = None,
    pool: ModelPool | None = None,
    replica: str | None = None,
) -> FastAPI:
    """Serves the models in `pool`, or a pool of one: `engine`, an engine.async_engine.AsyncEngine the
    caller started (and will shut down). `gateway` authenticates, admits and meters requests (see
    app.gateway.contract); by default a single key from settings.api_key, or none. With a TeamGateway
    the registry lives in its database: /admin/api (teams, keys, usage, models) and the dashboard come
    with it. `replica` (a Ray Serve replica id) labels every series of this app's /metrics."""
    gateway = gateway if gateway is not None else SingleKeyGateway(settings.api_key)
    if pool is None:
        pool = ModelPool(
            settings.engine, store=RegistryStore(gateway.sessions) if gateway.sessions is not None else None
        )
    if engine is not None:
        pool.add_loaded(engine)
    # /docs loads Swagger UI from a CDN and, like /openapi.json, maps every route for anyone: both are off
    # unless --api-docs turns them on. (app.openapi() still builds the schema, for tests and tools.)
    docs: DocsUrls = {} if settings.api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="tokenmill", summary="OpenAI-compatible API over the tokenmill engine", **docs)
    pool.cost_meter = HardwareCostMeter(settings.hardware_cost_per_hour)
    stored_responses = response_store(gateway.sessions, settings.response_retention_s)
    app.state.context = ServerContext(
        settings=settings, models=pool, gateway=gateway, cost_meter=pool.cost_meter, responses=stored_responses
    )
    app.state.metrics_registry = app_registry(
        lambda: model_readings(pool), constant_labels={"replica": replica} if replica else None
    )
    install_error_handlers(app)
    for module in (models, chat, completions, embeddings, operations, responses, tokenize):
        app.include_router(module.router)
    # Started in this order, stopped in the reverse one.
    parts: list[tuple[Step, Step]] = [
        (gateway.astart, gateway.astop),  # migrations, the admin key; the stop flushes usage
        (pool.start, pool.stop),  # after the gateway: the registry's tables exist by then
    ]
    path_caps: dict[str, int] = {}  # paths with a body cap of their own
    if isinstance(gateway, TeamGateway):
        app.state.gateway = gateway
        app.add_exception_handler(OverflowError, out_of_range)
        app.add_exception_handler(DataError, out_of_range)
        for module in (admin, audit, usage, admin_models, lora_adapters, files, batches):
            app.include_router(module.router)
        pruner = AuditPruner(gateway.sessions, retention_days=settings.audit_retention_days)
        parts.append((pruner.astart, pruner.astop))
        app.add_middleware(RateLimitHeadersMiddleware)
        dashboard = install_dashboard(app, gateway)  # /admin pages
        parts.append((dashboard.sampler.astart, dashboard.sampler.stop))
        # Started once the models are, stopped before them: lines in flight end before the engine does.
        app.state.batches = batch_service = BatchService.create(app, gateway.sessions, settings, gateway.keys)
        path_caps["/v1/files"] = batch_service.upload_cap
        parts.append((batch_service.runner.start, batch_service.runner.stop))
        parts.append((batch_service.sweeper.start, batch_service.sweeper.stop))
    parts.append((freeze_startup_heap, thaw))  # last: once all the rest has started
    app.router.lifespan_context = lifespan_of(parts, app.router.lifespan_context)
    install_body_limit(app, settings.max_request_bytes, path_caps)  # last added runs first: before any other middleware
    if settings.forwarded_allow_ips:  # the client address the trusted proxies vouch for, before any route sees it
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=settings.forwarded_allow_ips)
    return app


def model_readings(pool: ModelPool) -> list[ModelReading]:
    """What /metrics reports at this instant: each served engine's latest stats snapshot (draining ones
    too, until they are gone)."""
    return [
        ModelReading(served.metrics, served.engine.stats(), getattr(served.engine, "weight_format", ""))
        for served in list(pool.served.values())
        if served.engine is not None
    ]


Step = Callable[[], Awaitable[None]]


def lifespan_of(
    parts: list[tuple[Step, Step]], inner: Lifespan[Any], stop_timeout_s: float = STOP_TIMEOUT_S
) -> Callable[[FastAPI], AbstractAsyncContextManager[Any]]:  # Any: the inner one's state (None or a mapping)
    """Starts `parts` in order; stops the ones that started, in the reverse order, also after a failure.
    A stop still running after stop_timeout_s is logged and left behind, and the next one stops."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[Any]:
        async with AsyncExitStack() as stack:
            for start, stop in parts:
                await start()
                stack.push_async_callback(stop_within, stop, stop_timeout_s)
            async with inner(app) as state:  # Starlette's own (startup / shutdown handlers), if any
                yield state

    return lifespan


async def stop_within(stop: Step, timeout_s: float) -> None:
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            await stop()
    except TimeoutError:
        if not deadline.expired():  # the stop's own error, not the deadline
            raise
        log.error("%s did not finish in %gs: the shutdown goes on without it", stop.__qualname__, timeout_s)


async def freeze_startup_heap() -> None:
    """What is alive once the app has started (modules, models, tokenizers) lives about as long as the
    process: take it out of the garbage collector's scans. Otherwise every full collection walks all of
    it (about 250 ms with torch and transformers loaded) while every request in flight waits. Only the
    young generations are collected first: a full collection here would cost the same 250 ms per start."""
    gc.collect(1)
    gc.freeze()


async def thaw() -> None:
    gc.unfreeze()
