"""vLLM's runtime LoRA endpoints, for tools written against `vllm serve --enable-lora`: POST
/v1/load_lora_adapter {"lora_name", "lora_path"} registers and loads a PEFT adapter folder as a model of its
own, POST /v1/unload_lora_adapter {"lora_name"} removes it. The admin key only. They are the admin API's
registration (POST /admin/api/models with adapter_of) under another shape: the same checks, the same errors,
a registry row (so aliases, access and prices can be set on it after)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import AdminActor, AdminDep
from app.errors import invalid_request
from app.registry import operations
from app.registry.pool import ModelPool
from app.registry.schemas import ModelCreate

router = APIRouter(tags=["admin"], dependencies=[AdminDep])


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's other fields (load_inplace, ...) change nothing here

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=1024)
    base_model_name: str | None = Field(None, description="the loaded chat model it runs on (default: the server's)")


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=128)


def _pool(request: Request) -> ModelPool:
    pool: ModelPool = request.app.state.context.models
    return pool


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapter, request: Request, actor: AdminActor) -> str:
    pool = _pool(request)
    base = body.base_model_name or (pool.default.name if pool.default is not None else None)
    if base is None:
        raise invalid_request("no chat model is loaded to carry the adapter.", param="base_model_name")
    create = ModelCreate.model_validate(
        {"name": body.lora_name, "path": body.lora_path, "adapter_of": base, "load": True}
    )
    await operations.register_model(pool, create, actor=actor)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapter, request: Request, actor: AdminActor) -> str:
    pool = _pool(request)
    spec = pool.specs.get(body.lora_name)
    if spec is None or spec.adapter_of is None:
        raise invalid_request(f"no LoRA adapter named {body.lora_name!r} is registered.", param="lora_name")
    await operations.remove_model(pool, body.lora_name, actor=actor)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
