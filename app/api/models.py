"""GET /v1/models and /v1/models/{id}: the enabled models of the registry, and their aliases, that the
caller's key may use. An alias is listed as a model of its own, as OpenAI clients expect."""

from __future__ import annotations

import time
from datetime import UTC
from typing import Any

from fastapi import APIRouter

from app.api.deps import ContextDep, PrincipalDep
from app.errors import model_not_found
from app.gateway.contract import Principal
from app.registry.pool import ModelPool
from app.registry.spec import ModelSpec
from app.serving.sampling import sampling_defaults
from app.settings import Settings

router = APIRouter()
STARTED_AT = int(time.time())  # what a model registered only in memory says it was created at


def visible_names(spec: ModelSpec, principal: Principal) -> list[str]:
    """All its names when the key may use the model; else only the aliases the key lists itself."""
    if not spec.enabled:
        return []
    if principal.allows(spec.name):
        return list(spec.names)
    return [alias for alias in spec.aliases if principal.allows(alias)]


def model_card(pool: ModelPool, spec: ModelSpec, model_id: str, settings: Settings) -> dict[str, Any]:
    created = int(spec.created_at.replace(tzinfo=UTC).timestamp()) if spec.created_at else STARTED_AT
    card = {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "tokenmill",
        "kind": spec.kind,
        "status": pool.state(spec.name),
    }
    if model_id != spec.name:
        card["root"] = spec.name  # what the alias points at
    if spec.adapter_of is not None:
        card["parent"] = spec.adapter_of  # a LoRA adapter's base model, as vLLM lists adapters
    served = pool.served.get(spec.name)
    context_length = (
        served.engine.max_model_len if served is not None and served.engine is not None else spec.max_model_len
    )
    weight_format = str(getattr(served.engine, "weight_format", None) or "") if served is not None else ""
    if weight_format:  # an extension: what the loaded weights run as, e.g. "gguf Q4_K/Q6_K -> int4k/int6k"
        card["weight_format"] = weight_format
    if context_length is not None:  # vLLM's name and the one OpenRouter-style clients (Codex, LiteLLM) read
        card["max_model_len"] = card["context_length"] = context_length
    if spec.kind == "chat":  # an extension, like max_model_len: what a request that sets none gets
        card["sampling_defaults"] = sampling_defaults(spec, settings)
    return card


@router.get("/v1/models")
async def list_models(context: ContextDep, principal: PrincipalDep) -> dict[str, Any]:
    pool = context.models
    return {
        "object": "list",
        "data": [
            model_card(pool, spec, name, context.settings)
            for spec in pool.specs.values()
            for name in visible_names(spec, principal)
        ],
    }


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, context: ContextDep, principal: PrincipalDep) -> dict[str, Any]:
    spec = context.models.spec(model_id)
    if spec is None or model_id not in visible_names(spec, principal):
        raise model_not_found(model_id)
    return model_card(context.models, spec, model_id, context.settings)
