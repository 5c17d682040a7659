"""Runs one batch line through the app's own route for its endpoint, in process: the body is validated,
admitted, run in the engine and metered by exactly the code a live request goes through. The caller is
named in the ASGI scope (BATCH_PRINCIPAL), which only code in this process can set; the route's
authentication takes it from there instead of from a header."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.types import ASGIApp, Message

from app.gateway.contract import Principal

log = logging.getLogger("tokenmill.batches")

BATCH_PRINCIPAL = "tokenmill.batch_principal"


async def dispatch(
    app: ASGIApp, path: str, body: bytes, principal: Principal, stop: asyncio.Event | None = None
) -> tuple[int, dict[str, Any]]:
    """(status code, JSON body) of POST `path` with `body`. Setting `stop` reads to the route as the
    client going away: the engine aborts the line."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "client": ("batch", 0),
        "server": ("batch", 0),
        "state": {},
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        BATCH_PRINCIPAL: principal,
    }
    sent_body = False
    status = 500
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await (stop or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception:  # the app's own 500 was sent (or not); the line fails, the batch goes on
        log.exception("batch line on %s failed", path)
        if not chunks:
            status = 500
    try:
        parsed = json.loads(b"".join(chunks))
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        status = status if status >= 400 else 500
        parsed = {
            "error": {
                "message": "The server had an error while processing this request.",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
    return status, parsed
