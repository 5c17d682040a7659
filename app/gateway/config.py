"""The gateway's settings, taken from the app's Settings and passed down frozen.

Prices: the registry's price sheet of a model wins; for a model without one, USD per 1M input / cached
input / output tokens from --model-prices, "*" for any model not listed, 0 otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from app.settings import Settings, default_database_url


@dataclass(frozen=True)
class ModelPrice:
    input_per_1m: float = 0.0
    cached_input_per_1m: float = 0.0
    output_per_1m: float = 0.0
    batch_input_per_1m: float | None = None  # Batch API lines; None: half of input_per_1m
    batch_output_per_1m: float | None = None  # None: half of output_per_1m

    def for_batch(self) -> ModelPrice:
        """The sheet a batch line is charged by: the batch prices, by default half the interactive ones
        (cached input at half its price too, as OpenAI's batch discount applies to every token)."""
        input_price = self.input_per_1m / 2 if self.batch_input_per_1m is None else self.batch_input_per_1m
        output_price = self.output_per_1m / 2 if self.batch_output_per_1m is None else self.batch_output_per_1m
        cached = min(self.cached_input_per_1m / 2, input_price)
        return ModelPrice(input_price, cached, output_price, input_price, output_price)

    def cost_nano_usd(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        uncached = max(prompt_tokens - cached_tokens, 0)
        # USD per 1M tokens * 1e9 nUSD per USD / 1e6 tokens = 1000 * price nUSD per token
        return round(
            1000
            * (
                uncached * self.input_per_1m
                + cached_tokens * self.cached_input_per_1m
                + completion_tokens * self.output_per_1m
            )
        )


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
            prices[model] = ModelPrice(
                float(value.get("input", 0)), float(value.get("cached_input", 0)), float(value.get("output", 0))
            )
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
    max_in_flight_per_key: int = 0  # requests one key may have in flight here; a key's max_in_flight wins; 0: none
    instance_id: str | None = None  # this replica's name on its usage rows (Ray Serve replica id, pod name)
    # Where requests in flight hold their budget estimates and in-flight seats: "auto" (Redis when
    # configured, else the database unless it is SQLite, else this process), "redis", "database", "process".
    reservations: str = "auto"
    # A settled cost stays held this long past the budget cache's TTL after its row is committed, for
    # the replicas' reads of the roll-up to land.
    settled_hold_margin_s: float = 0.25
    holder_alive_ttl_s: float = 15.0  # a replica silent this long is taken for dead: its holds stop counting
    run_migrations: bool = True  # False where the caller migrated already (tokenmill serve, Ray replicas)

    def __post_init__(self) -> None:
        if self.rate_window_s <= 0:
            raise ValueError("rate_window_s must be positive")
        if self.usage_flush_interval_s <= 0:
            raise ValueError("usage_flush_interval_s must be positive")
        if self.reservations not in ("auto", "redis", "database", "process"):
            raise ValueError("reservations must be auto, redis, database or process")
        if self.reservations == "redis" and not self.redis_url:
            raise ValueError("reservations in Redis need a redis_url")

    def price(self, model: str) -> ModelPrice:
        return self.prices.get(model) or self.prices.get("*") or FREE

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> GatewayConfig:
        """The gateway's part of the app's Settings (flags and TOKENMILL_* variables, read once there)."""
        values: dict[str, Any] = {
            "database_url": settings.database_url,
            "redis_url": settings.redis_url,
            "admin_key": settings.admin_key,
            "prices": parse_prices(settings.model_prices),
            "rate_window_s": settings.rate_window_s,
            "key_cache_ttl_s": settings.key_cache_ttl_s,
            "usage_flush_interval_s": settings.usage_flush_interval_s,
            "auth_failures_per_minute": settings.auth_failures_per_minute,
            "instance_id": settings.instance_id,
            "max_in_flight_per_key": settings.max_in_flight_per_key,
            "spill_dir": settings.data_dir,
        }
        return cls(**{**values, **overrides})
