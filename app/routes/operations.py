"""GET /health and GET /metrics: for load balancers and Prometheus, no API key."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from app.deps import ContextDep
from app.metrics import PROMETHEUS_CONTENT_TYPE

router = APIRouter()


@router.get("/health")
async def health(context: ContextDep) -> dict:
    return {"status": "ok", "model": context.model_name}


@router.get("/metrics")
async def metrics(context: ContextDep) -> PlainTextResponse:
    text = context.metrics.render(context.engine.stats())
    return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)
