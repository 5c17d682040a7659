"""/admin/api/models: the registry for the admin key. Changes apply to this process at once (load,
unload, aliases, prices); engine settings and paths apply at the model's next load."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from app.api.deps import AdminActor, AdminDep
from app.gateway.config import ModelPrice
from app.registry import operations
from app.registry.pool import ModelPool
from app.registry.schemas import ModelChanges, ModelCreate, ModelList, ModelView, ServerCostChange

router = APIRouter(prefix="/admin/api", tags=["admin"], dependencies=[AdminDep])


def _pool(request: Request) -> ModelPool:
    models: ModelPool = request.app.state.context.models
    return models


@router.get("/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    pool = _pool(request)
    await pool.refresh()
    return ModelList(data=[operations.view(pool, name) for name in pool.specs])


@router.post("/models", status_code=201, response_model=ModelView)
async def create_model(body: ModelCreate, request: Request, actor: AdminActor) -> ModelView:
    return await operations.register_model(_pool(request), body, actor=actor)


@router.get("/models/{name:path}", response_model=ModelView)
async def get_model(name: str, request: Request) -> ModelView:
    pool = _pool(request)
    await pool.refresh()
    pool._known(name)
    return operations.view(pool, name)


@router.patch("/models/{name:path}", response_model=ModelView)
async def update_model(name: str, body: ModelChanges, request: Request, actor: AdminActor) -> ModelView:
    return await operations.change_model(_pool(request), name, body, actor=actor)


@router.delete("/models/{name:path}")
async def delete_model(name: str, request: Request, actor: AdminActor) -> dict[str, Any]:
    """Unloads (waiting for requests in flight) and forgets the model; its usage rows stay."""
    await operations.remove_model(_pool(request), name, actor=actor)
    return {"name": name, "object": "registered_model", "deleted": True}


@router.post("/models/{name:path}/load", response_model=ModelView)
async def load_registered_model(name: str, request: Request, actor: AdminActor) -> ModelView:
    """Loads it here and answers once it serves (seconds; a GGUF's first load converts it, ~30 s)."""
    return await operations.load_model(_pool(request), name, actor=actor)


@router.post("/models/{name:path}/unload", response_model=ModelView)
async def unload_registered_model(name: str, request: Request, actor: AdminActor, wait: bool = False) -> ModelView:
    """New requests get 503 model_not_loaded at once; those in flight finish, then the engine stops.
    Answers at once (state draining) unless wait=true."""
    return await operations.unload_model(_pool(request), name, wait=wait, actor=actor)


@router.get("/costs")
async def costs(request: Request) -> dict[str, Any]:
    return _costs(request)


@router.patch("/costs")
async def change_costs(body: ServerCostChange, request: Request, actor: AdminActor) -> dict[str, Any]:
    """Sets the server's hardware cost per hour (the real cost per token's numerator) from now on. It is
    stored with the registry, so it outlives a restart (winning over TOKENMILL_HARDWARE_COST_PER_HOUR) and
    reaches the other replicas; a model's own hardware_cost_per_hour still wins for that model."""
    await operations.set_server_hardware_cost(_pool(request), body, actor=actor)
    return _costs(request)


def _costs(request: Request) -> dict[str, Any]:
    """Cost per token, both views. real: the hardware cost per hour (the server's, or a model's own)
    over the tokens produced in the last minute / hour / day. chargeback: each model's price sheet
    (USD per 1M tokens) that /admin/api/usage sums into cost_usd, batch prices as batch lines are charged
    (half the interactive ones unless the model sets its own)."""
    context = request.app.state.context
    pool = _pool(request)
    meter = context.cost_meter
    return {
        "object": "costs",
        "hardware_cost_per_hour": pool.server_hardware_cost,
        "real": meter.snapshot() if meter is not None else None,
        "chargeback": {
            name: None if spec.price is None else _price_sheet(spec.price) for name, spec in pool.specs.items()
        },
    }


def _price_sheet(price: ModelPrice) -> dict[str, float]:
    batch = price.for_batch()
    return {
        "input_per_1m": price.input_per_1m,
        "cached_input_per_1m": price.cached_input_per_1m,
        "output_per_1m": price.output_per_1m,
        "batch_input_per_1m": batch.input_per_1m,
        "batch_output_per_1m": batch.output_per_1m,
    }
