"""`tokenmill serve` believes X-Forwarded-For only from the proxies named by --forwarded-allow-ips (none by
default), so rotating the header does not get around the failed-authentication limit."""

from __future__ import annotations

import httpx
import pytest
import uvicorn

from app.cli.main import main
from app.settings import Settings, SettingsError
from tests.support.gateway import ADMIN_KEY, FakeEngine, serve_in_thread


class StoppableFakeEngine(FakeEngine):
    def shutdown(self) -> None:
        pass


def serve_and_probe(tmp_path, monkeypatch, probe, *flags: str, admin_key: str | None = ADMIN_KEY):
    """Runs `tokenmill serve` as a user would, with the fake engine, under the uvicorn options serve
    chooses (on a free port); `probe(url)` runs while it serves. Returns what the probe returned."""
    from app.gateway.wiring import gateway_from_settings
    from app.main import create_app

    if admin_key:
        monkeypatch.setenv("TOKENMILL_ADMIN_KEY", admin_key)
    else:
        monkeypatch.delenv("TOKENMILL_ADMIN_KEY", raising=False)
    monkeypatch.setattr(
        "app.scaleout.replica_app.build_server",
        lambda settings, migrated=False: (
            create_app(settings, engine := StoppableFakeEngine(), gateway=gateway_from_settings(settings)),
            engine,
        ),
    )
    results = []

    def run(app, **options):
        options = {name: value for name, value in options.items() if name not in ("host", "port")}
        with serve_in_thread(app, **options) as url:
            results.append(probe(url))

    monkeypatch.setattr(uvicorn, "run", run)
    assert (
        main(
            [
                "serve",
                "--data-dir",
                str(tmp_path),
                "--database-url",
                f"sqlite:///{tmp_path / 'tokenmill.db'}",
                "--log-level",
                "warning",
                *flags,
            ]
        )
        == 0
    )
    return results[0]


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
