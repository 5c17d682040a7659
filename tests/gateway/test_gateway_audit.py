"""The audit log: every admin change through the admin API writes one row in the change's own
transaction, with who made it and the values before and after, and never a secret."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.gateway.audit import REDACTED, Actor, record_change
from app.gateway.keys import hash_key, visible_prefix
from app.tables import AuditEntry
from tests.support.gateway import ADMIN_KEY, admin_headers, build_app, create_key, create_team

ACTOR = Actor("sso", "subject-1", "ada@example.com")


def client_for(gateway) -> TestClient:
    return TestClient(build_app(gateway))


def audit_rows(gateway, target_type: str | None = None) -> list[AuditEntry]:
    """The rows, oldest first; the model the server registers at its first start is left out."""
    query = select(AuditEntry).where(AuditEntry.actor_kind != "system").order_by(AuditEntry.id)
    if target_type is not None:
        query = query.where(AuditEntry.target_type == target_type)
    with gateway.sessions() as session:
        return list(session.scalars(query))


def everything_stored(rows: list[AuditEntry]) -> str:
    return json.dumps([[r.actor_id, r.actor_display, r.target_id, r.before, r.after] for r in rows])


def test_team_changes_are_recorded_with_who_and_before_and_after(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        team = create_team(client, "alpha", rpm_limit=60)
        client.patch(f"/admin/api/teams/{team['id']}", json={"rpm_limit": 120, "name": "beta"}, headers=admin_headers())
        client.delete(f"/admin/api/teams/{team['id']}", headers=admin_headers())
    created, updated, deleted = audit_rows(gateway)
    assert [created.action, updated.action, deleted.action] == ["team.create", "team.update", "team.delete"]
    assert {(r.target_type, r.target_id) for r in (created, updated, deleted)} == {("team", str(team["id"]))}
    assert (created.actor_kind, created.actor_id, created.actor_display) == (
        "admin_key",
        "env",
        visible_prefix(ADMIN_KEY),
    )
    assert created.before is None and created.after["name"] == "alpha" and created.after["rpm_limit"] == 60
    assert updated.before == {"rpm_limit": 60, "name": "alpha"}
    assert updated.after == {"rpm_limit": 120, "name": "beta"}
    assert deleted.before["deleted_at"] is None and deleted.after["deleted_at"] is not None


def test_key_create_update_revoke_are_recorded_without_the_secret(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        key = create_key(client, create_team(client)["id"], name="ci", tpm_limit=1000)
        client.patch(f"/admin/api/keys/{key['id']}", json={"max_budget_usd": 5.5}, headers=admin_headers())
        client.delete(f"/admin/api/keys/{key['id']}", headers=admin_headers())
    rows = audit_rows(gateway, "key")
    assert [r.action for r in rows] == ["key.create", "key.update", "key.revoke"]
    created, updated, revoked = rows
    assert created.after["name"] == "ci" and created.after["tpm_limit"] == 1000
    assert created.after["key_hash"] == REDACTED  # the field is named, its value never stored
    assert (updated.before, updated.after) == ({"max_budget_usd": None}, {"max_budget_usd": 5.5})
    assert revoked.before == {"revoked_at": None} and revoked.after["revoked_at"]
    stored = everything_stored(audit_rows(gateway))
    assert key["key"] not in stored and hash_key(key["key"]) not in stored
    assert ADMIN_KEY not in stored and hash_key(ADMIN_KEY) not in stored


def test_a_refused_change_leaves_no_row(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        create_team(client, "alpha")
        taken = client.post("/admin/api/teams", json={"name": "alpha"}, headers=admin_headers())
        assert taken.status_code == 409
        bad = client.patch("/admin/api/teams/999", json={"rpm_limit": 5}, headers=admin_headers())
        assert bad.status_code == 404
    assert [r.action for r in audit_rows(gateway)] == ["team.create"]


def test_a_change_without_a_difference_leaves_no_diff_noise(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        team = create_team(client, "alpha", rpm_limit=60)
        client.patch(f"/admin/api/teams/{team['id']}", json={"rpm_limit": 60, "tpm_limit": 9}, headers=admin_headers())
    updated = audit_rows(gateway)[-1]
    assert (updated.before, updated.after) == ({"tpm_limit": None}, {"tpm_limit": 9})


def test_the_audit_row_rolls_back_with_the_change(make_gateway):
    gateway = make_gateway()
    with gateway.sessions() as session:
        record_change(session, actor=ACTOR, action="team.create", target_type="team", target_id="1", after={"a": 1})
        session.rollback()
    assert audit_rows(gateway) == []


@pytest.mark.parametrize(
    "field", ["key_hash", "key", "plaintext", "client_secret", "oidc_client_secret", "previous_key_hash", "api_key"]
)
def test_secret_fields_are_redacted_at_any_depth(make_gateway, field):
    gateway = make_gateway()
    secret = "sk-this-must-never-be-stored"
    with gateway.sessions() as session:
        record_change(
            session,
            actor=ACTOR,
            action="settings.update",
            target_type="settings",
            target_id=None,
            before={field: secret, "nested": {field: secret, "fine": 1}},
            after={"list": [{field: secret}], "name": "kept"},
        )
        session.commit()
    (row,) = audit_rows(gateway)
    assert secret not in everything_stored([row])
    assert row.before == {field: REDACTED, "nested": {field: REDACTED, "fine": 1}}
    assert row.after == {"list": [{field: REDACTED}], "name": "kept"}
    assert (row.actor_kind, row.actor_id, row.actor_display) == ("sso", "subject-1", "ada@example.com")
