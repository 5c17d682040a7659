"""The audit log: every admin change through the admin API writes one row in the change's own
transaction, with who made it and the values before and after, and never a secret."""

from __future__ import annotations

import csv
import io
import json
import time
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.gateway.audit import REDACTED, Actor, record_change
from app.gateway.audit_log import AuditPruner
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


def test_an_update_records_only_what_it_changed(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        team = create_team(client, "alpha", rpm_limit=60)
        client.patch(f"/admin/api/teams/{team['id']}", json={"rpm_limit": 60, "tpm_limit": 9}, headers=admin_headers())
        client.patch(f"/admin/api/teams/{team['id']}", json={"rpm_limit": 60}, headers=admin_headers())
    created, updated = audit_rows(gateway)  # the second update changed nothing: no row
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


# reading it: GET /admin/api/audit


def audit_api(client, **params):
    response = client.get("/admin/api/audit", params=params, headers=admin_headers())
    assert response.status_code == 200, response.text
    return response.json()


def add_rows(gateway, *changes: dict) -> None:
    with gateway.sessions() as session:
        for change in changes:
            record_change(session, **{"target_id": None, **change})
        session.commit()


def test_the_api_filters_by_actor_action_target_and_time(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        team = create_team(client, "alpha")
        key = create_key(client, team["id"])
        client.patch(f"/admin/api/keys/{key['id']}", json={"rpm_limit": 5}, headers=admin_headers())
        add_rows(gateway, {"actor": ACTOR, "action": "settings.update", "target_type": "settings"})
        everything = audit_api(client)["data"]
        assert [e["action"] for e in everything[:4]] == ["settings.update", "key.update", "key.create", "team.create"]
        assert everything[0]["object"] == "audit_entry" and everything[0]["created_at"].endswith("Z")
        assert [e["action"] for e in audit_api(client, actor="ada@example.com")["data"]] == ["settings.update"]
        assert [e["action"] for e in audit_api(client, actor="subject-1")["data"]] == ["settings.update"]
        assert [e["action"] for e in audit_api(client, action="key.")["data"]] == ["key.update", "key.create"]
        assert [e["action"] for e in audit_api(client, action="key.update")["data"]] == ["key.update"]
        by_target = audit_api(client, target_type="team", target_id=str(team["id"]))["data"]
        assert [e["action"] for e in by_target] == ["team.create"]
        assert audit_api(client, since="2999-01-01")["data"] == []
        assert len(audit_api(client, until="2999-01-01T00:00:00Z")["data"]) == len(everything)
        assert audit_api(client, until="2000-01-01")["data"] == []


def test_pages_are_newest_first_with_after_the_last_id_seen(make_gateway):
    gateway = make_gateway()
    add_rows(gateway, *({"actor": ACTOR, "action": "team.update", "target_type": "team"} for _ in range(5)))
    with client_for(gateway) as client:
        first = audit_api(client, actor="subject-1", limit=2)
        second = audit_api(client, actor="subject-1", limit=2, after=first["last_id"])
        third = audit_api(client, actor="subject-1", limit=2, after=second["last_id"])
    ids = [e["id"] for page in (first, second, third) for e in page["data"]]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == 5
    assert (first["has_more"], second["has_more"], third["has_more"]) == (True, True, False)


def test_csv_by_format_or_accept_header_with_formulas_made_inert(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        create_team(client, "=HYPERLINK(1)")
        by_format = client.get("/admin/api/audit", params={"format": "csv"}, headers=admin_headers())
        by_accept = client.get("/admin/api/audit", headers={**admin_headers(), "accept": "text/csv"})
        filtered = client.get(
            "/admin/api/audit", params={"format": "csv", "action": "nothing.like.this"}, headers=admin_headers()
        )
    for response in (by_format, by_accept):
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/csv")
        assert "attachment" in response.headers["content-disposition"]
    rows = list(csv.reader(io.StringIO(by_format.text)))
    assert rows[0] == ["id", "created_at", "actor_kind", "actor_id", "actor_display", "action"] + [
        "target_type",
        "target_id",
        "before",
        "after",
    ]
    created = next(row for row in rows if row[5] == "team.create")
    assert json.loads(created[9])["name"] == "=HYPERLINK(1)"  # a JSON cell starts with "{": left alone
    assert by_accept.text == by_format.text
    assert filtered.text.strip().splitlines() == [",".join(rows[0])]


def test_csv_cells_a_spreadsheet_would_run_are_text(make_gateway):
    gateway = make_gateway()
    add_rows(gateway, {"actor": Actor("sso", "=cmd|' /C calc'!A0"), "action": "team.update", "target_type": "team"})
    with client_for(gateway) as client:
        text = client.get("/admin/api/audit", params={"format": "csv"}, headers=admin_headers()).text
    (row,) = [r for r in csv.reader(io.StringIO(text)) if r[2] == "sso"]
    assert row[3] == "'=cmd|' /C calc'!A0"


def test_bad_filters_are_openai_shaped_400s_and_the_log_needs_the_admin_key(make_gateway):
    gateway = make_gateway()
    with client_for(gateway) as client:
        bad = client.get("/admin/api/audit", params={"since": "yesterday"}, headers=admin_headers())
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert client.get("/admin/api/audit", params={"limit": 0}, headers=admin_headers()).status_code == 400
        key = create_key(client, create_team(client)["id"])
        refused = client.get("/admin/api/audit", headers={"Authorization": f"Bearer {key['key']}"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_the_prune_removes_rows_older_than_the_retention(make_gateway):
    gateway = make_gateway()
    add_rows(gateway, *({"actor": ACTOR, "action": f"team.{n}", "target_type": "team"} for n in ("old", "new")))
    with gateway.sessions() as session, session.begin():
        old = session.scalar(select(AuditEntry).where(AuditEntry.action == "team.old"))
        old.created_at -= timedelta(days=400)
    assert AuditPruner(gateway.sessions, retention_days=365).prune_now() == 1
    assert [r.action for r in audit_rows(gateway)] == ["team.new"]
    assert AuditPruner(gateway.sessions, retention_days=365).prune_now() == 0


def test_the_server_prunes_at_start_by_the_retention_setting(make_gateway):
    gateway = make_gateway()
    add_rows(gateway, {"actor": ACTOR, "action": "team.old", "target_type": "team"})
    with gateway.sessions() as session, session.begin():
        session.scalar(select(AuditEntry)).created_at -= timedelta(days=3)
    with TestClient(build_app(gateway, audit_retention_days=2)):
        deadline = time.monotonic() + 10
        while audit_rows(gateway) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert audit_rows(gateway) == []
