"""Key rotation: a new secret under the same key id, limits and usage; the old secret keeps working for
the grace period, then answers 401 invalid_api_key; both are stored only as hashes."""

from __future__ import annotations

import json
import time

from fastapi.testclient import TestClient
from sqlalchemy import select

from app.gateway.keys import hash_key
from app.tables import ApiKey, AuditEntry
from tests.support.gateway import (
    FakeClock,
    admin_headers,
    bearer,
    build_app,
    chat_body,
    create_key,
    create_team,
    usage_rows,
)


def rotate(client, key_id: int, **body):
    return client.post(f"/admin/api/keys/{key_id}/rotate", json=body or None, headers=admin_headers())


def chat(client, secret: str):
    return client.post("/v1/chat/completions", json=chat_body(max_tokens=2), headers=bearer(secret))


def test_rotation_keeps_the_key_id_and_limits_and_old_secret_works_during_the_grace(make_gateway):
    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:
        old = create_key(client, create_team(client)["id"], name="ci", rpm_limit=50)
        assert chat(client, old["key"]).status_code == 200
        rotated = rotate(client, old["id"])
        assert rotated.status_code == 200, rotated.text
        new = rotated.json()
        assert new["id"] == old["id"] and new["rpm_limit"] == 50 and new["name"] == "ci"
        assert new["key"].startswith("sk-") and new["key"] != old["key"] and new["key_prefix"] != old["key_prefix"]
        assert new["previous_key_prefix"] == old["key_prefix"] and new["rotated_at"]
        assert chat(client, old["key"]).status_code == 200  # the grace: 24 h by default
        assert chat(client, new["key"]).status_code == 200
        shown = client.get(f"/admin/api/keys/{old['id']}", headers=admin_headers()).text
        assert new["key"] not in shown and old["key"] not in shown
    assert {row.key_id for row in usage_rows(gateway)} == {old["id"]}
    with gateway.sessions() as session:
        row = session.get(ApiKey, old["id"])
        assert (row.key_hash, row.previous_key_hash) == (hash_key(new["key"]), hash_key(old["key"]))
        columns = repr([getattr(row, c.key) for c in ApiKey.__table__.columns])
        assert new["key"] not in columns and old["key"] not in columns


def test_old_secret_gets_401_once_the_grace_ends_even_from_the_cache(make_gateway):
    clock = FakeClock()
    gateway = make_gateway(clock=clock, key_cache_ttl_s=3600)  # the cache alone would serve it for an hour
    with TestClient(build_app(gateway)) as client:
        old = create_key(client, create_team(client)["id"])
        new = rotate(client, old["id"], grace_period_s=60).json()
        clock.now = time.time() + 30
        assert chat(client, old["key"]).status_code == 200  # cached from here on, with its grace's end
        clock.now = time.time() + 61
        refused = chat(client, old["key"])
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert chat(client, new["key"]).status_code == 200


def test_a_zero_grace_ends_the_old_secret_at_once(make_gateway):
    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:
        old = create_key(client, create_team(client)["id"])
        assert chat(client, old["key"]).status_code == 200
        new = rotate(client, old["id"], grace_period_s=0).json()
        assert chat(client, old["key"]).status_code == 401
        assert chat(client, new["key"]).status_code == 200


def test_rotating_again_ends_the_first_secret_now(make_gateway):
    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:
        first = create_key(client, create_team(client)["id"])
        second = rotate(client, first["id"]).json()
        third = rotate(client, first["id"]).json()
        assert chat(client, first["key"]).status_code == 401
        assert chat(client, second["key"]).status_code == 200
        assert chat(client, third["key"]).status_code == 200


def test_revoking_a_rotated_key_ends_both_secrets(make_gateway):
    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:
        old = create_key(client, create_team(client)["id"])
        assert chat(client, old["key"]).status_code == 200
        new = rotate(client, old["id"]).json()
        client.delete(f"/admin/api/keys/{old['id']}", headers=admin_headers())
        assert chat(client, old["key"]).status_code == 401
        assert chat(client, new["key"]).status_code == 401


def test_bad_rotations_get_openai_shaped_errors(make_gateway):
    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:
        key = create_key(client, create_team(client)["id"])
        for body, status in (({"grace_period_s": -1}, 400), ({"grace_period_s": 10**9}, 400), ({"nope": 1}, 400)):
            response = rotate(client, key["id"], **body)
            assert response.status_code == status and "error" in response.json(), response.text
        missing = rotate(client, 999)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        client.delete(f"/admin/api/keys/{key['id']}", headers=admin_headers())
        revoked = rotate(client, key["id"])
        assert revoked.status_code == 409 and revoked.json()["error"]["code"] == "conflict"
        nobody = client.post(f"/admin/api/keys/{key['id']}/rotate", headers=bearer(key["key"]))
        assert nobody.status_code == 401


def test_rotation_is_audited_without_either_secret(make_gateway):
    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:
        old = create_key(client, create_team(client)["id"])
        new = rotate(client, old["id"], grace_period_s=3600).json()
    with gateway.sessions() as session:
        (row,) = session.scalars(select(AuditEntry).where(AuditEntry.action == "key.rotate"))
    assert (row.target_type, row.target_id, row.actor_kind) == ("key", str(old["id"]), "admin_key")
    assert row.before["key_prefix"] == old["key_prefix"] and row.after["key_prefix"] == new["key_prefix"]
    assert row.after["previous_key_prefix"] == old["key_prefix"] and row.after["previous_key_expires_at"]
    stored = json.dumps([row.before, row.after])
    for secret in (old["key"], new["key"], hash_key(old["key"]), hash_key(new["key"])):
        assert secret not in stored
