"""The request body cap, for every route of the app (the /v1 API, /admin, the dashboard and any route
added later): an ASGI middleware around the whole app, so a body over the cap is refused with 413 while
it streams in, before anything parses it or authenticates with it.

A declared Content-Length over the cap is answered before the app runs at all. A body without one
(chunked) is counted as the app reads it; the read that crosses the cap raises BodyTooLarge, which the
error handlers (or this middleware, if nothing else did) turn into the same 413. Memory per request
stays at most one cap, whatever a client sends.

A path may have a cap of its own (`path_caps`): POST /v1/files takes uploads far larger than any JSON
body, and only there."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import OpenAIError, add_error_handler

if TYPE_CHECKING:
    from fastapi import FastAPI, Request


class BodyTooLarge(HTTPException):
    """An HTTPException so that FastAPI passes it on from a body read instead of calling it a parse error."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, body_too_large(limit).message)
        self.limit = limit


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")


def _declared_length(scope: Scope) -> int | None:
    """The Content-Length header; -1 for one that is not a number (refused as too large to be safe)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else -1
    return None


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, path_caps: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.path_caps = dict(path_caps or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_caps.get(scope.get("path", ""), self.max_body_bytes)
        declared = _declared_length(scope)
        if declared is not None and (declared < 0 or declared > limit):
            await body_too_large(limit).response()(scope, receive, send)
            return
        received = 0
        response_started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge:
            if response_started:  # a streamed response already under way: nothing left to say
                raise
            await body_too_large(limit).response()(scope, receive, send)


async def _body_too_large(request: Request, error: BodyTooLarge) -> JSONResponse:  # a FastAPI exception handler
    return body_too_large(error.limit).response()


def install_body_limit(
    app: FastAPI, max_body_bytes: int, path_caps: dict[str, int] | None = None
) -> None:  # a FastAPI app
    """Outermost of the app's own middleware, so it also covers what other middleware would read."""
    add_error_handler(app, BodyTooLarge, _body_too_large)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes, path_caps=path_caps)
