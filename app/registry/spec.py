"""One registered model as the rest of the app sees it: a frozen snapshot of its registry row."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, cast

from app.gateway.config import ModelPrice
from engine.config import EngineConfig

KINDS = ("chat", "embedding")
DTYPES = ("float32", "bfloat16")
DEFAULT_SOURCE = "default"  # the embedded model of the kind, found in its wheel at load time
# What a registry row may set per model; the rest of EngineConfig is the server's (data_dir, threads).
ENGINE_SETTINGS = (
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory_gb",
    "num_cpu_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_step_seconds",
    "max_waiting",
    "preemption_mode",
    "enable_prefix_caching",
    "quantization",
    "kv_cache_dtype",
    "speculation",
)
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


class RegistryError(ValueError):
    """A registration the registry refuses; `param` names the field at fault (OpenAI error shape)."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_model") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str
    source: str
    architecture: str
    dtype: str = "float32"
    max_model_len: int | None = None
    engine_settings: dict[str, Any] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    price: ModelPrice | None = None  # None: no price sheet (TOKENMILL_MODEL_PRICES may still name one)
    enabled: bool = True
    hardware_cost_per_hour: float | None = None  # USD; None: the model shares the server's cost
    # What a request gets for the sampling fields it leaves out (app.registry.sampling_defaults)
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    created_at: datetime | None = None
    updated_at: datetime | None = None
    # A LoRA adapter (engine/lora.py): the chat model it runs on; `source` is then the PEFT folder. It is a
    # model of its own to clients (names, access, prices, usage) and shares its base's engine.
    adapter_of: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """The server's engine settings, with this model's weights, name and overrides."""
        return dataclasses.replace(
            base,
            model=self.source,
            served_model_name=self.name,
            dtype=cast("Literal['float32', 'bfloat16']", self.dtype),  # a registry row's: EngineConfig checks it
            max_model_len=self.max_model_len,
            **self.engine_settings,
        )


def check_name(name: object, *, param: str) -> str:  # anything a request's JSON holds
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise RegistryError(
            f"{param} must be 1-128 letters, digits or ._:/@+- and start with a letter or digit; got {name!r}.",
            param=param,
        )
    return name


def check_engine_settings(settings: dict[str, Any], base: EngineConfig) -> dict[str, Any]:
    """Known fields only, and values EngineConfig accepts."""
    unknown = sorted(set(settings) - set(ENGINE_SETTINGS))
    if unknown:
        raise RegistryError(
            f"unknown engine settings {unknown}; known: {list(ENGINE_SETTINGS)}.", param="engine_settings"
        )
    for name, value in settings.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise RegistryError(f"engine setting {name} must be a finite number, got {value}.", param="engine_settings")
    try:
        dataclasses.replace(base, **settings)
    except (TypeError, ValueError) as error:
        raise RegistryError(f"invalid engine settings: {error}", param="engine_settings") from None
    return dict(settings)


def price_of(
    input_per_1m: float | None,
    cached_input_per_1m: float | None,
    output_per_1m: float | None,
    batch_input_per_1m: float | None = None,
    batch_output_per_1m: float | None = None,
) -> ModelPrice | None:
    """A price sheet from its columns; cached input costs full input price unless set, batch lines half
    the interactive prices unless set."""
    if all(
        price is None
        for price in (input_per_1m, cached_input_per_1m, output_per_1m, batch_input_per_1m, batch_output_per_1m)
    ):
        return None
    input_price = input_per_1m or 0.0
    cached = input_price if cached_input_per_1m is None else cached_input_per_1m
    return ModelPrice(input_price, cached, output_per_1m or 0.0, batch_input_per_1m, batch_output_per_1m)
