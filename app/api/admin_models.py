"""/admin/api/models: the registry for the admin key. Changes apply to this process at once (load,
unload, aliases, prices); engine settings and paths apply at the model's next load."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.api.deps import AdminActor, AdminDep
from app.errors import OpenAIError, invalid_request
from app.gateway.config import ModelPrice
from app.registry.pool import ModelPool
from app.registry.schemas import ModelChanges, ModelCreate, ModelList, ModelView
from app.registry.spec import RegistryError

router = APIRouter(prefix="/admin/api", tags=["admin"], dependencies=[AdminDep])


def _pool(request: Request) -> ModelPool:
    return request.app.state.context.models


def _view(pool: ModelPool, name: str) -> ModelView:
    return ModelView.of(pool.specs[name], pool.state(name), pool.served.get(name))


def refused(error: RegistryError) -> OpenAIError:
    if error.code in ("conflict", "insufficient_memory"):  # the server's state, not the request, is in the way
        return OpenAIError(409, str(error), param=error.param, code=error.code)
    return invalid_request(str(error), param=error.param, code=error.code)


@router.get("/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    pool = _pool(request)
    await pool.refresh()
    return ModelList(data=[_view(pool, name) for name in pool.specs])


@router.post("/models", status_code=201, response_model=ModelView)
async def create_model(body: ModelCreate, request: Request, actor: AdminActor) -> ModelView:
    pool = _pool(request)
    fields = body.model_dump(exclude_unset=True, exclude={"load"})
    try:
        spec = await pool.register(fields, load=body.load, actor=actor)
    except RegistryError as error:
        raise refused(error) from None
    return _view(pool, spec.name)


@router.get("/models/{name:path}", response_model=ModelView)
async def get_model(name: str, request: Request) -> ModelView:
    pool = _pool(request)
    await pool.refresh()
    pool._known(name)
    return _view(pool, name)


@router.patch("/models/{name:path}", response_model=ModelView)
async def update_model(name: str, body: ModelChanges, request: Request, actor: AdminActor) -> ModelView:
    pool = _pool(request)
    try:
        await pool.update(name, body.model_dump(exclude_unset=True), actor=actor)
    except RegistryError as error:
        raise refused(error) from None
    return _view(pool, name)


@router.delete("/models/{name:path}")
async def delete_model(name: str, request: Request, actor: AdminActor) -> dict:
    """Unloads (waiting for requests in flight) and forgets the model; its usage rows stay."""
    await _pool(request).remove(name, actor=actor)
    return {"name": name, "object": "registered_model", "deleted": True}


@router.post("/models/{name:path}/load", response_model=ModelView)
async def load_registered_model(name: str, request: Request, actor: AdminActor) -> ModelView:
    """Loads it here and answers once it serves (seconds; a GGUF's first load converts it, ~30 s)."""
    pool = _pool(request)
    try:
        await pool.load(name, actor=actor)
    except RegistryError as error:
        raise refused(error) from None
    return _view(pool, name)


@router.post("/models/{name:path}/unload", response_model=ModelView)
async def unload_registered_model(name: str, request: Request, actor: AdminActor, wait: bool = False) -> ModelView:
    """New requests get 503 model_not_loaded at once; those in flight finish, then the engine stops.
    Answers at once (state draining) unless wait=true."""
    pool = _pool(request)
    pool._known(name)
    await pool.unload(name, wait=wait, actor=actor)
    return _view(pool, name)


@router.get("/costs")
async def costs(request: Request) -> dict:
    """Cost per token, both views. real: the hardware cost per hour (the server's, or a model's own)
    over the tokens produced in the last minute / hour / day. chargeback: each model's price sheet
    (USD per 1M tokens) that /admin/api/usage sums into cost_usd, batch prices as batch lines are charged
    (half the interactive ones unless the model sets its own)."""
    context = request.app.state.context
    pool = _pool(request)
    meter = context.cost_meter
    return {
        "object": "costs",
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
