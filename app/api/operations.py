"""GET /health and GET /metrics: for load balancers and Prometheus, no API key."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from app.api.deps import ContextDep
from app.observability.metrics import PROMETHEUS_CONTENT_TYPE, merge_expositions

router = APIRouter()


@router.get("/health")
async def health(context: ContextDep) -> dict:
    pool = context.models
    default = pool.default
    return {"status": "ok", "model": default.name if default is not None else None,
            "models": {name: pool.state(name) for name in pool.specs}}


@router.get("/metrics")
async def metrics(context: ContextDep) -> PlainTextResponse:
    texts = [served.metrics.render(served.engine.stats()) for served in list(context.models.served.values())
             if served.engine is not None]
    return PlainTextResponse(merge_expositions(texts), media_type=PROMETHEUS_CONTENT_TYPE)
