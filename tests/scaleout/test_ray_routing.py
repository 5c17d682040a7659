"""Prompt keys and rendezvous hashing (app.scaleout.prefix_routing; the rule: test_prefix_routing.py) and
the ASGI forwarding the replicas run (app.scaleout.asgi_forward): no Ray needed."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from app.scaleout.asgi_forward import ForwardedRequest, ResponseStart, run_asgi
from app.scaleout.prefix_routing import prefix_key, rendezvous_order, routing_text

SYSTEM = "You are the support assistant of ACME. " * 20


def chat(*messages: tuple[str, str]) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}).encode()


def test_chats_sharing_a_long_system_prompt_share_a_key():
    first = prefix_key(routing_text("/v1/chat/completions", chat(("system", SYSTEM), ("user", "hi"))))
    second = prefix_key(routing_text("/v1/chat/completions", chat(("system", SYSTEM), ("user", "bye"))))
    assert first is not None and first == second


def test_chats_differing_early_get_different_keys():
    first = prefix_key(routing_text("/v1/chat/completions", chat(("user", "hi"))))
    second = prefix_key(routing_text("/v1/chat/completions", chat(("user", "bye"))))
    assert first != second


def test_completions_key_on_their_prompt_and_content_parts_count_as_text():
    body = json.dumps({"model": "m", "prompt": ["abc", "def"]}).encode()
    assert routing_text("/v1/completions", body) == "abc"
    parts = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}).encode()
    assert routing_text("/v1/chat/completions", parts) == "user\nhello\n"


def test_requests_without_a_prompt_have_no_key():
    assert routing_text("/v1/embeddings", b'{"input": "x"}') is None
    assert routing_text("/v1/chat/completions", b"not json") is None
    assert routing_text("/v1/chat/completions", b"[1, 2]") is None
    assert prefix_key(None) is None


def test_a_key_keeps_its_replica_when_another_replica_leaves():
    replicas = ["a", "b", "c", "d"]
    keys = [f"key-{i}" for i in range(200)]
    before = {key: rendezvous_order(key, replicas)[0] for key in keys}
    after = {key: rendezvous_order(key, ["a", "b", "d"])[0] for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert all(before[key] == "c" for key in moved)  # only the keys of the replica that left move
    assert len({before[key] for key in keys}) == 4  # and keys spread over every replica


def streaming_app() -> FastAPI:
    app = FastAPI()
    seen: dict = {}

    @app.post("/echo")
    async def echo(request: Request) -> StreamingResponse:
        body = await request.body()
        seen["client"] = request.client

        async def chunks():
            yield body
            yield b"|done"

        return StreamingResponse(chunks(), headers={"x-test": "1"})

    @app.get("/forever")
    async def forever(request: Request) -> StreamingResponse:
        async def chunks():
            try:
                while True:
                    yield b"tick"
                    await asyncio.sleep(0.01)
            finally:
                seen["stopped"] = True

        return StreamingResponse(chunks())

    app.state.seen = seen
    return app


def forwarded(method: str, path: str, body: bytes = b"") -> ForwardedRequest:
    return ForwardedRequest(
        method=method, path=path, query_string=b"", headers=[(b"host", b"test")], body=body, client=("10.0.0.7", 5555)
    )


def test_forwarding_streams_the_start_then_the_body_with_the_replica_header():
    app = streaming_app()

    async def run() -> list:
        return [item async for item in run_asgi(app, forwarded("POST", "/echo", b"payload"), [(b"x-replica", b"r1")])]

    items = asyncio.run(run())
    start = items[0]
    assert isinstance(start, ResponseStart) and start.status == 200
    assert (b"x-test", b"1") in start.headers and (b"x-replica", b"r1") in start.headers
    assert b"".join(items[1:]) == b"payload|done"
    assert app.state.seen["client"].host == "10.0.0.7"  # the client's address reaches auth and limits


def test_a_consumer_that_stops_early_disconnects_the_app():
    app = streaming_app()

    async def run() -> None:
        stream = run_asgi(app, forwarded("GET", "/forever"))
        assert isinstance(await stream.__anext__(), ResponseStart)
        assert await stream.__anext__() == b"tick"
        await stream.aclose()

    asyncio.run(run())
    assert app.state.seen.get("stopped") is True
