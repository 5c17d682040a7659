"""What the app serves, as the dashboard sees it: one `ModelSource` (live numbers) and one model card
(settings, prices) per loaded model. Today that is the one engine in app.state.context; a model registry
extends these two functions and the pages follow."""
from __future__ import annotations

from dataclasses import asdict

from app.dashboard.histograms import HistogramCounts
from app.dashboard.live import ModelSource


def model_sources(app) -> list[ModelSource]:  # noqa: ANN001 - FastAPI
    context = app.state.context
    metrics = context.metrics
    return [ModelSource(
        name=context.model_name,
        stats=context.engine.stats,
        ttft=lambda: HistogramCounts.of(metrics.time_to_first_token),
        inter_token=lambda: HistogramCounts.of(metrics.inter_token_latency),
    )]


ENGINE_SETTING_NOTES = {
    "model": "weights (default = embedded SmolLM2)", "dtype": "weights and KV cache",
    "block_size": "tokens per KV block", "num_kv_blocks": "KV pool, blocks", "kv_cache_memory_gb": "KV pool, GiB",
    "max_num_seqs": "sequences per step", "max_num_batched_tokens": "token budget per step",
    "max_model_len": "context length", "max_waiting": "queue before 503", "preemption_mode": "when KV runs out",
    "enable_prefix_caching": "share identical prompt prefixes",
}


def model_cards(app) -> list[dict]:  # noqa: ANN001
    context = app.state.context
    engine = context.engine
    stats = engine.stats()
    config = asdict(engine.config)
    gateway = getattr(app.state, "gateway", None)
    price = gateway.config.price(context.model_name) if gateway is not None else None
    return [{
        "name": context.model_name,
        "max_model_len": engine.max_model_len,
        "kv_blocks_total": stats.kv_blocks_total,
        "kv_tokens_total": stats.kv_blocks_total * engine.config.block_size,
        "max_num_seqs": stats.max_num_seqs,
        "max_num_batched_tokens": stats.max_num_batched_tokens,
        "settings": [(name, value, ENGINE_SETTING_NOTES.get(name, "")) for name, value in config.items()],
        "price": None if price is None else asdict(price),
    }]
