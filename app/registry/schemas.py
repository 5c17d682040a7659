"""Admin API bodies and the view of one registered model (the registry row plus its state here)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.registry.served import ServedModel
from app.registry.spec import ModelSpec

Price = Field(None, ge=0, description="USD per 1M tokens")


class ModelChanges(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # an infinite or NaN price is no price

    path: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="absolute path of a safetensors folder or .gguf file, or 'default'",
    )
    dtype: Literal["float32", "bfloat16"] | None = None
    max_model_len: int | None = Field(None, ge=1, description="context length (default: the model's)")
    engine_settings: dict[str, Any] | None = Field(
        None, description="num_kv_blocks, kv_cache_memory_gb, max_num_seqs, max_num_batched_tokens, ..."
    )
    aliases: list[str] | None = Field(None, max_length=64, description="other names clients may use")
    price_input_per_1m: float | None = Price
    price_cached_input_per_1m: float | None = Price
    price_output_per_1m: float | None = Price
    price_batch_input_per_1m: float | None = Field(
        None, ge=0, description="USD per 1M tokens of batch lines (null: half of price_input_per_1m)"
    )
    price_batch_output_per_1m: float | None = Field(
        None, ge=0, description="USD per 1M tokens of batch lines (null: half of price_output_per_1m)"
    )
    enabled: bool | None = None
    sampling_defaults: dict[str, Any] | None = Field(
        None,
        description="what requests that leave them out get: temperature, top_p, top_k, min_p, "
        "repetition_penalty, presence_penalty, frequency_penalty, max_tokens; merged over the "
        "model's (its checkpoint's, at registration), a null removing one",
    )
    hardware_cost_per_hour: float | None = Field(
        None, ge=0, description="USD per hour of this model's own hardware (null: a share of the server's)"
    )


class ModelCreate(ModelChanges):
    name: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=1024)
    kind: Literal["chat", "embedding"] = "chat"
    adapter_of: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="register a PEFT LoRA adapter folder (path) on this loaded chat model; it is checked against it",
    )
    load: bool = Field(False, description="load it now (the response waits for it)")


class ServerCostChange(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    hardware_cost_per_hour: float = Field(
        ge=0, description="USD per hour of this server's hardware, shared by models without their own"
    )


class PriceView(BaseModel):
    input_per_1m: float
    cached_input_per_1m: float
    output_per_1m: float
    batch_input_per_1m: float | None = None
    batch_output_per_1m: float | None = None


class ModelView(BaseModel):
    object: Literal["registered_model"] = "registered_model"
    name: str
    kind: str
    path: str
    architecture: str
    dtype: str
    max_model_len: int | None
    engine_settings: dict[str, Any]
    aliases: list[str]
    price: PriceView | None
    enabled: bool
    hardware_cost_per_hour: float | None
    sampling_defaults: dict[str, float | int] = Field(description="what requests that leave them out get")
    state: str = Field(description="loaded | loading | draining | unloaded | disabled, in this process")
    loads_on_first_use: bool = Field(
        False, description="it loads when a request first names it, not at start (the embedded embedding model)"
    )
    in_flight: int = Field(description="requests using it now")
    created_at: str | None
    updated_at: str | None
    adapter_of: str | None = Field(None, description="a LoRA adapter's base model (None: a model of its own)")

    @classmethod
    def of(
        cls, spec: ModelSpec, state: str, served: ServedModel | None, *, loads_on_first_use: bool = False
    ) -> ModelView:
        price = spec.price
        return cls(
            name=spec.name,
            kind=spec.kind,
            path=spec.source,
            architecture=spec.architecture,
            dtype=spec.dtype,
            max_model_len=spec.max_model_len,
            engine_settings=spec.engine_settings,
            aliases=list(spec.aliases),
            enabled=spec.enabled,
            state=state,
            loads_on_first_use=loads_on_first_use,
            hardware_cost_per_hour=spec.hardware_cost_per_hour,
            sampling_defaults=spec.sampling_defaults,
            in_flight=served.in_flight if served is not None else 0,
            price=None if price is None else PriceView(**vars(price)),
            created_at=_utc(spec.created_at),
            updated_at=_utc(spec.updated_at),
            adapter_of=spec.adapter_of,
        )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelView]


def _utc(value: datetime | None) -> str | None:
    return None if value is None else value.replace(tzinfo=UTC).isoformat()
