"""Bodies over the cap are refused with 413 while they stream in, on every route, before anything parses
them or authenticates with them: a real server process keeps its memory while 1 GB bodies arrive."""

from __future__ import annotations

import select
import socket
from pathlib import Path

import httpx
import pytest
from fastapi import Request
from fastapi.testclient import TestClient

from tests.support.gateway import admin_headers, build_app
from tests.support.gateway_fake_server import start

GIB = 1 << 30
CHUNK = 1 << 20
RSS_MARGIN = 50 << 20


@pytest.fixture
def database_url(tmp_path):
    return f"sqlite:///{tmp_path / 'tokenmill.db'}"


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def server(tmp_path):
    """`tokenmill serve` with the fake engine, in its own process so its memory is its own."""
    process, url = start(f"sqlite:///{tmp_path / 'tokenmill.db'}", tmp_path)
    try:
        yield process, httpx.URL(url).port
    finally:
        process.kill()
        process.wait(10)


def post_huge_body(
    port: int, path: str, headers: dict[str, str], *, declared: bool, pid: int, start_rss: int, total: int = GIB
) -> tuple[int, bytes]:
    """POST `total` bytes made on the fly (never held in memory), chunked or with a Content-Length, until
    the server answers; fails as soon as the server has grown by more than RSS_MARGIN. (status, body)."""
    chunk = b"a" * CHUNK
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        framing = f"Content-Length: {total}" if declared else "Transfer-Encoding: chunked"
        lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{lines}{framing}\r\n\r\n".encode())
        sent = 0
        try:
            while sent < total and not select.select([sock], [], [], 0)[0]:
                sock.sendall(chunk if declared else b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
                grown = resident_bytes(pid) - start_rss
                assert grown < RSS_MARGIN, f"the server grew by {grown >> 20} MB after {sent >> 20} MB of body"
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the server stopped taking the body: its answer is waiting
        response = b""
        while b"\r\n\r\n" not in response:
            data = sock.recv(65536)
            if not data:
                break
            response += data
    status_line, _, rest = response.partition(b"\r\n")
    assert status_line, f"no answer after {sent >> 20} MB"
    return int(status_line.split()[1]), rest


@pytest.mark.parametrize(
    "path,content_type",
    [
        ("/admin/login", "application/x-www-form-urlencoded"),  # the dashboard's form, before any session
        ("/admin/api/teams", "application/json"),  # no key: the body must not be parsed before the 401
        ("/v1/chat/completions", "application/json"),  # with a valid team key
    ],
)
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_gigabyte_body_is_refused_with_413_and_the_server_keeps_its_memory(server, path, content_type, declared):
    process, port = server
    url = f"http://127.0.0.1:{port}"
    headers = {"Content-Type": content_type}
    if path.startswith("/v1"):
        team = httpx.post(url + "/admin/api/teams", json={"name": "t"}, headers=admin_headers()).json()
        key = httpx.post(url + "/admin/api/keys", json={"team_id": team["id"]}, headers=admin_headers()).json()["key"]
        headers["Authorization"] = f"Bearer {key}"
    for _ in range(3):  # first requests allocate what every request then reuses
        httpx.post(url + path, content=b"{}", headers=headers)
    start_rss = resident_bytes(process.pid)
    status, rest = post_huge_body(port, path, headers, declared=declared, pid=process.pid, start_rss=start_rss)
    assert status == 413
    assert resident_bytes(process.pid) - start_rss < RSS_MARGIN
    assert process.poll() is None


def test_routes_added_later_are_capped_too(make_gateway):
    """The cap sits around the whole app, so a route nobody thought of (here: one that reads the raw body)
    gets it without asking."""
    app = build_app(make_gateway(), max_request_bytes=4096)
    read = []

    @app.post("/v1/brand-new")
    async def brand_new(request: Request) -> dict:
        read.append(len(await request.body()))
        return {}

    with TestClient(app) as client:
        assert client.post("/v1/brand-new", content=b"x" * 4096).status_code == 200
        refused = client.post("/v1/brand-new", content=b"x" * 4097)
        chunked = client.post("/v1/brand-new", content=iter([b"x" * 3000] * 2))
    assert refused.status_code == chunked.status_code == 413
    assert refused.json()["error"]["code"] == chunked.json()["error"]["code"] == "request_too_large"
    assert read == [4096]


def test_an_oversized_body_is_refused_before_the_admin_key_is_checked(make_gateway):
    with TestClient(build_app(make_gateway(), max_request_bytes=4096)) as client:
        response = client.post(
            "/admin/api/teams", content=b"{" + b" " * 8192 + b"}", headers={"content-type": "application/json"}
        )
    assert response.status_code == 413
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
