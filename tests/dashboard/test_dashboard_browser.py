"""The dashboard in a real headless Chromium (Debian's, driven by Playwright) against a real server
(real engine and model, real gateway on SQLite): log in, create a team and a key, call the API with the
openai client, watch the overview's counters and the usage table move, revoke the key and get 401,
stream a reply in the playground; and no request ever leaves localhost.

Skips when Chromium or Playwright is missing, unless CI is set: then they are required."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import httpx
import openai
import pytest
from sqlalchemy import select

from app.tables import Team, UsageRow
from tests.support.dashboard import ADMIN_KEY, make_dashboard_gateway
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model

CHROMIUM = os.environ.get("TOKENMILL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--metrics-recording-only",
    "--no-default-browser-check",
    "--disable-domain-reliability",
    "--disable-client-side-phishing-detection",
]
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
TIMEOUT_MS = 60_000  # two shared cores: a real model's reply can take a while


def unavailable(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what} is required in CI")
    pytest.skip(f"{what} is not installed")


@pytest.fixture(scope="module")
def playwright_api():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright (pip install playwright)")
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        unavailable(f"Chromium at {CHROMIUM} (apt-get install -y chromium)")
    with sync_playwright() as api:
        yield api


@pytest.fixture(scope="module")
def browser(playwright_api):
    # Playwright gives the browser a new, empty profile of its own (a fresh --user-data-dir).
    browser = playwright_api.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def server(browser, smollm2, tmp_path_factory):  # no model load when there is no browser
    gateway = make_dashboard_gateway(tmp_path_factory.mktemp("dashboard-db"))
    with running_server(smollm2, gateway=gateway, hardware_cost_per_hour=2.0) as running:
        running.gateway = gateway
        yield running


class Visit:
    """One browser context on the server: every URL it requests and every script error it hits."""

    def __init__(self, browser, server) -> None:
        self.server = server
        self.context = browser.new_context(base_url=server.url, viewport={"width": 1440, "height": 1000})
        self.urls: list[str] = []
        self.errors: list[str] = []
        self.context.on("request", lambda request: self.urls.append(request.url))
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("dialog", lambda dialog: dialog.accept())  # the "revoke?" confirmations
        self.page.set_default_timeout(TIMEOUT_MS)

    def log_in(self) -> None:
        page = self.page
        page.goto("/admin")
        assert urlparse(page.url).path == "/admin/login"
        page.fill("input[name=admin_key]", ADMIN_KEY)
        page.click("form[action='/admin/login'] button[type=submit]")
        page.wait_for_url(f"{self.server.url}/admin")

    def outside_requests(self) -> list[str]:
        local = urlparse(self.server.url).netloc
        return [
            url
            for url in self.urls
            if urlparse(url).scheme not in ("data", "blob", "about") and urlparse(url).netloc != local
        ]


@contextmanager
def visiting(browser, server, tolerated: str | None = None) -> Iterator[Visit]:
    """A Visit, closed at the end, that must not have left localhost nor hit a script error (but one that
    names `tolerated`)."""
    visit = Visit(browser, server)
    yield visit
    visit.context.close()
    assert visit.outside_requests() == [], "requests left localhost"
    errors = [error for error in visit.errors if tolerated is None or tolerated not in error]
    assert errors == [], "script errors on the page"


def screenshot(page, tmp_path, name: str, min_bytes: int = 10_000) -> None:
    """The whole page, as `name` in TOKENMILL_SCREENSHOT_DIR (else the test's tmp folder); not a blank one."""
    folder = Path(os.environ.get("TOKENMILL_SCREENSHOT_DIR", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / name), full_page=True)
    assert (folder / name).stat().st_size > min_bytes


@pytest.fixture
def visit(browser, server):
    with visiting(browser, server, tolerated="401") as visit:  # the revoked key's calls
        yield visit


def number_in(page, selector: str) -> int:
    return int(re.sub(r"[^\d]", "", page.inner_text(selector)) or 0)


def wait_for_number(page, selector: str, at_least: int) -> None:
    page.wait_for_function(
        "([selector, n]) => { const node = document.querySelector(selector);"
        " return node && Number(node.textContent.replace(/[^0-9]/g, '')) >= n; }",
        arg=[selector, at_least],
        timeout=15_000,
    )


def test_the_dashboard_needs_a_login_and_logout_ends_it(visit):
    page = visit.page
    page.goto("/admin/usage")
    assert urlparse(page.url).path == "/admin/login"
    assert page.locator("form input[type=hidden][name=csrf_token]").count() == 1
    page.fill("input[name=admin_key]", "sk-admin-wrong")
    page.click("button[type=submit]")
    assert "not the admin key" in page.inner_text("main")
    visit.log_in()
    page.click("form.logout button")
    page.wait_for_url(re.compile(r"/admin/login"))
    page.goto("/admin")
    assert urlparse(page.url).path == "/admin/login"


def test_team_key_api_call_overview_usage_and_revocation(visit, server):
    page = visit.page
    visit.log_in()
    page.goto("/admin/teams")
    page.fill("#create-team input[name=name]", "browser-team")
    page.fill("#create-team input[name=rpm_limit]", "100")
    page.click("#create-team button[type=submit]")
    page.wait_for_url(re.compile(r"/admin/teams/\d+\?done=created"))
    team_id = int(re.search(r"/admin/teams/(\d+)", page.url).group(1))

    page.fill("#create-key input[name=name]", "browser-key")
    page.click("#create-key button[type=submit]")
    key = page.inner_text("[data-new-key]").strip()
    assert key.startswith("sk-")
    page.click("button[data-copy]")
    page.locator(".copied").wait_for(state="visible", timeout=5000)  # the copy handler awaits the clipboard

    page.goto(f"/admin/usage?team_id={team_id}&group=team&group=key")
    assert "No usage in this range." in page.inner_text("table[data-table=usage]")

    page.goto("/admin")
    counter = f'[data-model="{MODEL}"] [data-field="generation_tokens_total"]'
    page.wait_for_selector(counter)
    before = number_in(page, counter)
    reply = server.client(api_key=key).chat.completions.create(
        model=MODEL, messages=CAPITAL, max_tokens=12, temperature=0
    )
    completion_tokens = reply.usage.completion_tokens
    assert "Paris" in reply.choices[0].message.content
    wait_for_number(page, counter, before + completion_tokens)
    assert page.locator(f'[data-model="{MODEL}"] .chart-svg path.line').count() > 0

    server.gateway.writer.flush(10)
    page.goto(f"/admin/usage?team_id={team_id}&group=team&group=key")
    table = page.inner_text("table[data-table=usage]")
    assert "browser-team" in table
    assert page.inner_text("[data-total=completion_tokens]") == str(completion_tokens)
    assert page.inner_text("[data-total=requests]") == "1"
    page.wait_for_selector("#usage-chart[data-drawn=true] svg rect")

    page.goto(f"/admin/teams/{team_id}")
    page.click("tr[data-key-prefix] form[action$='/revoke'] button")
    page.wait_for_url(re.compile(r"done=revoked"))
    assert "Key revoked." in page.inner_text("main")
    with pytest.raises(openai.AuthenticationError) as refused:
        server.client(api_key=key).chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=2)
    assert refused.value.status_code == 401


def test_the_playground_streams_a_reply_through_the_api(visit, server):
    page = visit.page
    streamed = []
    page.on(
        "response",
        lambda response: (
            response.url.endswith("/v1/chat/completions") and streamed.append(response.headers.get("content-type", ""))
        ),
    )
    visit.log_in()
    page.goto("/admin/playground")
    page.fill("textarea[name=message]", "What is the capital of France?")
    page.fill("input[name=max_tokens]", "16")
    page.click("#send")
    reply = page.locator('.msg.assistant[data-done="true"] span')
    reply.wait_for()
    assert "Paris" in reply.inner_text()
    assert "completion tokens" in page.inner_text("#reply-stats")
    assert streamed and streamed[0].startswith("text/event-stream")
    assert any(urlparse(url).path == "/admin/playground/key" for url in visit.urls)

    assert server.gateway.writer.flush(10)
    with server.gateway.sessions() as session:
        rows = session.execute(
            select(UsageRow.completion_tokens, UsageRow.status)
            .join(Team, Team.id == UsageRow.team_id)
            .where(Team.name == "playground")
        ).all()
    assert rows and rows[-1].completion_tokens > 0 and rows[-1].status == "ok"


def test_overview_under_load_screenshot(visit, server, tmp_path):
    """A few concurrent requests, so that the batch fills and the charts have something to show."""
    page = visit.page
    visit.log_in()
    page.goto("/admin/playground")  # its short-lived key is a metered team key
    api_key = page.evaluate(
        "async () => (await (await fetch('/admin/playground/key', {method: 'POST', headers:"
        " {'x-csrf-token': document.querySelector('meta[name=csrf-token]').content}})).json()).key"
    )
    client = server.client(api_key=api_key)

    def ask(index: int) -> None:
        client.chat.completions.create(
            model=MODEL,
            max_tokens=64,
            temperature=0.7,
            seed=index,
            messages=[{"role": "user", "content": f"Write a long story about cat number {index}."}],
        )

    page.goto("/admin")
    card = f'[data-model="{MODEL}"]'
    page.wait_for_selector(f"{card} .chart-svg")
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)
    page.wait_for_function(  # the overview shows the batch and its KV blocks while it runs
        "card => /^[1-9]/.test(document.querySelector(card + ' [data-field=running]').textContent)"
        " && document.querySelector(card + ' [data-field=kv_usage_now]').textContent !== '0%'",
        arg=card,
        timeout=30_000,
    )
    page.wait_for_timeout(1500)
    tiles = page.inner_text(f"{card} .tiles")
    for label in ("Batch occupancy", "KV cache", "Prefix cache hits", "Time to first token", "Real cost / 1M out"):
        assert label in tiles
    assert page.inner_text(f'{card} [data-field="cost_now"]').startswith("$")
    screenshot(page, tmp_path, "dashboard-overview.png")
    for thread in threads:
        thread.join(120)


def test_the_overview_shows_each_teams_share_screenshot(visit, server, tmp_path):
    """Two teams served at once: the overview's "share by team" chart lists both by name, the one served
    more tokens first, with the same last-minute token counts /metrics reports."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    keys = {}
    for name in ("share-big", "share-small"):
        team = httpx.post(f"{server.url}/admin/api/teams", json={"name": name}, headers=admin).json()
        keys[name] = httpx.post(f"{server.url}/admin/api/keys", json={"team_id": team["id"]}, headers=admin).json()
    page = visit.page
    visit.log_in()
    page.goto("/admin")
    card = f'[data-model="{MODEL}"]'
    page.wait_for_selector(f"{card} .team-share")

    def ask(name: str, max_tokens: int, index: int) -> None:
        server.client(api_key=keys[name]["key"]).chat.completions.create(
            model=MODEL,
            max_tokens=max_tokens,
            temperature=0.7,
            seed=index,
            messages=[{"role": "user", "content": f"Write a long story about dog number {index}."}],
        )

    threads = [threading.Thread(target=ask, args=("share-big", 48, i)) for i in range(3)]
    threads.append(threading.Thread(target=ask, args=("share-small", 4, 9)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    big, small = (f"{card} .team-share [data-team='team:{keys[n]['team_id']}']" for n in ("share-big", "share-small"))
    page.wait_for_selector(big)
    page.wait_for_selector(small)
    rows = page.eval_on_selector_all(f"{card} .team-share [data-team]", "rows => rows.map(r => r.dataset.team)")
    assert rows.index(f"team:{keys['share-big']['team_id']}") < rows.index(f"team:{keys['share-small']['team_id']}")
    assert page.inner_text(f"{big} .name") == "share-big"
    big_team = f"team:{keys['share-big']['team_id']}"
    served = server.metrics()[f'tokenmill:team_tokens_last_minute{{team="{big_team}"}}']
    assert served >= 3 * 10  # three prompts and their replies
    page.wait_for_function(  # the chart catches up with /metrics within a poll or two
        "([selector, text]) => (document.querySelector(selector) || {}).textContent.includes(text)",
        arg=[f"{big} [data-field=share]", f"{int(served):,} tokens"],
        timeout=10_000,
    )
    page.locator(f"{card} .team-share").scroll_into_view_if_needed()
    screenshot(page, tmp_path, "dashboard-share-by-team.png")
