"""Single sign-on in a real headless Chromium (Playwright) against a real server and a real OpenID
Connect provider (oidc-provider-mock), both on localhost: an admin signs in through the provider's page
and changes things; a viewer sees the pages but every change it posts is refused by the server (the
buttons being hidden is not what stops it); a team member sees only their own team. Screenshots go to
TOKENMILL_SCREENSHOT_DIR (else the test's tmp folder), as in test_dashboard_browser.py.

The fake engine serves: these flows are about the dashboard, not the model. Skips when Chromium or
Playwright is missing, unless CI is set: then they are required."""

from __future__ import annotations

import re
from urllib.parse import urlparse

import pytest

from app.gateway import admin, crud
from app.gateway.audit import SYSTEM
from app.gateway.schemas import KeyCreate, TeamCreate
from tests.dashboard.test_dashboard_browser import browser, playwright_api, screenshot  # noqa: F401 (fixtures)
from tests.support.dashboard import make_dashboard_gateway
from tests.support.gateway import FakeEngine, build_app, free_port, serve_in_thread
from tests.support.oidc import ADMIN_GROUP, ML_GROUP, running_provider, sso_settings

TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def provider(browser):  # noqa: F811 - the fixture imported above
    with running_provider() as provider:
        yield provider


@pytest.fixture(scope="module")
def server(provider, tmp_path_factory):
    """The app on a port picked first: the provider must know its callback URL before the app starts."""
    port = free_port()
    gateway = make_dashboard_gateway(tmp_path_factory.mktemp("sso-browser-db"))
    settings = sso_settings(provider, f"http://127.0.0.1:{port}/admin/sso/callback")
    app = build_app(gateway, FakeEngine(), **settings)
    with serve_in_thread(app, port=port) as url:
        yield url, gateway


@pytest.fixture
def visit(browser, server, provider):  # noqa: F811
    url, gateway = server
    context = browser.new_context(base_url=url, viewport={"width": 1280, "height": 900})
    outside: list[str] = []
    local = {urlparse(url).netloc, urlparse(provider.issuer).netloc}

    def only_local(route) -> None:  # the provider's page links a CDN stylesheet; nothing leaves this machine
        outside.append(route.request.url)
        route.abort()

    context.route(lambda target: urlparse(target).netloc not in local and target.startswith("http"), only_local)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.on("dialog", lambda dialog: dialog.accept())
    yield page, gateway
    context.close()
    assert all(urlparse(target).netloc == "cdn.jsdelivr.net" for target in outside), outside


def sign_in_through_the_provider(page, provider, sub: str, **claims) -> None:
    provider.set_user(sub, **claims)
    page.goto("/admin")
    assert urlparse(page.url).path == "/admin/login"
    page.click("#sso-login")
    page.wait_for_url(f"{provider.issuer}/oauth2/authorize*")
    page.fill("input[name=sub]", sub)
    page.click("button:has-text('Authorize')")
    # the callback's page refreshes to the dashboard, where the SameSite=Strict session cookie is sent
    page.wait_for_url(re.compile(r"/admin(/teams/\d+)?$"))


def make_team(gateway, name: str) -> int:
    with gateway.sessions() as db:
        team = admin.create_team(TeamCreate(name=name), db, actor=SYSTEM)  # set up by "someone else"
        admin.create_key(KeyCreate(team_id=team.id, name=f"{name}-key"), db, actor=SYSTEM)
    return team.id


def test_an_admin_signs_in_with_sso_changes_things_and_logs_out(visit, provider, tmp_path):
    page, gateway = visit
    sign_in_through_the_provider(page, provider, "alice-sub", email="alice@partner.test", groups=[ADMIN_GROUP])
    assert "alice@partner.test" in page.inner_text("header .who")
    page.goto("/admin/teams")
    page.fill("#create-team input[name=name]", "made-in-browser")
    page.click("#create-team button[type=submit]")
    page.wait_for_url(re.compile(r"/admin/teams/\d+\?done=created"))
    assert "Team created." in page.inner_text("main")
    screenshot(page, tmp_path, "dashboard-sso-admin.png", min_bytes=5_000)

    page.click("form.logout button")
    page.wait_for_url(re.compile(r"/admin/login"))
    page.goto("/admin")
    assert urlparse(page.url).path == "/admin/login"


def test_a_viewer_sees_pages_and_the_server_refuses_its_changes(visit, provider, tmp_path):
    page, gateway = visit
    team_id = make_team(gateway, "viewed")
    sign_in_through_the_provider(page, provider, "bob-sub", email="bob@example.com")
    assert "viewer" in page.inner_text("header .who")
    page.goto("/admin/teams")
    assert page.locator("#create-team").count() == 0  # hidden, and refused below anyway
    page.goto(f"/admin/teams/{team_id}")
    assert page.locator("#edit-team").count() == 0 and page.locator("#create-key").count() == 0
    screenshot(page, tmp_path, "dashboard-sso-viewer.png", min_bytes=5_000)

    # What a viewer's browser can still send, with a valid CSRF token: the server says no.
    statuses = page.evaluate(
        """async (teamId) => {
            const csrf = document.querySelector('meta[name=csrf-token]').content;
            const form = (fields) => ({method: 'POST', redirect: 'manual',
                headers: {'content-type': 'application/x-www-form-urlencoded'},
                body: new URLSearchParams({csrf_token: csrf, ...fields}).toString()});
            const posts = [
                ['/admin/teams', {name: 'sneaky', budget_period: 'month'}],
                ['/admin/keys', {team_id: String(teamId), name: 'sneaky', budget_period: 'month'}],
                [`/admin/teams/${teamId}`, {name: 'renamed', rpm_limit: '1'}],
                [`/admin/teams/${teamId}/delete`, {}],
                ['/admin/models/x/load', {}],
            ];
            const out = [];
            for (const [path, fields] of posts) out.push((await fetch(path, form(fields))).status);
            out.push((await fetch('/admin/playground/key', {method: 'POST', headers: {'x-csrf-token': csrf}})).status);
            return out;
        }""",
        team_id,
    )
    assert statuses == [403] * 6
    with gateway.sessions() as db:
        team = crud.get_team(db, team_id=team_id)
        assert team.name == "viewed" and team.rpm_limit is None
        assert [key.name for key in crud.list_keys(db, team_id=team_id)] == ["viewed-key"]
        assert crud.get_team_by_name(db, name="sneaky") is None


def test_a_team_member_sees_only_their_team(visit, provider, tmp_path):
    page, gateway = visit
    ml_id = make_team(gateway, "ml")
    other_id = make_team(gateway, "finance")
    sign_in_through_the_provider(page, provider, "tom-sub", email="tom@partner.test", groups=[ML_GROUP])
    assert urlparse(page.url).path == f"/admin/teams/{ml_id}"
    assert "My team" in page.inner_text("header nav") and "Overview" not in page.inner_text("header nav")

    page.fill("#create-key input[name=name]", "tom-laptop")
    page.click("#create-key button[type=submit]")
    assert page.inner_text("[data-new-key]").strip().startswith("sk-")
    page.goto("/admin/keys")
    keys = page.inner_text("table[data-table=keys]")
    assert "tom-laptop" in keys and "ml-key" in keys and "finance-key" not in keys
    screenshot(page, tmp_path, "dashboard-sso-team.png", min_bytes=5_000)

    assert page.goto(f"/admin/teams/{other_id}").status == 404
    assert "finance" not in page.inner_text("main")
    assert page.goto("/admin/teams").status == 403
    assert page.goto(f"/admin/usage?team_id={other_id}&group=team").status == 200
    assert "finance" not in page.inner_text("main")
