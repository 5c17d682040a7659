"""GET /health and GET /metrics: for load balancers and Prometheus, no API key."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.observability.metrics import exposition

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, Any]:
    """What a load balancer needs and no more: which models exist is for keys that may use them
    (/v1/models) and for the admin (/admin/api/models)."""
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The app's registry, in the format the scraper asks for (Accept: application/openmetrics-text)."""
    body, content_type = exposition(request.app.state.metrics_registry, request.headers.get("accept"))
    return Response(body, media_type=content_type)
