"""GET /v1/models and /v1/models/{id}: the one model this server runs."""
from __future__ import annotations

import time

from fastapi import APIRouter

from app.deps import ContextDep, PrincipalDep, ServerContext
from app.errors import model_not_found

router = APIRouter()
STARTED_AT = int(time.time())


def check_model(context: ServerContext, model: str) -> None:
    if model != context.model_name:
        raise model_not_found(model)


def model_card(context: ServerContext) -> dict:
    return {"id": context.model_name, "object": "model", "created": STARTED_AT, "owned_by": "tokenmill",
            "max_model_len": context.engine.max_model_len}


@router.get("/v1/models")
async def list_models(context: ContextDep, principal: PrincipalDep) -> dict:
    return {"object": "list", "data": [model_card(context)] if principal.allows(context.model_name) else []}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, context: ContextDep, principal: PrincipalDep) -> dict:
    check_model(context, model_id)
    if not principal.allows(model_id):
        raise model_not_found(model_id)
    return model_card(context)
