"""GET /health and GET /metrics: for load balancers and Prometheus, no API key."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from app.api.deps import ContextDep
from app.observability.metrics import PROMETHEUS_CONTENT_TYPE, merge_expositions

router = APIRouter()


@router.get("/health")
async def health() -> dict:
    """What a load balancer needs and no more: which models exist is for keys that may use them
    (/v1/models) and for the admin (/admin/api/models)."""
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(context: ContextDep) -> PlainTextResponse:
    texts = [served.metrics.render(served.engine.stats()) for served in list(context.models.served.values())
             if served.engine is not None]
    return PlainTextResponse(merge_expositions(texts), media_type=PROMETHEUS_CONTENT_TYPE)
