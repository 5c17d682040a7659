"""Single sign-on against a real OpenID Connect provider (oidc-provider-mock, started here): the code
flow with PKCE and a nonce, roles by email domain and by group claim, refusals (another audience, an
expired token, a domain not allowed, a forged state), logout; and roles enforced server-side: a
viewer's every change is refused, a team member sees and changes only their own team."""

from __future__ import annotations

import re
import time
from urllib.parse import parse_qs, urlparse

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from app.dashboard.sessions import SESSION_COOKIE
from app.dashboard.sso_routes import SSO_COOKIE
from app.dashboard.wiring import ROUTERS
from app.settings import Settings, SettingsError
from tests.support.dashboard import ADMIN_KEY, BASE_URL, DashboardClient, make_dashboard_gateway, page_csrf
from tests.support.gateway import FakeEngine, build_app, free_port
from tests.support.oidc import ADMIN_GROUP, ML_GROUP, path_of, running_provider, sso_log_in, sso_settings

CALLBACK = BASE_URL + "/admin/sso/callback"


@pytest.fixture(scope="module")
def provider():
    with running_provider() as provider:
        yield provider


def sso_dashboard(tmp_path, provider, **overrides):
    gateway = make_dashboard_gateway(tmp_path)
    return gateway, build_app(gateway, FakeEngine(), **sso_settings(provider, CALLBACK, **overrides))


@pytest.fixture
def dashboard(tmp_path, provider):
    gateway, app = sso_dashboard(tmp_path, provider)
    with TestClient(app, base_url=BASE_URL) as client:
        yield DashboardClient(client, gateway, app)


def alert(response) -> str:
    match = re.search(r'role="alert">([^<]*)<', response.text)
    return match.group(1).replace("&#39;", "'") if match else ""


def signed_in(dashboard) -> bool:
    return dashboard.client.get("/admin/usage", follow_redirects=False).status_code == 200


def new_team_with_key(dashboard, name: str) -> tuple[int, int]:
    """As the admin key: a team and one key of it; their ids."""
    admin = DashboardClient(TestClient(dashboard.app, base_url=BASE_URL), dashboard.gateway, dashboard.app)
    admin.log_in(ADMIN_KEY)
    team_id = admin.create_team(name)
    admin.create_key(team_id, name=f"{name}-key")
    with dashboard.gateway.sessions() as db:
        from app.gateway import crud

        [key] = crud.list_keys(db, team_id=team_id)
    return team_id, key.id


# ---- the flow ----


def test_login_page_offers_sso_when_configured_and_the_admin_key_stays(dashboard):
    html = dashboard.client.get("/admin/login").text
    assert 'href="/admin/sso/login?next=/admin"' in html and "Sign in with SSO" in html
    assert 'name="admin_key"' in html  # break-glass
    dashboard.log_in(ADMIN_KEY)
    assert signed_in(dashboard)


def test_the_redirect_carries_state_nonce_and_an_s256_pkce_challenge(dashboard, provider):
    start = dashboard.client.get("/admin/sso/login", follow_redirects=False)
    assert start.status_code == 302
    url = urlparse(start.headers["location"])
    query = {name: values[0] for name, values in parse_qs(url.query).items()}
    assert f"{url.scheme}://{url.netloc}" == provider.issuer
    assert query["response_type"] == "code" and query["redirect_uri"] == CALLBACK
    assert query["code_challenge_method"] == "S256" and len(query["code_challenge"]) == 43
    assert query["state"] and query["nonce"] and "openid" in query["scope"].split()
    cookie = next(c for c in start.headers.get_list("set-cookie") if c.startswith(SSO_COOKIE + "="))
    assert "HttpOnly" in cookie and "SameSite=lax" in cookie and "Path=/admin/sso" in cookie


def test_an_admin_by_group_signs_in_and_can_change_things(dashboard, provider):
    provider.set_user("alice-sub", email="alice@partner.test", groups=[ADMIN_GROUP])
    response = sso_log_in(dashboard, provider, "alice-sub", next_path="/admin/teams")
    assert response.status_code == 200 and 'data-signed-in="admin"' in response.text
    cookie = next(c for c in response.headers.get_list("set-cookie") if c.startswith(SESSION_COOKIE + "="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert 'content="0;url=/admin/teams"' in response.text
    assert "alice@partner.test" in dashboard.client.get("/admin").text
    assert dashboard.create_team("made-by-sso") > 0


def test_roles_by_domain(dashboard, provider):
    provider.set_user("carol-sub", email="carol@ops.example.com")
    assert 'data-signed-in="admin"' in sso_log_in(dashboard, provider, "carol-sub").text
    provider.set_user("bob-sub", email="bob@example.com")
    assert 'data-signed-in="viewer"' in sso_log_in(dashboard, provider, "bob-sub").text


def test_a_group_outranks_the_domain_role(dashboard, provider):
    provider.set_user("dana-sub", email="dana@example.com", groups=["unrelated", ADMIN_GROUP])
    assert 'data-signed-in="admin"' in sso_log_in(dashboard, provider, "dana-sub").text


def test_a_domain_not_allowed_is_refused(dashboard, provider):
    provider.set_user("eve-sub", email="eve@evil.test", groups=[ADMIN_GROUP])
    response = sso_log_in(dashboard, provider, "eve-sub")
    assert response.status_code == 403 and "domain not allowed" in alert(response)
    assert not signed_in(dashboard)


def test_an_allowed_domain_without_a_role_is_refused(dashboard, provider):
    provider.set_user("pat-sub", email="pat@partner.test", groups=["unrelated"])
    response = sso_log_in(dashboard, provider, "pat-sub")
    assert response.status_code == 403 and "no role" in alert(response)
    assert not signed_in(dashboard)


def test_an_unverified_email_is_refused(dashboard, provider):
    provider.set_user("ursula-sub", email="ursula@ops.example.com", email_verified=False)
    response = sso_log_in(dashboard, provider, "ursula-sub")
    assert response.status_code == 403 and "not verified" in alert(response)


def test_an_id_token_for_another_audience_is_refused(dashboard, provider):
    provider.set_user("mallory-sub", email="mallory@ops.example.com", aud="another-app")
    response = sso_log_in(dashboard, provider, "mallory-sub")
    assert response.status_code == 401 and "aud" in alert(response)
    assert not signed_in(dashboard)


def test_another_audience_is_refused_even_when_azp_names_us(dashboard, provider):
    """Authlib's own ID token check lets this one through (azp == our client id); ours must not."""
    client_id = dashboard.app.state.context.settings.oidc_client_id
    provider.set_user("trudy-sub", email="trudy@ops.example.com", aud=["another-app"], azp=client_id)
    response = sso_log_in(dashboard, provider, "trudy-sub")
    assert response.status_code == 401 and "aud" in alert(response)
    assert not signed_in(dashboard)


def test_an_expired_id_token_is_refused(dashboard, provider):
    provider.set_user("old-sub", email="old@ops.example.com", exp=int(time.time()) - 3600)
    response = sso_log_in(dashboard, provider, "old-sub")
    assert response.status_code == 401 and "expired" in alert(response)
    assert not signed_in(dashboard)


def test_denying_at_the_provider_comes_back_as_a_refusal(dashboard, provider):
    start = dashboard.client.get("/admin/sso/login", follow_redirects=False)
    denied = provider.http.post(start.headers["location"], data={"action": "deny"})
    assert denied.status_code == 302 and "error=access_denied" in denied.headers["location"]
    response = dashboard.client.get(path_of(denied.headers["location"]), follow_redirects=False)
    assert response.status_code == 401 and "denied the request" in alert(response)
    assert not signed_in(dashboard)


def test_a_forged_state_is_refused(dashboard, provider):
    provider.set_user("carol-sub", email="carol@ops.example.com")
    start = dashboard.client.get("/admin/sso/login", follow_redirects=False)
    callback = provider.authorize(start.headers["location"], "carol-sub")
    forged = re.sub(r"state=[^&]+", "state=forged", path_of(callback))
    response = dashboard.client.get(forged, follow_redirects=False)
    assert response.status_code == 401 and "state" in alert(response).lower()
    assert not signed_in(dashboard)


def test_a_callback_in_another_browser_is_refused(dashboard, provider):
    """Login CSRF: a code obtained by someone else, replayed into this browser, finds no sign-in here."""
    provider.set_user("carol-sub", email="carol@ops.example.com")
    start = dashboard.client.get("/admin/sso/login", follow_redirects=False)
    callback = provider.authorize(start.headers["location"], "carol-sub")
    victim = TestClient(dashboard.app, base_url=BASE_URL)  # the app is already started: no lifespan again
    response = victim.get(path_of(callback), follow_redirects=False)
    assert response.status_code == 400 and "did not start here" in response.text
    assert victim.get("/admin", follow_redirects=False).status_code == 303


def test_after_sign_in_the_next_page_is_never_a_login_again(dashboard, provider):
    provider.set_user("carol-sub", email="carol@ops.example.com")
    response = sso_log_in(dashboard, provider, "carol-sub", next_path="/admin/sso/login")
    assert 'content="0;url=/admin"' in response.text  # not back to the provider in a loop


def test_a_code_is_good_once(dashboard, provider):
    provider.set_user("carol-sub", email="carol@ops.example.com")
    start = dashboard.client.get("/admin/sso/login", follow_redirects=False)
    callback = path_of(provider.authorize(start.headers["location"], "carol-sub"))
    assert dashboard.client.get(callback, follow_redirects=False).status_code == 200
    assert dashboard.client.get(callback, follow_redirects=False).status_code == 400  # the sign-in is spent


def test_logout_ends_an_sso_session(dashboard, provider):
    provider.set_user("bob-sub", email="bob@example.com")
    sso_log_in(dashboard, provider, "bob-sub")
    assert signed_in(dashboard)
    cookie = dashboard.client.cookies.get(SESSION_COOKIE)
    response = dashboard.post("/admin/logout")
    assert response.status_code == 303 and response.headers["location"] == "/admin/login"
    assert not signed_in(dashboard)
    dashboard.client.cookies.set(SESSION_COOKIE, cookie, path="/admin")  # the old cookie is dead too
    assert not signed_in(dashboard)


def test_an_unreachable_provider_is_a_502_on_the_login_page(tmp_path, provider):
    gateway = make_dashboard_gateway(tmp_path)
    app = build_app(
        gateway,
        FakeEngine(),
        oidc_issuer=f"http://127.0.0.1:{free_port()}",
        oidc_client_id="tokenmill",
        oidc_allowed_domains="example.com=viewer",
    )
    with TestClient(app, base_url=BASE_URL) as client:
        response = client.get("/admin/sso/login")
        assert response.status_code == 502 and "did not answer" in response.text
        assert 'name="admin_key"' in response.text


def test_without_sso_settings_there_is_no_sso(tmp_path):
    gateway = make_dashboard_gateway(tmp_path)
    with TestClient(build_app(gateway, FakeEngine()), base_url=BASE_URL) as client:
        assert "Sign in with SSO" not in client.get("/admin/login").text
        assert client.get("/admin/sso/login").status_code == 404
        assert client.get("/admin/sso/callback?code=x&state=y").status_code == 400


@pytest.mark.parametrize(
    "fields, complaint",
    [
        ({"oidc_client_id": ""}, "oidc_client_id"),
        ({"oidc_allowed_domains": "example.com"}, "grants no role"),
        ({"oidc_group_claim": "groups", "oidc_group_roles": "admins=owner"}, "not a role"),
        ({"oidc_group_claim": "groups", "oidc_group_roles": "admins"}, "needs a role"),
        ({"oidc_group_roles": "admins=admin"}, "needs oidc_group_claim"),
        ({"oidc_issuer": "accounts.example.com"}, "http(s) URL"),
        ({"oidc_scopes": "email"}, "openid"),
    ],
)
def test_bad_sso_settings_are_refused_at_start(fields, complaint):
    assert Settings(oidc_issuer="https://id.example.com", oidc_client_id="t", oidc_allowed_domains="a.com=admin").sso
    values = {
        "oidc_issuer": "https://id.example.com",
        "oidc_client_id": "tokenmill",
        "oidc_allowed_domains": "example.com=viewer",
        **fields,
    }
    with pytest.raises(SettingsError, match=re.escape(complaint)):
        Settings(**values)


# ---- roles, server-side ----


def mutation_routes() -> list[tuple[str, str]]:
    """Every POST of the dashboard, path parameters filled in, but the ways in and out."""
    routes = []
    for module in ROUTERS:
        for route in module.router.routes:
            if isinstance(route, APIRoute) and "POST" in route.methods:
                if route.path in ("/admin/login", "/admin/logout") or route.path.startswith("/admin/sso/"):
                    continue
                routes.append(("POST", re.sub(r"\{[^}]+\}", "1", route.path)))
    return routes


def test_a_viewer_changes_nothing_whatever_it_posts(dashboard, provider):
    team_id, key_id = new_team_with_key(dashboard, "alpha")
    provider.set_user("bob-sub", email="bob@example.com")
    sso_log_in(dashboard, provider, "bob-sub")
    routes = mutation_routes() + [("POST", f"/admin/keys/{key_id}/revoke"), ("POST", f"/admin/teams/{team_id}")]
    assert len(routes) >= 8
    for method, path in routes:
        fields = {"csrf_token": dashboard.csrf, "team_id": str(team_id), "name": "x", "budget_period": "month"}
        response = dashboard.client.request(method, path, data=fields, follow_redirects=False)
        assert response.status_code == 403, (path, response.status_code)
    call = dashboard.client.post("/admin/playground/key", headers={"x-csrf-token": dashboard.csrf})
    assert call.status_code == 403 and call.json()["error"]["code"] == "insufficient_role"
    with dashboard.gateway.sessions() as db:
        from app.gateway import crud

        [key] = crud.list_keys(db, team_id=team_id)
        assert key.revoked_at is None and len(crud.list_teams(db)) == 1  # nothing changed
    for page in ("/admin", "/admin/teams", f"/admin/teams/{team_id}", "/admin/keys", "/admin/usage", "/admin/models"):
        assert dashboard.client.get(page).status_code == 200, page
    assert 'id="create-team"' not in dashboard.client.get("/admin/teams").text  # and the buttons are gone


def test_a_team_member_sees_and_manages_only_their_team(dashboard, provider):
    ml_id, ml_key = new_team_with_key(dashboard, "ml")
    other_id, other_key = new_team_with_key(dashboard, "finance")
    provider.set_user("tom-sub", email="tom@partner.test", groups=[ML_GROUP])
    response = sso_log_in(dashboard, provider, "tom-sub")
    assert 'data-signed-in="team"' in response.text and f"url=/admin/teams/{ml_id}" in response.text
    client = dashboard.client

    assert client.get("/admin", follow_redirects=False).headers["location"] == f"/admin/teams/{ml_id}"
    assert client.get(f"/admin/teams/{ml_id}").status_code == 200
    assert "finance" not in client.get(f"/admin/teams/{other_id}").text
    assert client.get(f"/admin/teams/{other_id}").status_code == 404
    assert client.get(f"/admin/keys/{other_key}").status_code == 404
    for page in ("/admin/teams", "/admin/models", "/admin/playground"):
        assert client.get(page).status_code == 403, page
    assert client.get("/admin/data/live").status_code == 403
    listed = client.get(f"/admin/keys?team_id={other_id}").text
    assert "finance-key" not in listed and "ml-key" in listed

    assert dashboard.post("/admin/keys", team_id=str(other_id), name="sneaky").status_code == 404
    assert dashboard.post(f"/admin/keys/{other_key}/revoke").status_code == 404
    assert dashboard.post(f"/admin/teams/{ml_id}", name="ml", rpm_limit="100000").status_code == 403  # limits: admin
    assert dashboard.post(f"/admin/teams/{ml_id}/delete").status_code == 403
    created = dashboard.post("/admin/keys", team_id=str(ml_id), name="mine", budget_period="month")
    assert created.status_code == 200 and "data-new-key>" in created.text
    assert dashboard.post(f"/admin/keys/{other_key}/rotate", grace="1h").status_code == 404
    rotated = dashboard.post(f"/admin/keys/{ml_key}/rotate", grace="1h")
    assert rotated.status_code == 200 and "data-new-key>" in rotated.text  # their own key: the new secret, once
    assert dashboard.post(f"/admin/keys/{ml_key}/revoke").status_code == 303
    with dashboard.gateway.sessions() as db:
        from app.gateway import crud

        assert crud.get_key(db, key_id=other_key).rotated_at is None
        assert crud.get_key(db, key_id=ml_key).rotated_at is not None
        assert crud.get_key(db, key_id=other_key).revoked_at is None
        assert crud.get_key(db, key_id=ml_key).revoked_at is not None
        assert [key.name for key in crud.list_keys(db, team_id=other_id)] == ["finance-key"]


def test_a_team_member_reads_only_their_teams_usage(dashboard, provider):
    from tests.support.dashboard import chat

    ml_id, _ = new_team_with_key(dashboard, "ml")
    other_id, _ = new_team_with_key(dashboard, "finance")
    admin = DashboardClient(TestClient(dashboard.app, base_url=BASE_URL), dashboard.gateway, dashboard.app)
    admin.log_in(ADMIN_KEY)
    for team_id in (ml_id, other_id):
        assert chat(dashboard.client, admin.create_key(team_id, name="caller")).status_code == 200
    assert dashboard.gateway.writer.flush(10)
    provider.set_user("tom-sub", email="tom@partner.test", groups=[ML_GROUP])
    sso_log_in(dashboard, provider, "tom-sub")

    page = dashboard.client.get(f"/admin/usage?team_id={other_id}&group=team").text
    assert "finance" not in page and ">ml<" in page
    csv = dashboard.client.get(f"/admin/usage.csv?team_id={other_id}&group=team").text
    assert "finance" not in csv and "ml" in csv
    chart = dashboard.client.get(f"/admin/data/usage?team_id={other_id}").json()
    assert sum(chart["requests"]) == 1  # its own request, not the other team's


def test_a_team_role_for_a_missing_team_is_refused(dashboard, provider):
    provider.set_user("tom-sub", email="tom@partner.test", groups=[ML_GROUP])
    response = sso_log_in(dashboard, provider, "tom-sub")
    assert response.status_code == 403 and "no such team" in alert(response)


def test_the_role_is_read_from_the_database_not_the_cookie(dashboard, provider):
    """Demoting a session in the database (what a later sign-in with fewer groups amounts to) takes
    effect on its next request."""
    from sqlalchemy import update

    from app.tables import AdminSession as AdminSessionRow

    provider.set_user("carol-sub", email="carol@ops.example.com")
    sso_log_in(dashboard, provider, "carol-sub")
    assert dashboard.create_team("before") > 0
    with dashboard.gateway.sessions() as db:
        db.execute(update(AdminSessionRow).values(role="viewer"))
        db.commit()
    assert dashboard.post("/admin/teams", name="after", budget_period="month").status_code == 403
    assert page_csrf(dashboard.client.get("/admin").text) == dashboard.csrf


def test_the_readme_example_config_is_valid():
    """The README's SSO example, exactly as written there, parses into the roles it describes."""
    from pathlib import Path

    from app.settings import settings_from

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## SSO", 1)[1].split("\n## ", 1)[0]
    env = {}
    for name, value in re.findall(r"export (TOKENMILL_\w+)=(\"[^\"]*\"|\S+)", section):
        env[name] = value.strip('"')
    assert env["TOKENMILL_OIDC_ISSUER"].startswith("https://")
    sso = settings_from({}, env).sso
    assert sso is not None and sso.client_secret == "..."
    assert sso.domains == {"acme.com": "viewer", "contractor.io": None}
    assert sso.group_roles["tokenmill-admins"] == "admin" and sso.group_roles["ml-platform"] == "team:ml"
    assert sso.discovery_url == "https://id.example.com/realms/acme/.well-known/openid-configuration"


# ---- the audit log ----


def audit_rows(dashboard) -> list:
    from sqlalchemy import select

    from app.tables import AuditEntry

    with dashboard.gateway.sessions() as db:
        return list(db.scalars(select(AuditEntry).order_by(AuditEntry.id)))


def test_sso_logins_changes_and_logouts_are_audited_under_the_subject(dashboard, provider):
    provider.set_user("alice-sub", email="alice@partner.test", groups=[ADMIN_GROUP])
    sso_log_in(dashboard, provider, "alice-sub")
    team_id = dashboard.create_team("audited")
    dashboard.post("/admin/logout")

    rows = [row for row in audit_rows(dashboard) if row.actor_kind == "sso"]
    assert [row.action for row in rows] == ["session.login", "team.create", "session.logout"]
    assert {(row.actor_id, row.actor_display) for row in rows} == {("alice-sub", "alice@partner.test")}
    assert rows[0].after["role"] == "admin" and rows[1].target_id == str(team_id)


def test_a_refused_sso_sign_in_is_audited_with_the_reason(dashboard, provider):
    provider.set_user("eve-sub", email="eve@evil.test")
    sso_log_in(dashboard, provider, "eve-sub")
    provider.set_user("mallory-sub", email="mallory@ops.example.com", aud="another-app")
    sso_log_in(dashboard, provider, "mallory-sub")

    failed = [row for row in audit_rows(dashboard) if row.action == "session.login_failed"]
    assert [(row.actor_kind, row.actor_id, row.actor_display) for row in failed][0] == (
        "sso",
        "eve-sub",
        "eve@evil.test",
    )
    assert "domain not allowed" in failed[0].after["reason"]
    # an ID token that failed its checks names nobody: its claims are not believed
    assert failed[1].actor_id == "unknown" and "aud" in failed[1].after["reason"]
    assert not any(row.action == "session.login" for row in audit_rows(dashboard))


def test_a_team_members_key_is_audited_under_them(dashboard, provider):
    ml_id, _ = new_team_with_key(dashboard, "ml")
    provider.set_user("tom-sub", email="tom@partner.test", groups=[ML_GROUP])
    sso_log_in(dashboard, provider, "tom-sub")
    assert dashboard.post("/admin/keys", team_id=str(ml_id), name="mine", budget_period="month").status_code == 200
    [created] = [row for row in audit_rows(dashboard) if row.action == "key.create" and row.actor_kind == "sso"]
    assert created.actor_display == "tom@partner.test" and created.after["name"] == "mine"
    assert "key_hash" not in created.after or created.after["key_hash"] == "[redacted]"
