"""Who gets in: failed authentications are rate limited per address, keys are compared in constant time
and stored hashed, team keys never reach admin routes, no foreign origin is let in by CORS."""

from __future__ import annotations

import csv
import hmac
import io

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.gateway.auth import FailedAuthLimiter
from app.tables import ApiKey
from tests.support.gateway import (
    ADMIN_KEY,
    FakeClock,
    admin_headers,
    bearer,
    build_app,
    chat_body,
    create_key,
    create_team,
)

FOREIGN_ORIGIN = "https://evil.example"


@pytest.fixture
def database_url(tmp_path):
    """These claims don't depend on the back end: SQLite only, to keep the suite short."""
    return f"sqlite:///{tmp_path / 'tokenmill.db'}"


def client_for(gateway, address: str = "203.0.113.7") -> TestClient:
    return TestClient(build_app(gateway), client=(address, 50000))


def test_ten_failed_keys_from_one_address_then_429_with_retry_after(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        for n in range(10):
            assert (
                client.post("/v1/chat/completions", json=chat_body(), headers=bearer(f"sk-guess{n:04d}")).status_code
                == 401
            )
        refused = client.post("/v1/chat/completions", json=chat_body(), headers=bearer("sk-guess9999"))
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "too_many_auth_failures"
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    with client_for(gateway, "198.51.100.9") as other:  # another address is not affected
        assert other.post("/v1/chat/completions", json=chat_body(), headers=bearer("sk-other000")).status_code == 401


def test_a_valid_key_is_never_refused_by_the_failure_limit(make_gateway):
    """Behind one NAT or ingress, someone's wrong keys must not lock every team and the admin out."""
    gateway = make_gateway()
    with client_for(gateway) as client:
        good = create_key(client, create_team(client)["id"])["key"]
        for n in range(30):
            client.post("/v1/chat/completions", json=chat_body(), headers=bearer(f"sk-guess{n:04d}"))
            client.get("/admin/api/teams", headers=bearer(f"sk-admin-guess{n:04d}"))
        assert client.get("/v1/models", headers=bearer("sk-guess9999")).status_code == 429
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(good)).status_code == 200
        assert client.get("/admin/api/teams", headers=admin_headers()).status_code == 200
        page = client.get("/admin/login")
        token = page.text.split('name="csrf_token" value="')[1].split('"')[0]
        login = client.post(
            "/admin/login", data={"admin_key": ADMIN_KEY, "csrf_token": token, "next": "/admin"}, follow_redirects=False
        )
        assert login.status_code == 303


def test_failures_are_counted_per_presented_key_prefix_across_addresses(make_gateway):
    """Wrong keys aimed at one key (its visible prefix) from many addresses are limited too; the real key
    with that prefix still works."""
    gateway = make_gateway()
    with client_for(gateway) as admin:
        good = create_key(admin, create_team(admin)["id"])["key"]
    statuses = []
    for n in range(11):
        with client_for(gateway, f"198.51.100.{n + 1}") as client:
            statuses.append(client.get("/v1/models", headers=bearer(good[:-4] + f"{n:04d}")).status_code)
    assert statuses == [401] * 10 + [429]
    with client_for(gateway, "198.51.100.99") as client:
        assert client.get("/v1/models", headers=bearer(good)).status_code == 200


def test_missing_keys_count_as_failures_too(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        statuses = [client.get("/v1/models").status_code for _ in range(11)]
    assert statuses == [401] * 10 + [429]


def test_wrong_admin_keys_are_limited_too(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        statuses = [client.get("/admin/api/teams", headers=bearer("sk-admin-guess")).status_code for _ in range(11)]
        assert statuses == [401] * 10 + [429]
        assert client.get("/admin/api/teams", headers=admin_headers()).status_code == 200


def test_successful_requests_are_not_counted(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        key = create_key(client, create_team(client)["id"])["key"]
        for _ in range(30):
            assert client.get("/v1/models", headers=bearer(key)).status_code == 200
            assert client.get("/admin/api/teams", headers=admin_headers()).status_code == 200


def test_failures_expire_after_the_window():
    clock = FakeClock(0.0)
    limiter = FailedAuthLimiter(3, window_s=60, clock=clock)
    for _ in range(3):
        assert limiter.retry_after("a") is None
        limiter.failed("a")
    assert limiter.retry_after("a") == pytest.approx(60)
    clock.advance(30)
    assert limiter.retry_after("a") == pytest.approx(30)
    clock.advance(30.1)
    assert limiter.retry_after("a") is None


def test_the_limiter_keeps_a_bounded_number_of_addresses():
    limiter = FailedAuthLimiter(1, max_clients=100)
    for n in range(1000):
        limiter.failed(f"10.0.{n // 256}.{n % 256}")
    assert len(limiter._failures) == 100


def test_keys_are_stored_hashed_and_compared_in_constant_time(make_gateway, monkeypatch):
    gateway = make_gateway()
    compared = []
    real_compare = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or real_compare(a, b))
    with client_for(gateway) as client:
        key = create_key(client, create_team(client)["id"])
        assert compared  # the admin key was checked with compare_digest
        with gateway.sessions() as session:
            stored = session.scalar(select(ApiKey))
        assert key["key"] not in {stored.key_hash, stored.key_prefix}
        assert len(stored.key_hash) == 64 and stored.key_prefix == key["key_prefix"]
    # team keys are found by the SHA-256 of the key: the database compares digests, never the key


def test_team_keys_open_no_admin_route(make_gateway):
    gateway = make_gateway(auth_failures_per_minute=0)
    with client_for(gateway) as client:
        team_key = create_key(client, create_team(client)["id"])["key"]
        paths = client.app.openapi()["paths"]
        admin_routes = [
            (method, path.replace("{team_id}", "1").replace("{key_id}", "1"))
            for path, item in paths.items()
            if path.startswith("/admin/api")
            for method in item
        ]
        assert len(admin_routes) >= 8
        for method, path in admin_routes:
            response = client.request(method, path, headers=bearer(team_key), json={})
            assert response.status_code in (401, 403), (method, path, response.status_code)
        # and the admin key is no team key: it can't spend tokens or read a team's usage
        assert client.post("/v1/chat/completions", json=chat_body(), headers=admin_headers()).status_code == 401
        assert client.get("/v1/usage", headers=admin_headers()).status_code == 401


def test_team_a_reads_nothing_of_team_b(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        team_a, team_b = create_team(client, "a"), create_team(client, "b")
        key_a, key_b = create_key(client, team_a["id"]), create_key(client, team_b["id"])
        client.post("/v1/chat/completions", json=chat_body(max_tokens=7), headers=bearer(key_b["key"]))
        gateway.writer.flush()
        exported = client.get(
            "/v1/usage",
            params={"format": "csv", "team_id": team_b["id"], "group_by": "team"},
            headers=bearer(key_a["key"]),
        )
        assert exported.status_code == 200
        rows = list(csv.DictReader(io.StringIO(exported.text)))
        assert all(row["team_id"] != str(team_b["id"]) and row["completion_tokens"] in ("0", "") for row in rows)
        by_key = client.get("/v1/usage", params={"group_by": "key"}, headers=bearer(key_a["key"])).json()
        assert all(row.get("key_id") != key_b["id"] for row in by_key["data"])
        assert sum(row["completion_tokens"] for row in by_key["data"]) == 0


def test_cors_is_off_by_default(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        key = create_key(client, create_team(client)["id"])["key"]
        preflight = client.options(
            "/v1/chat/completions",
            headers={
                "Origin": FOREIGN_ORIGIN,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        simple = client.get("/v1/models", headers={"Origin": FOREIGN_ORIGIN, **bearer(key)})
        admin = client.get("/admin/api/teams", headers={"Origin": FOREIGN_ORIGIN, **admin_headers()})
    for response in (preflight, simple, admin):
        assert not any(name.lower().startswith("access-control-") for name in response.headers), response.headers
    assert preflight.status_code in (404, 405)


def test_wrong_admin_keys_on_the_dashboard_login_are_limited_too(make_gateway):
    from tests.support.dashboard import login_token

    gateway = make_gateway()
    with TestClient(build_app(gateway), base_url="https://testserver", client=("203.0.113.8", 50000)) as client:

        def attempt(admin_key: str) -> int:
            page = client.get("/admin/login")
            return client.post(
                "/admin/login",
                data={"admin_key": admin_key, "csrf_token": login_token(page.text)},
                follow_redirects=False,
            ).status_code

        statuses = [attempt("sk-admin-guess") for _ in range(11)]
        assert statuses == [401] * 10 + [429]
        assert attempt(gateway.config.admin_key) == 303  # the right key is never refused by the limit
