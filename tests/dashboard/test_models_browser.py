"""The Models page in a real headless Chromium against a real server (real engine, real gateway on
SQLite), started with no hardware cost: register a tiny model with a price and watch the overview's
charged cost per token appear and then change with an edit; follow the overview's "$0/h" link to set
the hardware cost and watch the real cost per token leave $0; and see the memory check's refusal, in
words, on the page. Screenshots go where the other browser tests put theirs.

Skips when Chromium or Playwright is missing, unless CI is set: then they are required."""

from __future__ import annotations

import re
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.dashboard.test_dashboard_browser import (  # noqa: F401  (fixtures: the browser, once per module)
    CAPITAL,
    browser,
    playwright_api,
    screenshot,
    visiting,
)
from tests.support.dashboard import make_dashboard_gateway
from tests.support.gateway import admin_headers
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model
PRICED = "tiny-priced"


@pytest.fixture(scope="module")
def server(browser, smollm2, tmp_path_factory):  # noqa: F811  (no model load when there is no browser)
    gateway = make_dashboard_gateway(tmp_path_factory.mktemp("models-browser-db"))
    with running_server(smollm2, gateway=gateway, hardware_cost_per_hour=0.0) as running:
        running.gateway = gateway
        yield running


@pytest.fixture
def visit(browser, server):  # noqa: F811
    with visiting(browser, server) as visit:
        yield visit


def team_key(server) -> str:
    def admin(path: str, body: dict) -> dict:
        response = httpx.post(f"{server.url}/admin/api{path}", json=body, headers=admin_headers())
        assert response.status_code < 300, response.text
        return response.json()

    team = admin("/teams", {"name": f"browser-{time.monotonic_ns()}"})
    return admin("/keys", {"team_id": team["id"]})["key"]


def overview_tile(page, model: str, field: str, pattern: str) -> str:
    """The tile's text once it matches `pattern` (the overview refreshes every second)."""
    selector = f'[data-model="{model}"] [data-field="{field}"]'
    page.wait_for_function(
        "([selector, pattern]) => { const node = document.querySelector(selector);"
        " return node && new RegExp(pattern).test(node.textContent); }",
        arg=[selector, pattern],
        timeout=20_000,
    )
    return page.inner_text(selector)


def test_the_overviews_zero_cost_links_to_the_setting_and_the_real_cost_follows(visit, server, tmp_path):
    page = visit.page
    visit.log_in()
    client = server.client(api_key=team_key(server))
    client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=8, temperature=0)
    assert overview_tile(page, MODEL, "cost_now", r"^\$0$") == "$0"  # tokens made, but no hardware cost
    assert page.inner_text("[data-field=hardware-cost]") == "$0/h"
    screenshot(page, tmp_path, "overview-hardware-cost-unset.png")

    page.click("#hardware-cost-unset a")
    page.wait_for_url(re.compile(r"/admin/models#hardware-cost$"))
    page.fill("#set-hardware-cost input[name=hardware_cost_per_hour]", "3.60")
    page.click("#set-hardware-cost button[type=submit]")
    page.wait_for_url(re.compile(r"done=cost"))
    assert "Hardware cost saved" in page.inner_text("main")
    assert "$3.60/h" in page.inner_text("[data-field=server-hardware-cost]")

    page.goto("/admin")
    assert page.inner_text("[data-field=hardware-cost]") == "$3.60/h"
    assert page.locator("#hardware-cost-unset").count() == 0
    client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=8, temperature=0)
    real_cost = overview_tile(page, MODEL, "cost_now", r"^\$[0-9.]*[1-9]")
    assert float(real_cost.lstrip("$").replace(",", "")) > 0
    screenshot(page, tmp_path, "overview-hardware-cost-set.png")


def test_register_a_priced_model_and_see_its_cost_per_token_on_the_overview(visit, server, tiny_llama_dir, tmp_path):
    page = visit.page
    visit.log_in()
    page.goto("/admin/models")
    form = "#register-model"
    page.fill(f"{form} input[name=name]", PRICED)
    page.fill(f"{form} input[name=path]", str(tiny_llama_dir))
    page.fill(f"{form} input[name=aliases]", "gpt-4o-mini")
    page.fill(f"{form} input[name=price_input_per_1m]", "0.15")
    page.fill(f"{form} input[name=price_output_per_1m]", "0.6")
    page.click(f"{form} details.settings-fields summary")
    page.fill(f"{form} input[name='engine.num_kv_blocks']", "64")
    page.check(f"{form} input[name=load]")
    page.click(f"{form} button[type=submit]")
    page.wait_for_url(re.compile(r"done=registered"))
    card = f'section[data-model="{PRICED}"]'
    assert page.get_attribute(card, "data-state") == "loaded"
    assert page.inner_text(f"{card} [data-field=price]") == "$0.15 in · $0.6 out"
    screenshot(page, tmp_path, "models-registered.png")

    reply = server.client(api_key=team_key(server)).chat.completions.create(
        model="gpt-4o-mini", messages=CAPITAL, max_tokens=4
    )
    assert reply.model == PRICED

    page.goto("/admin")
    assert overview_tile(page, PRICED, "price", r"out$") == "$0.150 in · $0.600 out"

    page.goto("/admin/models")
    page.click(f"{card} details.edit summary")
    page.fill(f"{card} .edit-model input[name=price_output_per_1m]", "1.2")
    page.click(f"{card} .edit-model button[type=submit]")
    page.wait_for_url(re.compile(r"done=save"))
    assert page.inner_text(f"{card} [data-field=price]") == "$0.15 in · $1.20 out"
    page.goto("/admin")
    assert overview_tile(page, PRICED, "price", r"\$1\.20 out$") == "$0.150 in · $1.20 out"
    screenshot(page, tmp_path, "overview-priced-model.png")

    page.goto("/admin/models")
    page.click(f"{card} form[action$='/remove'] button")  # the confirmation is accepted
    page.wait_for_url(re.compile(r"done=remove"))
    assert page.locator(card).count() == 0


def test_the_memory_checks_refusal_is_shown_in_words(visit, server, tiny_llama_dir, tmp_path):
    page = visit.page
    visit.log_in()
    page.goto("/admin/models")
    form = "#register-model"
    page.fill(f"{form} input[name=name]", "too-big")
    page.fill(f"{form} input[name=path]", str(tiny_llama_dir))
    page.click(f"{form} details.settings-fields summary")
    page.fill(f"{form} input[name='engine.num_kv_blocks']", str(10**10))  # a KV pool no machine here has
    page.check(f"{form} input[name=load]")
    with page.expect_response(lambda response: urlparse(response.url).path == "/admin/models") as answered:
        page.click(f"{form} button[type=submit]")
    assert answered.value.status == 409
    alert = page.inner_text("main .error[role=alert]")
    assert alert.startswith("not enough memory to load 'too-big': it needs about ") and "GiB is available" in alert
    assert "Traceback" not in page.content()
    assert page.get_attribute('section[data-model="too-big"]', "data-state") == "unloaded"  # registered only
    assert page.input_value(f"{form} input[name='engine.num_kv_blocks']") == str(10**10)  # kept to fix
    screenshot(page, tmp_path, "models-memory-refusal.png")
    # Chromium logs the 409 the refused form's page came back with; that one is expected, no other.
    assert sum("status of 409" in error for error in visit.errors) == 1
    visit.errors[:] = [error for error in visit.errors if "status of 409" not in error]
    httpx.delete(f"{server.url}/admin/api/models/too-big", headers=admin_headers())
