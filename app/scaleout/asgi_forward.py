"""Carry one HTTP request from the ingress to a replica and run it against the replica's own ASGI app,
streaming the response back piece by piece (httpx's ASGITransport would buffer the whole body).

The ingress sends a `ForwardedRequest` (plain data, pickled by Ray); the replica's generator yields a
`ResponseStart` first, then the body's chunks as bytes. When the consumer stops early (the client went
away), the app sees `http.disconnect`, so a streamed generation is aborted as it would be behind uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    prefix_key: str | None = None  # app.scaleout.prefix_routing: the hash order of replicas for this prompt
    prompt_blocks: tuple[bytes, ...] = ()  # ... and its block hashes, matched against the replicas' caches
    scheme: str = "http"
    replica: str | None = None  # a replica's unique id: only it may take the request (the ingress's /metrics)


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]


def http_scope(request: ForwardedRequest, state: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "state": {} if state is None else state,  # request.state: what the app leaves there, the caller reads
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": request.client,
        "server": None,
    }


async def run_asgi(
    app: ASGIApp,
    request: ForwardedRequest,
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
    state: dict[str, Any] | None = None,
) -> AsyncIterator[ResponseStart | bytes]:
    messages: asyncio.Queue[Any] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if disconnected.is_set():
            raise OSError("client disconnected")  # what uvicorn's send does once the peer is gone
        await messages.put(message)

    async def run() -> None:
        try:
            await app(http_scope(request, state), receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await messages.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], [*message.get("headers", []), *extra_headers])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await task  # the app's own errors surface here, after what it sent
    finally:
        disconnected.set()
        if not task.done():
            # Give the app a moment to see the disconnect and clean up (abort, usage row), then stop it.
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
            task.cancel()
