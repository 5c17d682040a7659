"""The registry changes an administrator makes, one function each, for the admin API and the dashboard
alike: both check the same body, call the same pool method and get the same OpenAI-shaped error (a
RegistryError becomes 400, or 409 where the server's state is in the way: a name taken, no memory)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from app.errors import OpenAIError, from_validation_error, invalid_request
from app.gateway.audit import SYSTEM, Actor
from app.registry.pool import ModelPool
from app.registry.schemas import ModelChanges, ModelCreate, ModelView, ServerCostChange
from app.registry.spec import RegistryError

Body = TypeVar("Body", bound=BaseModel)


def refused(error: RegistryError) -> OpenAIError:
    if error.code in ("conflict", "insufficient_memory"):  # the server's state, not the request, is in the way
        return OpenAIError(409, str(error), param=error.param, code=error.code)
    return invalid_request(str(error), param=error.param, code=error.code)


def checked(model: type[Body], values: Mapping[str, Any]) -> Body:
    """`values` as `model`, or the OpenAIError FastAPI's validation would answer for the same JSON body."""
    try:
        return model.model_validate(dict(values))
    except ValidationError as error:
        raise from_validation_error([dict(detail) for detail in error.errors()]) from None


def view(pool: ModelPool, name: str) -> ModelView:
    return ModelView.of(
        pool.specs[name], pool.state(name), pool.served.get(name), loads_on_first_use=pool.loads_on_first_use(name)
    )


async def register_model(pool: ModelPool, body: ModelCreate, *, actor: Actor = SYSTEM) -> ModelView:
    fields = body.model_dump(exclude_unset=True, exclude={"load"})
    try:
        spec = await pool.register(fields, load=body.load, actor=actor)
    except RegistryError as error:
        raise refused(error) from None
    return view(pool, spec.name)


async def change_model(pool: ModelPool, name: str, body: ModelChanges, *, actor: Actor = SYSTEM) -> ModelView:
    try:
        await pool.update(name, body.model_dump(exclude_unset=True), actor=actor)
    except RegistryError as error:
        raise refused(error) from None
    return view(pool, name)


async def load_model(pool: ModelPool, name: str, *, actor: Actor = SYSTEM) -> ModelView:
    """Answers once it serves (seconds; a GGUF's first load converts it, ~30 s), or says why it can't."""
    try:
        await pool.load(name, actor=actor)
    except RegistryError as error:
        raise refused(error) from None
    return view(pool, name)


async def unload_model(pool: ModelPool, name: str, *, wait: bool = False, actor: Actor = SYSTEM) -> ModelView:
    pool._known(name)
    await pool.unload(name, wait=wait, actor=actor)
    return view(pool, name)


async def remove_model(pool: ModelPool, name: str, *, actor: Actor = SYSTEM) -> None:
    """Unloads (waiting for requests in flight) and forgets the model; its usage rows stay."""
    await pool.remove(name, actor=actor)


async def set_server_hardware_cost(pool: ModelPool, body: ServerCostChange, *, actor: Actor = SYSTEM) -> float:
    """The server's hardware cost per hour (what models without their own cost share), from now on, and
    stored (see ModelPool.set_server_hardware_cost)."""
    try:
        return await pool.set_server_hardware_cost(body.hardware_cost_per_hour, actor=actor)
    except RegistryError as error:
        raise refused(error) from None
