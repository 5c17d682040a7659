"""Reading a JSON request body: content type, a size cap, then strict validation; never a 500 or a hang."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from app.errors import OpenAIError, from_validation_error, invalid_request

BodyModel = TypeVar("BodyModel", bound=BaseModel)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")


def _check_content_type(request: Request) -> None:
    content_type = request.headers.get("content-type")
    if content_type is None:
        return  # clients that send JSON without saying so
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise OpenAIError(
            415, f"Unsupported content type {media_type!r}: send application/json.", code="unsupported_media_type"
        )


async def read_body(request: Request, model: type[BodyModel], max_bytes: int) -> BodyModel:
    _check_content_type(request)
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise invalid_request("Invalid Content-Length header.")
        if int(declared) > max_bytes:
            raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as error:
        raise from_validation_error(error.errors(include_url=False)) from None
