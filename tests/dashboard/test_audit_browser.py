"""The audit log and key rotation in a real headless Chromium (Playwright) against a real server (the
real gateway on SQLite; the fake engine, since no reply's words matter here): a change made in the
dashboard shows up on the Audit page, filtered, with a CSV link; rotating a key shows its new secret
once, the old secret works until its shortened grace ends and then gets 401. Screenshots go where the
dashboard's other browser tests put theirs (TOKENMILL_SCREENSHOT_DIR)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from app.gateway.keys import visible_prefix
from app.tables import ApiKey
from tests.dashboard.test_dashboard_browser import (  # noqa: F401  (fixtures: the browser, once per module)
    CHROMIUM_FLAGS,
    browser,
    playwright_api,
    screenshot,
    visiting,
)
from tests.support.dashboard import make_dashboard_gateway
from tests.support.gateway import FAKE_MODEL, build_app, serve_in_thread

GRACE_S = 3  # a grace shortened from the default 24 h, so the test sees it end


@pytest.fixture(scope="module")
def server(browser, tmp_path_factory):  # noqa: F811 - the fixture imported above
    gateway = make_dashboard_gateway(tmp_path_factory.mktemp("audit-db"))
    with serve_in_thread(build_app(gateway)) as url:
        yield type("Server", (), {"url": url, "gateway": gateway})()


@pytest.fixture
def visit(browser, server):  # noqa: F811
    with visiting(browser, server) as visit:
        yield visit


def chat_status(server, key: str) -> int:
    body = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=30).status_code


def open_team_form(page) -> None:
    page.goto("/admin/teams")
    if not page.is_visible("#create-team"):  # folded away once there are teams
        page.click("details.card > summary")


def make_team_and_key(page, server, team_name: str) -> tuple[int, str]:
    open_team_form(page)
    page.fill("#create-team input[name=name]", team_name)
    page.click("#create-team button[type=submit]")
    page.wait_for_url(re.compile(r"/admin/teams/\d+\?done=created"))
    page.fill("#create-key input[name=name]", f"{team_name}-key")
    page.click("#create-key button[type=submit]")
    key = page.inner_text("[data-new-key]").strip()
    with server.gateway.sessions() as session:
        key_id = session.scalar(select(ApiKey.id).where(ApiKey.key_prefix == visible_prefix(key)))
    return key_id, key


def test_a_change_in_the_dashboard_appears_on_the_audit_page(visit, tmp_path):
    page = visit.page
    visit.log_in()
    open_team_form(page)
    page.fill("#create-team input[name=name]", "audited-team")
    page.fill("#create-team input[name=rpm_limit]", "60")
    page.click("#create-team button[type=submit]")
    page.wait_for_url(re.compile(r"/admin/teams/\d+\?done=created"))
    team_id = re.search(r"/admin/teams/(\d+)", page.url).group(1)

    page.click("nav a[href='/admin/audit']")
    page.wait_for_url(re.compile(r"/admin/audit$"))
    newest = page.locator("table[data-table=audit] tbody tr").first
    assert newest.locator("[data-column=action]").inner_text() == "team.create"
    assert "audited-team" in newest.locator("[data-column=after]").inner_text()
    assert "session.login" in page.inner_text("table[data-table=audit]")

    page.fill("#audit-filter input[name=target_id]", team_id)
    page.select_option("#audit-filter select[name=target_type]", "team")
    page.click("#audit-filter button[type=submit]")
    page.wait_for_url(re.compile(r"target_id=" + team_id))
    actions = page.locator("table[data-table=audit] [data-column=action]").all_inner_texts()
    assert actions == ["team.create"]
    with page.expect_download() as download:
        page.click("#audit-csv")
    lines = Path(download.value.path()).read_text().splitlines()
    assert lines[0].startswith("id,created_at,actor_kind") and len(lines) == 2 and "team.create" in lines[1]
    screenshot(page, tmp_path, "dashboard-audit.png")


def test_rotate_shows_the_new_secret_once_and_the_old_fails_after_its_grace(visit, server, tmp_path):
    page = visit.page
    visit.log_in()
    key_id, old = make_team_and_key(page, server, "rotating-team")
    assert chat_status(server, old) == 200

    page.goto(f"/admin/keys/{key_id}")
    page.fill("#rotate-key input[name=grace]", f"{GRACE_S}s")
    page.click("#rotate-key button[type=submit]")  # the confirmation is accepted by the visit
    rotated_at = time.monotonic()
    new = page.inner_text("[data-new-key]").strip()
    assert new.startswith("sk-") and new != old
    assert visible_prefix(old) in page.inner_text("[data-grace]")
    screenshot(page, tmp_path, "dashboard-key-rotated.png")
    assert chat_status(server, old) == 200 and chat_status(server, new) == 200  # both, during the grace

    while chat_status(server, old) == 200 and time.monotonic() - rotated_at < GRACE_S + 10:
        time.sleep(0.2)
    assert time.monotonic() - rotated_at >= GRACE_S - 0.5  # it worked for the whole grace ...
    assert chat_status(server, old) == 401  # ... and not after it
    assert chat_status(server, new) == 200

    page.goto(f"/admin/keys/{key_id}")
    assert new not in page.content() and old not in page.content()
    page.goto(f"/admin/audit?target_type=key&target_id={key_id}")
    actions = page.locator("table[data-table=audit] [data-column=action]").all_inner_texts()
    assert actions == ["key.rotate", "key.create"]
    assert old not in page.content() and new not in page.content()
