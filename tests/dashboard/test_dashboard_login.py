"""Dashboard login: the admin key buys a signed, HttpOnly, SameSite, expiring session cookie; every
page and data call needs it; every form carries a CSRF token; logout ends the session."""

from __future__ import annotations

import re

from fastapi.routing import APIRoute

from app.dashboard.sessions import LOGIN_COOKIE, SESSION_COOKIE, SessionSigner
from app.dashboard.wiring import ROUTERS
from tests.support.dashboard import ADMIN_KEY, login_token, page_csrf


def test_admin_redirects_to_the_login(dashboard):
    response = dashboard.client.get("/admin", follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"] == "/admin/login?next=%2Fadmin"


def test_login_form_has_the_admin_key_field_and_a_hidden_csrf_token(dashboard):
    html = dashboard.client.get("/admin/login").text
    assert re.search(r'<input type="password" name="admin_key"', html)
    assert re.search(r'<input type="hidden" name="csrf_token" value="[^"]+"', html)
    assert dashboard.client.cookies.get(LOGIN_COOKIE)


def test_every_dashboard_route_needs_a_session(dashboard):
    routes = [
        route
        for module in ROUTERS
        for route in module.router.routes
        # the ways in: the login form and single sign-on (tests/dashboard/test_dashboard_sso.py)
        if isinstance(route, APIRoute) and route.path != "/admin/login" and not route.path.startswith("/admin/sso/")
    ]
    assert len(routes) >= 15
    for route in routes:
        path = re.sub(r"\{[^}]+\}", "1", route.path)
        for method in route.methods:
            response = dashboard.client.request(method, path, follow_redirects=False)
            if path.startswith("/admin/data") or path == "/admin/playground/key":
                assert response.status_code == 401, (method, path)
            else:
                assert response.status_code == 303, (method, path)
                assert response.headers["location"].startswith("/admin/login?next="), (method, path)


def test_the_admin_key_buys_a_signed_httponly_samesite_cookie_that_expires(dashboard):
    page = dashboard.client.get("/admin/login")
    response = dashboard.client.post(
        "/admin/login",
        data={"admin_key": ADMIN_KEY, "csrf_token": login_token(page.text), "next": "/admin/usage"},
        follow_redirects=False,
    )
    assert response.status_code == 303 and response.headers["location"] == "/admin/usage"
    cookie = next(c for c in response.headers.get_list("set-cookie") if c.startswith(SESSION_COOKIE + "="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/admin" in cookie
    assert re.search(r"Max-Age=\d+", cookie)
    assert dashboard.client.get("/admin", follow_redirects=False).status_code == 200


def test_a_wrong_admin_key_is_refused(dashboard):
    page = dashboard.client.get("/admin/login")
    response = dashboard.client.post(
        "/admin/login",
        data={"admin_key": "sk-admin-nope", "csrf_token": login_token(page.text)},
        follow_redirects=False,
    )
    assert response.status_code == 401
    assert "not the admin key" in response.text
    assert SESSION_COOKIE not in dashboard.client.cookies


def test_a_team_key_is_not_the_admin_key(admin):
    key = admin.create_key(admin.create_team())
    admin.client.cookies.clear()
    page = admin.client.get("/admin/login")
    response = admin.client.post(
        "/admin/login", data={"admin_key": key, "csrf_token": login_token(page.text)}, follow_redirects=False
    )
    assert response.status_code == 401


def test_login_without_its_csrf_token_is_refused(dashboard):
    dashboard.client.get("/admin/login")
    response = dashboard.client.post(
        "/admin/login", data={"admin_key": ADMIN_KEY, "csrf_token": "forged"}, follow_redirects=False
    )
    assert response.status_code == 403
    assert SESSION_COOKIE not in dashboard.client.cookies


def test_forms_without_the_csrf_token_change_nothing(admin):
    response = admin.client.post("/admin/teams", data={"name": "sneaky"}, follow_redirects=False)
    assert response.status_code == 403
    response = admin.client.post(
        "/admin/teams", data={"name": "sneaky", "csrf_token": "x" * 43}, follow_redirects=False
    )
    assert response.status_code == 403
    assert "sneaky" not in admin.client.get("/admin/teams").text


def test_a_csrf_token_belongs_to_its_session(admin):
    old_token = admin.csrf
    admin.client.cookies.clear()
    admin.log_in()
    assert admin.csrf != old_token
    response = admin.client.post(
        "/admin/teams", data={"name": "replayed", "csrf_token": old_token}, follow_redirects=False
    )
    assert response.status_code == 403


def test_playground_key_needs_the_csrf_header(admin):
    assert admin.client.post("/admin/playground/key").status_code == 403
    assert admin.client.post("/admin/playground/key", headers={"x-csrf-token": admin.csrf}).status_code == 200


def test_a_tampered_cookie_is_no_session(admin):
    value = admin.client.cookies.get(SESSION_COOKIE)
    session_id, expires, signature = value.split(".")
    for forged in (
        f"{session_id}.{int(expires) + 3600}.{signature}",
        f"x{session_id}.{expires}.{signature}",
        f"{session_id}.{expires}.{signature[:-2]}AA",
        "garbage",
    ):
        admin.client.cookies.clear()
        admin.client.cookies.set(SESSION_COOKIE, forged, path="/admin")
        assert admin.client.get("/admin", follow_redirects=False).status_code == 303, forged
    admin.client.cookies.clear()
    admin.client.cookies.set(SESSION_COOKIE, value, path="/admin")
    assert admin.client.get("/admin", follow_redirects=False).status_code == 200


def test_sessions_expire():
    now = [1_000_000.0]
    signer = SessionSigner("secret", lifetime_s=60, clock=lambda: now[0])
    session, cookie = signer.issue()
    assert signer.read(cookie) == session
    now[0] += 61
    assert signer.read(cookie) is None


def test_a_session_from_another_secret_is_no_session():
    _, cookie = SessionSigner("one").issue()
    assert SessionSigner("two").read(cookie) is None


def test_logout_ends_the_session_even_for_a_copied_cookie(admin):
    cookie = admin.client.cookies.get(SESSION_COOKIE)
    response = admin.post("/admin/logout")
    assert response.status_code == 303 and response.headers["location"] == "/admin/login"
    admin.client.cookies.clear()
    admin.client.cookies.set(SESSION_COOKIE, cookie, path="/admin")
    assert admin.client.get("/admin", follow_redirects=False).status_code == 303


def test_next_never_leaves_the_dashboard(dashboard):
    for target in ("//evil.example/x", "https://evil.example", "/v1/models", "/admin/login"):
        page = dashboard.client.get("/admin/login")
        response = dashboard.client.post(
            "/admin/login",
            data={"admin_key": ADMIN_KEY, "next": target, "csrf_token": login_token(page.text)},
            follow_redirects=False,
        )
        assert response.headers["location"] == "/admin", target
        dashboard.client.cookies.clear()


def test_pages_forbid_third_party_code_framing_and_caching(admin):
    response = admin.client.get("/admin")
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert response.headers["cache-control"] == "no-store"
    assert page_csrf(response.text)


def test_the_admin_api_keeps_its_bearer_auth(admin):
    assert admin.client.get("/admin/api/teams").status_code == 401
    assert admin.client.get("/admin/api/teams", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200
