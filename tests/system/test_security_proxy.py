"""`tokenmill serve` believes X-Forwarded-For only from the proxies named by --forwarded-allow-ips (none by
default), so rotating the header does not get around the failed-authentication limit."""

from __future__ import annotations

import httpx
import pytest

from app.settings import Settings, SettingsError
from tests.support.gateway import serve_and_probe


def wrong_keys(url: str, forwarded_for: list[str], first: int = 0) -> list[int]:
    """Wrong keys, each with a prefix of its own: only the address can add them up."""
    return [
        httpx.get(
            url + "/v1/models", headers={"Authorization": f"Bearer sk-{n:08d}-guess", "X-Forwarded-For": address}
        ).status_code
        for n, address in enumerate(forwarded_for, start=first)
    ]


def test_x_forwarded_for_is_ignored_by_default(tmp_path, monkeypatch):
    rotating = [f"203.0.113.{n}" for n in range(1, 12)]
    statuses = serve_and_probe(tmp_path, monkeypatch, lambda url: wrong_keys(url, rotating))
    assert statuses == [401] * 10 + [429]


def test_a_trusted_proxy_names_the_client_the_limit_counts(tmp_path, monkeypatch):
    def probe(url: str) -> tuple[list[int], list[int]]:
        one_client = wrong_keys(url, ["203.0.113.1"] * 11)
        another_client = wrong_keys(url, ["203.0.113.2"], first=100)
        return one_client, another_client

    one_client, another_client = serve_and_probe(tmp_path, monkeypatch, probe, "--forwarded-allow-ips", "127.0.0.1")
    assert one_client == [401] * 10 + [429]
    assert another_client == [401]


def test_forwarded_allow_ips_must_be_addresses_or_networks():
    assert Settings(forwarded_allow_ips="10.0.0.0/8, 127.0.0.1").forwarded_allow_ips
    with pytest.raises(SettingsError, match="forwarded_allow_ips"):
        Settings(forwarded_allow_ips="proxy.example")
