"""The dashboard's side of the audit log and key rotation: its forms record who changed what (logins and
failed logins too), the Audit page filters and downloads the log, and the Rotate button shows the new
secret once while the old one keeps working for the grace chosen."""

from __future__ import annotations

import csv
import io

from sqlalchemy import select

from app.gateway.keys import visible_prefix
from app.tables import AuditEntry
from tests.support.dashboard import chat, login_token, shown_key
from tests.support.gateway import ADMIN_KEY


def audit_rows(gateway, action: str | None = None) -> list[AuditEntry]:
    query = select(AuditEntry).where(AuditEntry.actor_kind != "system").order_by(AuditEntry.id)
    if action is not None:
        query = query.where(AuditEntry.action == action)
    with gateway.sessions() as session:
        return list(session.scalars(query))


def test_logins_failed_logins_and_logouts_are_recorded(dashboard):
    page = dashboard.client.get("/admin/login")
    refused = dashboard.client.post(
        "/admin/login", data={"admin_key": "sk-admin-wrong", "csrf_token": login_token(page.text), "next": "/admin"}
    )
    assert refused.status_code == 401
    dashboard.log_in()
    dashboard.post("/admin/logout")
    failed, login, logout = audit_rows(dashboard.gateway)
    assert [failed.action, login.action, logout.action] == ["session.login_failed", "session.login", "session.logout"]
    assert (login.actor_kind, login.actor_id, login.actor_display) == ("admin_key", "env", visible_prefix(ADMIN_KEY))
    assert failed.actor_id == "unknown" and failed.after["address"] == login.after["address"]
    assert "sk-admin-wrong" not in repr([failed.before, failed.after, failed.actor_display])


def test_dashboard_changes_are_recorded_once_each_as_the_admin(admin):
    team_id = admin.create_team("alpha", rpm_limit="60")
    admin.post(f"/admin/teams/{team_id}", name="alpha", rpm_limit="90", budget_period="month")
    admin.create_key(team_id, name="ci")
    actions = [row.action for row in audit_rows(admin.gateway) if row.target_type != "session"]
    assert actions == ["team.create", "team.update", "key.create"]
    update = audit_rows(admin.gateway, "team.update")[0]
    assert update.before == {"rpm_limit": 60} and update.after == {"rpm_limit": 90}
    assert update.actor_id == "env"


def test_the_audit_page_filters_and_links_its_csv(admin):
    team_id = admin.create_team("alpha")
    admin.create_key(team_id, name="ci")
    page = admin.client.get("/admin/audit")
    assert page.status_code == 200 and "team.create" in page.text and "key.create" in page.text
    assert 'href="/admin/audit"' in page.text  # the nav's tab
    only_keys = admin.client.get("/admin/audit", params={"action": "key."})
    assert "key.create" in only_keys.text and "team.create" not in only_keys.text
    assert 'href="/admin/audit.csv?action=key."' in only_keys.text
    download = admin.client.get("/admin/audit.csv", params={"action": "key."})
    assert download.status_code == 200 and download.headers["content-type"].startswith("text/csv")
    rows = list(csv.reader(io.StringIO(download.text)))
    assert [row[5] for row in rows[1:]] == ["key.create"]
    nothing = admin.client.get("/admin/audit", params={"since": "2999-01-01", "until": "not a day"})
    assert nothing.status_code == 200 and "No changes match." in nothing.text


def test_the_audit_page_needs_a_login(dashboard):
    page = dashboard.client.get("/admin/audit", follow_redirects=False)
    assert page.status_code == 303 and page.headers["location"].startswith("/admin/login")
    download = dashboard.client.get("/admin/audit.csv", follow_redirects=False)
    assert download.status_code == 303


def test_rotate_shows_the_new_secret_once_and_the_old_works_for_the_grace(admin):
    team_id = admin.create_team()
    old = admin.create_key(team_id)
    key_id = audit_rows(admin.gateway, "key.create")[0].target_id
    for listing in ("/admin/keys", f"/admin/teams/{team_id}", f"/admin/keys/{key_id}"):
        assert f'action="/admin/keys/{key_id}/rotate"' in admin.client.get(listing).text
    rotated = admin.post(f"/admin/keys/{key_id}/rotate", grace="1h")
    assert rotated.status_code == 200 and rotated.headers["cache-control"] == "no-store"
    new = shown_key(rotated.text)
    assert new.startswith("sk-") and new != old and old[:11] in rotated.text and old not in rotated.text
    assert new not in admin.client.get(f"/admin/keys/{key_id}").text
    assert chat(admin.client, old).status_code == 200
    assert chat(admin.client, new).status_code == 200
    (row,) = audit_rows(admin.gateway, "key.rotate")
    assert row.after["key_prefix"] == new[:11] and row.actor_id == "env"


def test_rotate_with_no_grace_ends_the_old_secret_and_bad_input_is_refused(admin):
    team_id = admin.create_team()
    old = admin.create_key(team_id)
    key_id = audit_rows(admin.gateway, "key.create")[0].target_id
    for bad in ("-5", "soon", "31d", "nan"):
        refused = admin.post(f"/admin/keys/{key_id}/rotate", grace=bad)
        assert refused.status_code == 400 and "grace period" in refused.text
    assert chat(admin.client, old).status_code == 200
    rotated = admin.post(f"/admin/keys/{key_id}/rotate", grace="0")
    assert chat(admin.client, old).status_code == 401
    assert chat(admin.client, shown_key(rotated.text)).status_code == 200
    admin.post(f"/admin/keys/{key_id}/revoke")
    again = admin.post(f"/admin/keys/{key_id}/rotate", grace="0")
    assert again.status_code == 409 and "revoked" in again.text


def test_a_failed_login_is_still_refused_when_its_row_cannot_be_written(dashboard):
    with dashboard.gateway.engine.begin() as connection:
        connection.exec_driver_sql("DROP TABLE audit_log")  # every write to the log now fails
    page = dashboard.client.get("/admin/login")
    refused = dashboard.client.post(
        "/admin/login", data={"admin_key": "sk-admin-wrong", "csrf_token": login_token(page.text), "next": "/admin"}
    )
    assert refused.status_code == 401 and "That is not the admin key." in refused.text
