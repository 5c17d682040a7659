"""`tokenmill serve` keeps an idle keep-alive connection open longer than clients keep it in their pools.

httpx (so the openai client) drops a pooled connection after 5 s idle, uvicorn closes one after 5 s by
default: a request sent on a connection idle for about 5 s raced the server's close and failed with
"Server disconnected without sending a response" (it did in CI, under a test flood)."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit

import httpx

from tests.support.gateway import serve_and_probe

CLIENT_POOL_EXPIRY_S = httpx.Limits().keepalive_expiry or 0.0


def health_twice_on_one_connection(url: str) -> list[int]:
    address = urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
    statuses = []
    for pause in (0.0, CLIENT_POOL_EXPIRY_S + 1.0):
        time.sleep(pause)
        connection.request("GET", "/health")
        response = connection.getresponse()
        response.read()
        statuses.append(response.status)
    connection.close()
    return statuses


def test_a_connection_idle_past_the_clients_pool_expiry_still_serves(tmp_path, monkeypatch):
    assert serve_and_probe(tmp_path, monkeypatch, health_twice_on_one_connection) == [200, 200]
