"""The FastAPI app: OpenAI routes over an engine that the caller started (and will shut down)."""
from __future__ import annotations

from fastapi import FastAPI

from app.dashboard.wiring import install_dashboard
from app.deps import ServerContext
from app.errors import install_error_handlers
from app.gateway_hooks import Gateway, SingleKeyGateway
from app.metrics import ServerMetrics
from app.routes import chat, completions, embeddings, models, operations
from app.settings import Settings
from app.token_text import TokenTexts


def create_app(settings: Settings, engine, *, gateway: Gateway | None = None) -> FastAPI:
    """`engine` is an engine.async_engine.AsyncEngine. `gateway` authenticates, admits and meters
    requests (see app.gateway_hooks); by default a single key from settings.api_key, or none."""
    app = FastAPI(title="tokenmill", summary="OpenAI-compatible API over the tokenmill engine")
    app.state.context = ServerContext(
        settings=settings,
        engine=engine,
        gateway=gateway if gateway is not None else SingleKeyGateway(settings.api_key),
        metrics=ServerMetrics(engine.model_name),
        token_texts=TokenTexts(engine.tokenizer),
    )
    install_error_handlers(app)
    for module in (models, chat, completions, embeddings, operations):
        app.include_router(module.router)
    install = getattr(app.state.context.gateway, "install", None)
    if install is not None:  # the gateway's admin and usage routes, headers, start and flush with the lifespan
        install(app)
    install_dashboard(app)  # /admin pages, where the gateway (admin key, teams, usage) is installed
    return app
