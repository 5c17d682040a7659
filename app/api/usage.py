"""Team self-service on /v1: a team's key reads its own team's usage, and nothing of other teams."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Response

from app.api.admin import CSV_RESPONSE, SessionDep, UsageQuery, usage_response
from app.api.deps import TeamKeyDep
from app.errors import OpenAIError
from app.gateway import crud
from app.gateway.schemas import UsageReport

router = APIRouter(prefix="/v1", tags=["usage"])


@router.get("/usage", response_model=UsageReport, responses=CSV_RESPONSE)
def team_usage(
    principal: TeamKeyDep, session: SessionDep, query: Annotated[UsageQuery, Depends()]
) -> Response | dict[str, Any]:
    """Usage of the calling key's team; `team_id` is ignored, `key_id` must be one of the team's keys."""
    if query.key_id is not None:
        key = crud.get_key(session, key_id=query.key_id)
        if key is None or key.team_id != principal.team_id:
            raise OpenAIError(404, f"No key with id {query.key_id} in your team.", param="key_id", code="not_found")
    query.team_id = principal.team_id
    return usage_response(session, query)
