"""Key lifecycle through the real /v1 routes (fake engine): create, use, revoke, expire; team isolation."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.gateway.audit import SYSTEM
from app.gateway.keys import hash_key
from app.tables import ApiKey
from tests.support.gateway import (
    FAKE_MODEL,
    FakeClock,
    admin_headers,
    bearer,
    build_app,
    chat_body,
    create_key,
    create_team,
)


def client_for(gateway) -> TestClient:
    return TestClient(build_app(gateway))


def test_key_is_shown_once_and_stored_only_as_its_hash(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        team = create_team(client)
        created = create_key(client, team["id"], name="ci")
        plaintext = created["key"]
        assert plaintext.startswith("sk-") and len(plaintext) > 40
        assert plaintext.startswith(created["key_prefix"])
        listed = client.get("/admin/api/keys", headers=admin_headers()).json()
        assert "key" not in listed["data"][0] and listed["data"][0]["key_prefix"] == created["key_prefix"]
        assert plaintext not in client.get(f"/admin/api/keys/{created['id']}", headers=admin_headers()).text
    with gateway.sessions() as session:
        row = session.scalar(select(ApiKey))
        assert row.key_hash == hash_key(plaintext)
        assert plaintext not in repr([getattr(row, c.key) for c in ApiKey.__table__.columns])


def test_key_lifecycle_create_use_revoke(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        key = create_key(client, create_team(client)["id"])
        ok = client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key["key"]))
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 5
        revoked = client.delete(f"/admin/api/keys/{key['id']}", headers=admin_headers())
        assert revoked.status_code == 200 and revoked.json()["revoked"] is True
        refused = client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key["key"]))
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"


def test_missing_unknown_and_malformed_keys_get_401_in_openai_shape(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        for headers in ({}, bearer("sk-not-a-real-key"), {"Authorization": "Basic abc"}):
            response = client.post("/v1/chat/completions", json=chat_body(), headers=headers)
            assert response.status_code == 401
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and set(error) == {"message", "type", "param", "code"}
        assert client.get("/v1/models").status_code == 401


def test_expired_key_gets_401(make_gateway):
    clock = FakeClock()
    gateway = make_gateway(clock=clock)
    expires = datetime.fromtimestamp(clock.now, UTC) + timedelta(minutes=5)
    with client_for(gateway) as client:
        key = create_key(client, create_team(client)["id"], expires_at=expires.isoformat())
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key["key"])).status_code == 200
        clock.advance(301)
        response = client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key["key"]))
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_expiry_given_in_the_past_refuses_at_once(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        key = create_key(client, create_team(client)["id"], expires_at="2020-01-01T00:00:00Z")
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key["key"])).status_code == 401


def test_deleting_a_team_revokes_its_keys(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        team = create_team(client)
        key = create_key(client, team["id"])
        assert client.delete(f"/admin/api/teams/{team['id']}", headers=admin_headers()).json()["deleted"]
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key["key"])).status_code == 401
        assert client.get(f"/admin/api/teams/{team['id']}", headers=admin_headers()).status_code == 404


def test_blocking_a_team_refuses_its_keys_until_unblocked(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        team = create_team(client)
        key = create_key(client, team["id"])
        client.patch(f"/admin/api/teams/{team['id']}", json={"blocked": True}, headers=admin_headers())
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key["key"])).status_code == 401
        client.patch(f"/admin/api/teams/{team['id']}", json={"blocked": False}, headers=admin_headers())
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key["key"])).status_code == 200


def test_a_model_outside_the_keys_list_is_refused_and_hidden(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        team = create_team(client)
        limited = create_key(client, team["id"], allowed_models=["some-other-model"])
        open_key = create_key(client, team["id"])
        refused = client.post("/v1/chat/completions", json=chat_body(), headers=bearer(limited["key"]))
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
        assert client.get("/v1/models", headers=bearer(limited["key"])).json()["data"] == []
        assert client.get(f"/v1/models/{FAKE_MODEL}", headers=bearer(limited["key"])).status_code == 404
        assert [m["id"] for m in client.get("/v1/models", headers=bearer(open_key["key"])).json()["data"]] == [
            FAKE_MODEL
        ]


def test_a_teams_model_list_binds_all_its_keys(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        team = create_team(client, allowed_models=["another-model"])
        key = create_key(client, team["id"])
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key["key"])).status_code == 404
        client.patch(f"/admin/api/teams/{team['id']}", json={"allowed_models": [FAKE_MODEL]}, headers=admin_headers())
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key["key"])).status_code == 200


def test_team_key_reads_its_own_usage_and_nothing_of_other_teams(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        team_a, team_b = create_team(client, "a"), create_team(client, "b")
        key_a, key_b = create_key(client, team_a["id"]), create_key(client, team_b["id"])
        client.post("/v1/chat/completions", json=chat_body(max_tokens=3), headers=bearer(key_a["key"]))
        client.post("/v1/chat/completions", json=chat_body(max_tokens=7), headers=bearer(key_b["key"]))
        gateway.writer.flush()
        own = client.get("/v1/usage", params={"group_by": "team"}, headers=bearer(key_a["key"])).json()
        assert [(row["team_id"], row["completion_tokens"]) for row in own["data"]] == [(team_a["id"], 3)]
        asked_for_b = client.get(
            "/v1/usage", params={"team_id": team_b["id"], "group_by": "team"}, headers=bearer(key_a["key"])
        ).json()
        assert [row["team_id"] for row in asked_for_b["data"]] == [team_a["id"]]
        other_key = client.get("/v1/usage", params={"key_id": key_b["id"]}, headers=bearer(key_a["key"]))
        assert other_key.status_code == 404
        assert client.get("/admin/api/usage", headers=bearer(key_a["key"])).status_code == 401
        assert client.get("/admin/api/teams", headers=bearer(key_a["key"])).status_code == 401


def test_admin_api_needs_the_admin_key(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        for headers in ({}, bearer("sk-admin-wrong")):
            response = client.get("/admin/api/teams", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/admin/api/teams", headers=admin_headers()).status_code == 200


def test_admin_and_usage_routes_are_in_the_openapi_schema(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        schema = client.app.openapi()
    paths = schema["paths"]
    for path, methods in {
        "/admin/api/teams": {"get", "post"},
        "/admin/api/teams/{team_id}": {"get", "patch", "delete"},
        "/admin/api/keys": {"get", "post"},
        "/admin/api/keys/{key_id}": {"get", "patch", "delete"},
        "/admin/api/usage": {"get"},
        "/admin/api/usage.csv": {"get"},
        "/v1/usage": {"get"},
    }.items():
        assert methods <= set(paths[path]), path
    created = schema["components"]["schemas"]["KeyCreated"]["properties"]
    assert "key" in created and "key_hash" not in created


def test_admin_errors_are_in_openai_shape(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        missing = client.get("/admin/api/teams/999", headers=admin_headers())
        invalid = client.post("/admin/api/teams", json={"name": ""}, headers=admin_headers())
        create_team(client, "dup")
        duplicate = client.post("/admin/api/teams", json={"name": "dup"}, headers=admin_headers())
        no_team = client.post("/admin/api/keys", json={"team_id": 999}, headers=admin_headers())
        bad_group = client.get("/admin/api/usage", params={"group_by": "colour"}, headers=admin_headers())
    assert (
        missing.status_code,
        invalid.status_code,
        duplicate.status_code,
        no_team.status_code,
        bad_group.status_code,
    ) == (404, 400, 409, 404, 400)
    for response in (missing, invalid, duplicate, no_team, bad_group):
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def make_keys(gateway, count: int = 2) -> list[tuple[int, str]]:
    """(key id, plaintext) of `count` keys of a new team, made straight in the database (as the CLI does)."""
    from app.gateway import crud

    with gateway.sessions() as session, session.begin():
        team = crud.create_team(session, actor=SYSTEM, name=f"team-{count}")
        made = [crud.create_key(session, actor=SYSTEM, team=team) for _ in range(count)]
        return [(key.id, plaintext) for key, plaintext in made]


def revoke_elsewhere(gateway, key_id: int) -> None:
    """A revoke this process's admin API doesn't see (CLI, another replica): no cache invalidation."""
    from app.gateway import crud

    with gateway.sessions() as session, session.begin():
        crud.revoke_key(session, actor=SYSTEM, key=crud.get_key(session, key_id=key_id))


def test_keys_in_use_are_reloaded_ahead_of_their_ttl_in_one_round(make_gateway):
    from app.gateway.auth import KeyCache

    gateway = make_gateway()
    clock = FakeClock(0.0)
    cache = KeyCache(gateway.sessions, ttl_s=10.0, clock=clock)
    (id_a, key_a), (_, key_b), (_, idle) = make_keys(gateway, 3)
    for key in (key_a, key_b, idle):
        assert cache.load(key).valid_at(0.0)
    revoke_elsewhere(gateway, id_a)
    clock.advance(6.0)  # past half the TTL: due for a reload
    assert cache.cached(key_a)[1].valid_at(0.0) and cache.cached(key_b)[0]  # still served from the cache
    assert cache.refresh_due() == 2  # the two keys in use, in one round; the idle one is left to expire
    hit, principal = cache.cached(key_a)
    assert hit and not principal.valid_at(0.0)  # the revoke is seen before the TTL is up
    clock.advance(5.0)
    assert cache.cached(key_b)[0] and not cache.cached(idle)[0]  # past the TTL: loaded again on use


def test_no_cached_key_is_served_past_its_ttl(make_gateway):
    from app.gateway.auth import KeyCache

    gateway = make_gateway()
    clock = FakeClock(0.0)
    cache = KeyCache(gateway.sessions, ttl_s=10.0, clock=clock)
    [(key_id, key)] = make_keys(gateway, 1)
    cache.load(key)
    revoke_elsewhere(gateway, key_id)
    clock.advance(10.01)  # no refresh ran (no event loop here): the entry must not be served
    assert cache.cached(key) == (False, None)
    assert not cache.load(key).valid_at(0.0)


def test_a_load_that_raced_an_invalidation_is_not_kept(make_gateway, monkeypatch):
    from app.gateway import auth

    gateway = make_gateway()
    cache = auth.KeyCache(gateway.sessions, ttl_s=10.0)
    [(key_id, key)] = make_keys(gateway, 1)
    load_principal = auth.load_principal

    def revoked_while_loading(sessions, key_hash):
        principal = load_principal(sessions, key_hash)  # read before the revoke ...
        revoke_elsewhere(gateway, key_id)
        cache.invalidate([key_hash])  # ... which the admin API announces while the read is in flight
        return principal

    monkeypatch.setattr(auth, "load_principal", revoked_while_loading)
    assert cache.load(key).valid_at(0.0)
    monkeypatch.undo()
    assert cache.cached(key) == (False, None)  # the stale read was dropped: the next request reads again
    assert not cache.load(key).valid_at(0.0)


def test_a_busy_server_refreshes_keys_in_the_background(make_gateway):
    """Through the real routes: a key in use past half its TTL is reloaded off the request path, and a
    revoke made elsewhere takes effect within the TTL."""
    gateway = make_gateway(key_cache_ttl_s=0.4)
    [(key_id, key)] = make_keys(gateway, 1)
    with client_for(gateway) as client:
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key)).status_code == 200
        deadline = time.monotonic() + 5
        while gateway.keys.refreshes.rounds == 0 and time.monotonic() < deadline:
            assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key)).status_code == 200
            time.sleep(0.05)
        assert gateway.keys.refreshes.rounds > 0
        revoke_elsewhere(gateway, key_id)
        time.sleep(0.45)
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key)).status_code == 401


def test_a_key_chosen_with_api_key_is_stored_hashed_once_and_stays_revoked(make_gateway):
    from app.gateway.admin_identity import ensure_configured_key

    gateway = make_gateway()
    chosen = "sk-chosen-up-front-0123456789"
    assert "added as a key of team 'default'" in ensure_configured_key(gateway.sessions, chosen)
    assert "is a key of team 'default'" in ensure_configured_key(gateway.sessions, chosen)  # a restart: no copy
    with client_for(gateway) as client:
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(chosen)).status_code == 200
        [row] = client.get("/admin/api/keys", headers=admin_headers()).json()["data"]
        assert client.delete(f"/admin/api/keys/{row['id']}", headers=admin_headers()).status_code == 200
    assert "revoked" in ensure_configured_key(gateway.sessions, chosen)  # the next start does not revive it
    with gateway.sessions() as session:
        [stored] = session.scalars(select(ApiKey)).all()
        assert stored.key_hash == hash_key(chosen) and chosen not in stored.key_prefix + stored.name
    for weak in ("short", "sk-admin-" + "x" * 30):
        with pytest.raises(ValueError):
            ensure_configured_key(gateway.sessions, weak)
