"""Gateway settings, read once at the edge and passed down frozen.

Until a model registry exists, prices come from here: USD per 1M input / cached input / output
tokens per model name, "*" for any model not listed, 0 otherwise.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from app.db import default_database_url


@dataclass(frozen=True)
class ModelPrice:
    input_per_1m: float = 0.0
    cached_input_per_1m: float = 0.0
    output_per_1m: float = 0.0

    def cost_nano_usd(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        uncached = max(prompt_tokens - cached_tokens, 0)
        # USD per 1M tokens * 1e9 nUSD per USD / 1e6 tokens = 1000 * price nUSD per token
        return round(1000 * (uncached * self.input_per_1m + cached_tokens * self.cached_input_per_1m
                             + completion_tokens * self.output_per_1m))


FREE = ModelPrice()


def parse_prices(raw: str | Mapping[str, Any] | None) -> Mapping[str, ModelPrice]:
    """`{"model": {"input": 0.15, "cached_input": 0.075, "output": 0.6}}` or `{"model": [0.15, 0.075, 0.6]}`."""
    if not raw:
        return MappingProxyType({})
    data = json.loads(raw) if isinstance(raw, str) else raw
    prices = {}
    for model, value in data.items():
        if isinstance(value, ModelPrice):
            prices[model] = value
        elif isinstance(value, (list, tuple)):
            prices[model] = ModelPrice(*(float(v) for v in value))
        else:
            prices[model] = ModelPrice(float(value.get("input", 0)), float(value.get("cached_input", 0)),
                                       float(value.get("output", 0)))
    return MappingProxyType(prices)


@dataclass(frozen=True)
class GatewayConfig:
    database_url: str = field(default_factory=lambda: default_database_url(".tokenmill"))
    redis_url: str | None = None
    redis_prefix: str = "tokenmill:rl:"
    admin_key: str | None = None
    prices: Mapping[str, ModelPrice] = field(default_factory=lambda: MappingProxyType({}))
    rate_window_s: float = 60.0  # rpm / tpm window; tests shorten it
    key_cache_ttl_s: float = 5.0  # how stale a replica may see a key changed elsewhere
    budget_cache_ttl_s: float = 2.0
    usage_flush_interval_s: float = 0.5
    usage_batch_max: int = 5000
    usage_buffer_max: int = 2_000_000  # rows held in memory while the DB is down
    last_used_flush_s: float = 10.0
    spill_dir: str = ".tokenmill"  # where rows go if the DB is still down at shutdown
    auth_failures_per_minute: int = 10  # per client address, then 429 until the minute is over; 0: no limit
    instance_id: str | None = None  # this replica's name on its usage rows (Ray Serve replica id, pod name)

    def __post_init__(self) -> None:
        if self.rate_window_s <= 0:
            raise ValueError("rate_window_s must be positive")
        if self.usage_flush_interval_s <= 0:
            raise ValueError("usage_flush_interval_s must be positive")

    def price(self, model: str) -> ModelPrice:
        return self.prices.get(model) or self.prices.get("*") or FREE

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> GatewayConfig:
        env = os.environ if env is None else env
        data_dir = env.get("TOKENMILL_DATA_DIR", ".tokenmill")
        values: dict[str, Any] = {
            "database_url": env.get("TOKENMILL_DATABASE_URL") or default_database_url(data_dir),
            "redis_url": env.get("TOKENMILL_REDIS_URL") or None,
            "admin_key": env.get("TOKENMILL_ADMIN_KEY") or None,
            "prices": parse_prices(env.get("TOKENMILL_MODEL_PRICES")),
            "spill_dir": data_dir,
            "instance_id": env.get("TOKENMILL_INSTANCE_ID") or None,
        }
        for name, kind in (("rate_window_s", float), ("key_cache_ttl_s", float),
                           ("usage_flush_interval_s", float), ("auth_failures_per_minute", int)):
            raw = env.get("TOKENMILL_" + name.upper())
            if raw:
                values[name] = kind(raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> GatewayConfig:
        """Take what the app's Settings carries; everything else from the environment."""
        values: dict[str, Any] = {}
        data_dir = getattr(settings, "data_dir", None)
        if data_dir:
            values["spill_dir"] = str(data_dir)
            values["database_url"] = default_database_url(data_dir)
        for name in ("database_url", "redis_url", "admin_key"):
            value = getattr(settings, name, None)
            if value:
                values[name] = value
        prices = getattr(settings, "model_prices", None)
        if prices:
            values["prices"] = parse_prices(prices)
        env_values = cls.from_env()
        base = {name: getattr(env_values, name) for name in (
            "prices", "rate_window_s", "key_cache_ttl_s", "usage_flush_interval_s", "auth_failures_per_minute",
            "instance_id")}
        return cls(**{**base, **values, **{k: v for k, v in overrides.items() if v is not None}})
