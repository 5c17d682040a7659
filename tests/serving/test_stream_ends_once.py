"""A streamed request ends exactly once on every path: also when its client is gone before the first byte
goes out, the case where the stream's own code never runs. Otherwise the gateway counts it in flight for
ever and every shutdown waits out the whole drain timeout."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.support.gateway import (
    FakeEngine,
    bearer,
    build_app,
    chat_body,
    create_key,
    create_team,
    serve_in_thread,
    usage_rows,
)


@pytest.fixture
def database_url(tmp_path):
    return f"sqlite:///{tmp_path / 'tokenmill.db'}"


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def post_and_leave(url: str, path: str, body: dict, key: str) -> None:
    """Sends the whole request, gives the server a moment to read it, then closes the connection without
    reading a byte of the answer (while the server is still admitting the request)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        time.sleep(0.2)


STREAMS = [
    ("/v1/chat/completions", chat_body(max_tokens=50, stream=True)),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 50, "stream": True}),
    ("/v1/responses", {"model": "fake-model", "input": "hi", "max_output_tokens": 50, "stream": True}),
]


async def post_to_a_client_already_gone(app, path: str, body: dict, key: str) -> None:
    """One request straight into the ASGI app, as a server on ASGI spec 2.4 delivers it once the client
    has gone: the body arrives, then every send fails with OSError, the first one included."""
    payload = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "headers": [
            (b"host", b"x"),
            (b"authorization", f"Bearer {key}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ],
    }
    messages = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        raise OSError("the client has gone")

    try:
        await app(scope, receive, send)
    except Exception:  # what the app raises to a server whose client is gone is not the point
        pass


@pytest.mark.parametrize("path,body", STREAMS)
def test_a_client_gone_before_the_first_byte_ends_its_request_once(make_gateway, path, body):
    gateway = make_gateway()
    app = build_app(gateway, FakeEngine())
    with TestClient(app) as client:
        key = create_key(client, create_team(client)["id"])["key"]
        client.portal.call(post_to_a_client_already_gone, app, path, body, key)
        assert gateway.admitted == 1
        assert wait_until(lambda: gateway.in_flight == 0), "the request never ended: still counted in flight"
        time.sleep(0.2)  # a second end would show up as a second row
        assert [row.status for row in usage_rows(gateway)] == ["aborted"]
        assert gateway.finished == 1
        assert app.state.context.models.served["fake-model"].in_flight == 0  # nor is the model held


@pytest.mark.parametrize("path,body", STREAMS)
def test_a_client_that_leaves_while_admitted_ends_its_request_once(make_gateway, path, body):
    """The same through uvicorn: the client closes its connection while the server is still admitting."""
    gateway = make_gateway()
    app = build_app(gateway, FakeEngine(token_delay_s=0.05))
    admit = gateway.admit

    async def slow_admit(*args, **kwargs):
        await asyncio.sleep(0.5)  # the client leaves meanwhile
        return await admit(*args, **kwargs)

    gateway.admit = slow_admit
    with serve_in_thread(app) as url:
        with httpx.Client(base_url=url) as admin:
            key = create_key(admin, create_team(admin)["id"])["key"]
        post_and_leave(url, path, body, key)
        assert wait_until(lambda: gateway.admitted == 1)
        assert wait_until(lambda: gateway.in_flight == 0), "the request never ended: still counted in flight"
        time.sleep(0.2)
        assert [row.status for row in usage_rows(gateway)] == ["aborted"]
        assert gateway.finished == 1


def test_a_stream_read_to_the_end_still_ends_once_with_its_status(make_gateway):
    gateway = make_gateway()
    with TestClient(build_app(gateway, FakeEngine())) as client:
        key = create_key(client, create_team(client)["id"])["key"]
        with client.stream(
            "POST", "/v1/chat/completions", json=chat_body(max_tokens=5, stream=True), headers=bearer(key)
        ) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert [row.status for row in usage_rows(gateway)] == ["ok"]
        assert gateway.finished == gateway.admitted == 1
