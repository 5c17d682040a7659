"""LoRA adapters as registered models: checked against their loaded base model before anything is stored,
and served through the base model's engine (engine/lora.py batches them with the base's own requests).

An adapter is a model of its own to clients (its name, aliases, team access, price sheet and usage rows):
its ServedModel's engine is an `AdapterEngine`, the base's engine with every request run under the adapter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from app.registry.registration import changed_spec
from app.registry.spec import ModelSpec, RegistryError, check_name
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.lora import AdapterError, AdapterManifest
from engine.lora_stats import AdapterStats
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from engine.tenancy import DEFAULT_TENANCY, Tenancy

ARCHITECTURE = "lora"
# What an adapter cannot set: they are its base model's (one engine serves both).
BASE_ONLY_FIELDS = ("dtype", "max_model_len", "engine_settings")


class AdapterEngine:
    """The base model's engine as an adapter's clients see it: each request runs under the adapter."""

    def __init__(self, base: AsyncEngine, adapter: str) -> None:
        self.base = base
        self.adapter = adapter

    def __getattr__(self, name: str) -> Any:  # tokenizer, max_model_len, config, stats, abort, ...
        return getattr(self.base, name)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenancy: Tenancy = DEFAULT_TENANCY,
        *,
        capacity: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        outputs = self.base.generate(
            request_id, prompt_token_ids, params, tenancy, adapter=self.adapter, capacity=capacity
        )
        async for output in outputs:
            yield output

    def stats(self) -> EngineStats:
        """The engine's stats with the adapter's own sequences, tokens and team shares in place of the whole
        engine's (the KV pool and batch occupancy stay the engine's: the adapter shares them)."""
        stats = self.base.stats()
        own = stats.adapters.get(self.adapter) or AdapterStats()
        return dataclasses.replace(
            stats,
            num_running=own.running,
            num_waiting=own.waiting,
            num_swapped=0,
            num_running_background=0,
            prompt_tokens_total=own.prompt_tokens_total,
            generation_tokens_total=own.generation_tokens_total,
            generation_tokens_background_total=0,
            teams=own.teams,
            adapters={},
        )

    def shutdown(self) -> None:
        """Unloading an adapter forgets it on the base's engine (which keeps serving its base model)."""
        try:
            self.base.unregister_adapter(self.adapter)
        except AdapterError:  # still in use: it stays registered on the engine until the base unloads
            pass


def check_adapter(base_engine: AsyncEngine, path: str) -> AdapterManifest:
    """Blocking (reads the folder): the adapter's manifest, or a RegistryError naming the mismatch."""
    try:
        return base_engine.core.adapters.check(path)
    except AdapterError as error:
        raise RegistryError(
            f"the adapter at {path!r} does not fit base model: {error}", param="path", code="adapter_mismatch"
        ) from None


def new_adapter_spec(
    fields: Mapping[str, Any],
    *,
    base_spec: ModelSpec,
    manifest: AdapterManifest,
    config: EngineConfig,
    others: Iterable[ModelSpec],
) -> ModelSpec:
    """fields: name, path, adapter_of, and optionally aliases, prices, enabled, sampling_defaults,
    hardware_cost_per_hour (engine fields are the base's)."""
    for field in BASE_ONLY_FIELDS:
        if fields.get(field) is not None:
            raise RegistryError(f"{field} is the base model's; an adapter cannot set it.", param=field)
    if fields.get("kind", "chat") != "chat":
        raise RegistryError("an adapter is a chat model (kind 'chat').", param="kind")
    spec = ModelSpec(
        name=check_name(str(fields.get("name") or ""), param="name"),
        kind="chat",
        source=manifest.path,
        architecture=ARCHITECTURE,
        dtype=base_spec.dtype,
        max_model_len=base_spec.max_model_len,
        sampling_defaults=dict(base_spec.sampling_defaults),
        adapter_of=base_spec.name,
    )
    others = list(others)
    taken = {name for other in others for name in other.names}
    if spec.name in taken:
        raise RegistryError(f"{spec.name!r} is already a registered model or alias.", param="name", code="conflict")
    changes = {k: v for k, v in fields.items() if k not in ("name", "kind", "path", "adapter_of")}
    return changed_spec(spec, changes, base=config, others=others)


def adapter_changes_refused(spec: ModelSpec, changes: Mapping[str, Any]) -> None:
    """An adapter's weights and engine are fixed at registration: remove and register it again to change them."""
    current: dict[str, Any] = {
        "path": spec.source,
        "dtype": spec.dtype,
        "max_model_len": spec.max_model_len,
        "engine_settings": {},
    }
    for field in ("path", *BASE_ONLY_FIELDS):
        value = changes.get(field)
        if value is not None and value != current[field] and str(value) != str(current[field]):
            raise RegistryError(
                f"{field} of adapter {spec.name!r} cannot change; remove it and register it again.", param=field
            )
