"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, whatever went wrong."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import HTTPExceptionHandler

log = logging.getLogger("tokenmill.errors")

INVALID_REQUEST = "invalid_request_error"


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def invalid_api_key() -> OpenAIError:
    return OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")


def server_error(message: str = "The server had an error while processing your request.") -> OpenAIError:
    return OpenAIError(500, message, type="server_error")


def param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """("messages", 0, "content") -> "messages.[0].content", the way OpenAI names nested params."""
    parts = [f"[{part}]" if isinstance(part, int) else str(part) for part in loc]
    return ".".join(parts) or None


def from_validation_error(errors: Sequence[Mapping[str, Any]]) -> OpenAIError:
    first = errors[0]
    if first["type"] == "json_invalid":
        return invalid_request(f"We could not parse the JSON body of your request: {first['msg']}", code="invalid_json")
    loc = tuple(first["loc"])
    if loc and loc[0] == "body":  # FastAPI prefixes where the value came from
        loc = loc[1:]
    param = param_from_loc(loc)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = f"Missing required parameter: '{param}'."
    elif first["type"] == "model_type" and not loc:
        message = "The request body must be a JSON object."
    elif param:
        message = f"Invalid value for '{param}': {message}"
    return invalid_request(message, param=param)


async def _openai_error(request: Request, error: OpenAIError) -> JSONResponse:
    return error.response()


async def _validation_error(request: Request, error: RequestValidationError | ValidationError) -> JSONResponse:
    return from_validation_error(error.errors()).response()


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    codes = {404: "unknown_url", 405: "method_not_allowed"}
    message = (
        f"Unknown request URL: {request.method} {request.url.path}." if error.status_code == 404 else str(error.detail)
    )
    kind = INVALID_REQUEST if error.status_code < 500 else "server_error"
    return OpenAIError(
        error.status_code, message, type=kind, code=codes.get(error.status_code), headers=dict(error.headers or {})
    ).response()


async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return server_error().response()


async def _client_gone(request: Request, error: ClientDisconnect) -> Response:
    """The client hung up while sending its body: nobody is left to read an answer, and it is not our
    error, so no traceback (uvicorn logs one for anything that reaches the catch-all handler)."""
    log.debug("client went away during %s %s", request.method, request.url.path)
    return Response(status_code=400)


async def out_of_range(request: Request, error: Exception) -> JSONResponse:
    """An id or limit beyond what the database stores (SQLite: int64) is the caller's error, not ours."""
    return invalid_request("A number in the request is out of range.", code="out_of_range").response()


ErrorT = TypeVar("ErrorT", bound=Exception)


def add_error_handler(
    app: FastAPI, kind: type[ErrorT], handler: Callable[[Request, ErrorT], Awaitable[Response]]
) -> None:
    """app.add_exception_handler for a handler of one kind of error. Starlette calls it only with errors of
    `kind` but types every handler as taking any Exception (Kludex/starlette#2417): hence the cast."""
    app.add_exception_handler(kind, cast(HTTPExceptionHandler, handler))


def install_error_handlers(app: FastAPI) -> None:
    add_error_handler(app, OpenAIError, _openai_error)
    add_error_handler(app, RequestValidationError, _validation_error)
    add_error_handler(app, ValidationError, _validation_error)
    add_error_handler(app, StarletteHTTPException, _http_error)
    add_error_handler(app, ClientDisconnect, _client_gone)
    app.add_exception_handler(Exception, _unexpected_error)
