"""What the app serves, as the dashboard sees it: one `ModelSource` (live numbers) per loaded chat
model, and one model card (registry entry, state, settings, prices) per registered model."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from app.dashboard.histograms import HistogramCounts
from app.dashboard.live import ModelSource
from app.registry.served import ServedModel
from app.registry.store import PRICE_COLUMNS, columns_of

if TYPE_CHECKING:
    from fastapi import FastAPI

    from engine.async_engine import AsyncEngine


def _source(app: FastAPI, served: ServedModel, engine: AsyncEngine) -> ModelSource:
    metrics, pool, name = served.metrics, app.state.context.models, served.name
    return ModelSource(
        name=name,
        stats=engine.stats,
        ttft=lambda: HistogramCounts.of(metrics.time_to_first_token),
        inter_token=lambda: HistogramCounts.of(metrics.inter_token_latency),
        hardware_cost_per_hour=lambda: pool.hardware_cost_of(name),
        price=lambda: price_sheet(app, name),
    )


def model_sources(app: FastAPI) -> list[ModelSource]:  # FastAPI
    return [
        _source(app, served, served.engine) for served in app.state.context.models.loaded() if served.engine is not None
    ]


def price_sheet(app: FastAPI, name: str) -> dict[str, Any] | None:
    """What usage of `name` is charged at: its registry price sheet, else the gateway's --model-prices
    (the same order the gateway charges by), with the batch prices as batch lines pay them."""
    spec = app.state.context.models.specs.get(name)
    gateway = getattr(app.state, "gateway", None)
    price = spec.price if spec is not None else None
    if price is None and gateway is not None:
        price = gateway.config.prices.get(name) or gateway.config.prices.get("*")
    if price is None:
        return None
    batch = price.for_batch()
    return {**asdict(price), "batch_input_per_1m": batch.input_per_1m, "batch_output_per_1m": batch.output_per_1m}


ENGINE_SETTING_NOTES = {
    "model": "weights (default = embedded SmolLM2)",
    "dtype": "activations and unquantized weights",
    "block_size": "tokens per KV block",
    "num_kv_blocks": "KV pool, blocks",
    "kv_cache_memory_gb": "KV pool, GiB",
    "max_num_seqs": "sequences per step",
    "max_num_batched_tokens": "token budget per step",
    "max_step_seconds": "a step's budget shrinks to about this long",
    "max_model_len": "context length",
    "max_waiting": "queue before 503",
    "preemption_mode": "when KV runs out",
    "enable_prefix_caching": "share identical prompt prefixes",
    "kv_cache_dtype": "auto: bfloat16 under float32 with int8/int4 weights",
    "speculation": "n-gram drafts verified in the decode step",
}


def model_cards(app: FastAPI) -> list[dict[str, Any]]:
    """Every registered model; the engine's numbers for those loaded here."""
    pool = app.state.context.models
    cards = []
    for spec in list(pool.specs.values()):
        served = pool.served.get(spec.name)
        engine = served.engine if served is not None else None
        card = {
            "name": spec.name,
            "kind": spec.kind,
            "state": pool.state(spec.name),
            "loads_on_first_use": pool.loads_on_first_use(spec.name),
            "aliases": list(spec.aliases),
            "source": spec.source,
            "architecture": spec.architecture,
            "adapter_of": spec.adapter_of,
            "enabled": spec.enabled,
            "in_flight": served.in_flight if served is not None else 0,
            "max_model_len": spec.max_model_len,
            "price": price_sheet(app, spec.name),
            "price_fields": {column: columns_of(spec)[column] for column in PRICE_COLUMNS},  # the registry's own
            "hardware_cost_per_hour": spec.hardware_cost_per_hour,
            "engine_settings": dict(spec.engine_settings),
            "dtype": spec.dtype,
            "registered_max_model_len": spec.max_model_len,
            "sampling_defaults": dict(spec.sampling_defaults),
            "settings": [
                (name, value, ENGINE_SETTING_NOTES.get(name, "")) for name, value in spec.engine_settings.items()
            ],
            "engine": None,
        }
        if engine is not None:
            stats = engine.stats()
            card["max_model_len"] = engine.max_model_len
            card["engine"] = {
                "kv_blocks_total": stats.kv_blocks_total,
                "kv_tokens_total": stats.kv_blocks_total * engine.config.block_size,
                "max_num_seqs": stats.max_num_seqs,
                "max_num_batched_tokens": stats.max_num_batched_tokens,
                "weight_format": getattr(engine, "weight_format", ""),
            }
            card["settings"] = [
                (name, value, ENGINE_SETTING_NOTES.get(name, "")) for name, value in asdict(engine.config).items()
            ]
        cards.append(card)
    return cards
