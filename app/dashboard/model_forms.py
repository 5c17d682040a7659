"""The Models page's forms -> the admin API's bodies (ModelCreate, ModelChanges, ServerCostChange).

Only the shape changes here: text fields become the JSON values a curl user would send (an empty field
is null, aliases are comma-separated, an engine setting is typed as EngineConfig declares it). Every
check stays where the admin API makes it: pydantic on the body, then app.registry."""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal

from app.errors import invalid_request
from app.registry.registration import PRICE_FIELDS
from app.registry.spec import ENGINE_SETTINGS, ModelSpec
from engine.config import EngineConfig

SETTING_PREFIX = "engine."  # engine.num_kv_blocks=64: one field per setting a registry row may set
_HINTS = typing.get_type_hints(EngineConfig)


def setting_choices(name: str) -> tuple[Any, ...]:
    """The values a setting takes when they are few (a Literal or a bool): the page shows a select."""
    hint = _plain(_HINTS[name])
    if hint is bool:
        return (True, False)
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    return ()


def _plain(hint: Any) -> Any:
    """`int | None` -> int: an empty field already means "not set"."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def _typed(name: str, text: str) -> Any:
    hint = _plain(_HINTS[name])
    try:
        if hint is bool:
            return {"true": True, "false": False}[text.lower()]
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
    except (KeyError, ValueError):
        kind = {bool: "true or false", int: "a whole number", float: "a number"}[hint]
        raise invalid_request(
            f"engine setting {name} must be {kind}, got {text!r}.", param="engine_settings", code="invalid_model"
        ) from None
    return text  # a Literal: EngineConfig names the allowed values when it refuses one


def engine_settings_from(form: dict[str, str]) -> dict[str, Any]:
    """The settings filled in; one left empty is not set (the server's value applies)."""
    settings = {}
    for name in ENGINE_SETTINGS:
        text = form.get(SETTING_PREFIX + name, "").strip()
        if text:
            settings[name] = _typed(name, text)
    return settings


def _optional(form: dict[str, str], name: str) -> str | None:
    return form.get(name, "").strip() or None


def _aliases(text: str) -> list[str]:
    return [alias for alias in re.split(r"[,\s]+", text) if alias]


def _costs_from(form: dict[str, str]) -> dict[str, Any]:
    return {field: _optional(form, field) for field in (*PRICE_FIELDS, "hardware_cost_per_hour") if field in form}


def register_body(form: dict[str, str]) -> dict[str, Any]:
    """The register form as POST /admin/api/models's body. Empty prices and settings are left out, as a
    caller of the API would leave them out."""
    body: dict[str, Any] = {
        "name": form.get("name", "").strip(),
        "path": form.get("path", "").strip(),
        "kind": form.get("kind", "chat"),
        "load": form.get("load") == "on",
    }
    if _optional(form, "aliases"):
        body["aliases"] = _aliases(form["aliases"])
    if _optional(form, "max_model_len"):
        body["max_model_len"] = form["max_model_len"].strip()
    if _optional(form, "dtype"):
        body["dtype"] = form["dtype"].strip()
    if _optional(form, "adapter_of"):  # the path is a PEFT LoRA folder for this loaded model
        body["adapter_of"] = form["adapter_of"].strip()
    body.update({field: value for field, value in _costs_from(form).items() if value is not None})
    settings = engine_settings_from(form)
    if settings:
        body["engine_settings"] = settings
    return body


def change_body(form: dict[str, str], spec: ModelSpec) -> dict[str, Any]:
    """The edit form as PATCH /admin/api/models/{name}'s body. The form shows every value, so what it
    sends replaces them all (an emptied price or setting is removed); the path and dtype are sent only
    when changed, as a new path re-reads the weights and resets their sampling defaults."""
    body: dict[str, Any] = {
        "aliases": _aliases(form.get("aliases", "")),
        "engine_settings": engine_settings_from(form),
        **_costs_from(form),
    }
    if "max_model_len" in form:
        body["max_model_len"] = _optional(form, "max_model_len")
    path = form.get("path", "").strip()
    if path and path != spec.source:
        body["path"] = path
    dtype = form.get("dtype", "").strip()
    if dtype and dtype != spec.dtype:
        body["dtype"] = dtype
    return body


def server_cost_body(form: dict[str, str]) -> dict[str, Any]:
    """PATCH /admin/api/costs's body; an empty field is no cost, $0/h."""
    return {"hardware_cost_per_hour": _optional(form, "hardware_cost_per_hour") or "0"}


def form_values(spec: ModelSpec) -> dict[str, str]:
    """The edit form filled in with what the registry holds (what change_body reads back unchanged)."""
    price = spec.price
    prices = (
        (price.input_per_1m, price.cached_input_per_1m, price.output_per_1m)
        + (price.batch_input_per_1m, price.batch_output_per_1m)
        if price is not None
        else (None,) * len(PRICE_FIELDS)
    )
    return {
        "path": spec.source,
        "dtype": spec.dtype,
        "aliases": ", ".join(spec.aliases),
        "max_model_len": _text(spec.max_model_len),
        "hardware_cost_per_hour": _text(spec.hardware_cost_per_hour),
        **{field: _text(value) for field, value in zip(PRICE_FIELDS, prices, strict=True)},
        **{SETTING_PREFIX + name: _text(value) for name, value in spec.engine_settings.items()},
    }


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
