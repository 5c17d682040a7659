"""Turns an operator's request (register, or change) into a checked ModelSpec, or a RegistryError that
says what to fix. Pure apart from reading the model's config / header; blocking, so callers run it off
the event loop. Nothing is written here: the pool persists what this returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from app.registry.inspection import SourceFacts, inspect_source
from app.registry.sampling_defaults import changed_sampling_defaults
from app.registry.spec import (
    DTYPES,
    KINDS,
    ModelSpec,
    RegistryError,
    check_engine_settings,
    check_name,
    price_of,
)
from engine.config import EngineConfig

PRICE_FIELDS = (
    "price_input_per_1m",
    "price_cached_input_per_1m",
    "price_output_per_1m",
    "price_batch_input_per_1m",
    "price_batch_output_per_1m",
)
# These take effect at once (sampling defaults: from the next request); the rest at the next load.
LIVE_FIELDS = ("aliases", "enabled", "hardware_cost_per_hour", "sampling_defaults", *PRICE_FIELDS)


def new_spec(
    fields: Mapping[str, Any], *, base: EngineConfig, others: Iterable[ModelSpec], facts: SourceFacts | None = None
) -> ModelSpec:
    """fields: name, path, and optionally kind, dtype, max_model_len, engine_settings, aliases, prices,
    enabled, sampling_defaults (over the checkpoint's own). `facts`: the path's, when the caller inspected
    it already."""
    kind = fields.get("kind") or "chat"
    if kind not in KINDS:
        raise RegistryError(f"kind must be one of {list(KINDS)}, got {kind!r}.", param="kind")
    spec = ModelSpec(
        name=check_name(fields.get("name"), param="name"),
        kind=kind,
        source=str(fields.get("path")),
        architecture="",
        dtype=fields.get("dtype") or base.dtype,
    )
    others = list(others)
    _check_unique(spec, others)  # changed_spec() below sets aside a model of the same name: it is this one
    return changed_spec(
        spec,
        {k: v for k, v in fields.items() if k not in ("name", "kind", "path")},
        base=base,
        others=others,
        source=str(fields.get("path")),
        facts=facts,
    )


def changed_spec(
    spec: ModelSpec,
    changes: Mapping[str, Any],
    *,
    base: EngineConfig,
    others: Iterable[ModelSpec],
    source: str | None = None,
    facts: SourceFacts | None = None,
) -> ModelSpec:
    """`spec` with `changes` applied and checked. `source` (a new path) is inspected again, unless the
    caller gives its `facts`. New weights bring their own sampling defaults (the old ones described the
    old weights); `sampling_defaults` in `changes` are merged over them, a null removing one."""
    others = [other for other in others if other.name != spec.name]
    values: dict[str, Any] = {}
    if "path" in changes:
        source = str(changes["path"])
    if source is not None:
        facts = facts or inspect_source(spec.kind, source)
        values.update(source=source, architecture=facts.architecture, sampling_defaults=dict(facts.sampling_defaults))
        max_context = facts.max_context
    else:
        max_context = None
    if changes.get("dtype") is not None:
        if changes["dtype"] not in DTYPES:
            raise RegistryError(f"dtype must be one of {list(DTYPES)}.", param="dtype")
        values["dtype"] = changes["dtype"]
    if "max_model_len" in changes:
        values["max_model_len"] = _max_model_len(changes["max_model_len"], max_context)
    elif source is not None:  # new weights: their context, unless the request names one
        values["max_model_len"] = max_context
    if changes.get("engine_settings") is not None:
        values["engine_settings"] = check_engine_settings(dict(changes["engine_settings"]), base)
    if changes.get("aliases") is not None:
        values["aliases"] = _aliases(spec.name, changes["aliases"], others)
    if any(field in changes for field in PRICE_FIELDS):
        current = _price_columns(spec)
        current.update({field: changes[field] for field in PRICE_FIELDS if field in changes})
        values["price"] = price_of(*(current[field] for field in PRICE_FIELDS))
    if "hardware_cost_per_hour" in changes:
        cost = changes["hardware_cost_per_hour"]
        if cost is not None and cost < 0:
            raise RegistryError("hardware_cost_per_hour must not be negative.", param="hardware_cost_per_hour")
        values["hardware_cost_per_hour"] = cost
    if changes.get("sampling_defaults") is not None:
        if spec.kind != "chat" and changes["sampling_defaults"]:
            raise RegistryError("sampling_defaults apply to chat models only.", param="sampling_defaults")
        values["sampling_defaults"] = changed_sampling_defaults(
            values.get("sampling_defaults", spec.sampling_defaults), changes["sampling_defaults"]
        )
    if changes.get("enabled") is not None:
        values["enabled"] = bool(changes["enabled"])
    updated = dataclasses.replace(spec, **values)
    _check_unique(updated, others)
    return updated


def _max_model_len(value: int | None, checkpoint_max: int | None) -> int | None:
    if value is None:
        return checkpoint_max
    if value < 1:
        raise RegistryError("max_model_len must be at least 1.", param="max_model_len")
    if checkpoint_max is not None and value > checkpoint_max:
        raise RegistryError(
            f"max_model_len {value} is beyond the model's {checkpoint_max} positions.", param="max_model_len"
        )
    return value


def _aliases(name: str, aliases: Iterable[str], others: list[ModelSpec]) -> tuple[str, ...]:
    checked = []
    for alias in aliases:
        check_name(alias, param="aliases")
        if alias != name and alias not in checked:
            checked.append(alias)
    return tuple(checked)


def _check_unique(spec: ModelSpec, others: list[ModelSpec]) -> None:
    taken = {name: other.name for other in others for name in other.names}
    for name in spec.names:
        if name in taken:
            what = "model" if name == taken[name] else f"alias of model {taken[name]!r}"
            raise RegistryError(
                f"{name!r} is already a registered {what}.",
                param="name" if name == spec.name else "aliases",
                code="conflict",
            )


def _price_columns(spec: ModelSpec) -> dict[str, float | None]:
    price = spec.price
    if price is None:
        return dict.fromkeys(PRICE_FIELDS)
    return dict(
        zip(
            PRICE_FIELDS,
            (
                price.input_per_1m,
                price.cached_input_per_1m,
                price.output_per_1m,
                price.batch_input_per_1m,
                price.batch_output_per_1m,
            ),
        )
    )
