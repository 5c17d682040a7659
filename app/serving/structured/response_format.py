"""`response_format` -> the JSON schema the output must satisfy (None for plain text)."""

from __future__ import annotations

import re
from typing import Any

from app.errors import invalid_request

PARAM = "response_format"
SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def response_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """`json_object`: any JSON object; `json_schema`: the given schema, enforced whether or not `strict`
    is set (a schema we cannot enforce is refused, never loosened)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind != "json_schema":
        raise invalid_request(
            f"Invalid value for 'response_format.type': {kind!r}. Supported values are "
            "'text', 'json_object' and 'json_schema'.",
            param=PARAM,
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid_request("Missing required parameter: 'response_format.json_schema'.", param=PARAM)
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise invalid_request(
            "'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'.", param=PARAM
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_request("'response_format.json_schema.strict' must be a boolean.", param=PARAM)
    schema = spec.get("schema", ANY_OBJECT)
    if not isinstance(schema, dict):
        raise invalid_request("'response_format.json_schema.schema' must be a JSON schema object.", param=PARAM)
    return schema
