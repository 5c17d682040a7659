"""Team and key forms -> the admin API's bodies. An empty field means "no limit"; pydantic validates."""

from __future__ import annotations

import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from app.gateway.schemas import Limits

Body = TypeVar("Body", bound=BaseModel)
LIMIT_NAMES = tuple(Limits.model_fields)


class FormError(ValueError):
    pass


def limits_from(form: dict[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in LIMIT_NAMES:
        if name not in form:
            continue
        text = form[name].strip()
        if name == "allowed_models":
            values[name] = [m for m in re.split(r"[,\s]+", text) if m]
        else:
            values[name] = text or None
    return values


def share_from(form: dict[str, str]) -> dict[str, Any]:
    """A team's share of the engine: an empty weight keeps the current one, an empty group leaves any group."""
    values: dict[str, Any] = {}
    if form.get("scheduling_weight", "").strip():
        values["scheduling_weight"] = form["scheduling_weight"].strip()
    if "cache_group" in form:
        values["cache_group"] = form["cache_group"].strip() or None
    if "file_quota_bytes" in form:  # empty: the server's default
        values["file_quota_bytes"] = form["file_quota_bytes"].strip() or None
    return values


def body_from(form: dict[str, str], model: type[Body], **fields: Any) -> Body:
    """The form's limits (and `fields`) as `model`, or FormError with a message for the page."""
    values = {**limits_from(form), **fields}
    try:
        return model.model_validate(values)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise FormError(f"{where}: {first['msg']}") from None
