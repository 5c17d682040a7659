"""The Models page shows the registry (state, aliases, prices, sampling defaults) and its Load / Unload buttons act on the
pool: unloading the served model makes /v1 answer 503 model_not_loaded; a model that cannot load says
why."""

from __future__ import annotations

import re
import time

from app.registry.sampling_defaults import EMBEDDED_CHAT_DEFAULTS
from tests.registry.test_registry import checkpoint
from tests.registry.test_sampling_defaults import with_generation_config
from tests.support.dashboard import bearer, chat
from tests.support.gateway import FAKE_MODEL, admin_headers


def models_page(admin) -> str:
    return admin.client.get("/admin/models").text


def test_the_models_page_shows_state_aliases_and_prices(admin, tmp_path):
    response = admin.client.post(
        "/admin/api/models",
        headers=admin_headers(),
        json={
            "name": "tiny",
            "path": str(checkpoint(tmp_path / "tiny")),
            "aliases": ["gpt-4o-mini"],
            "price_input_per_1m": 0.15,
            "price_output_per_1m": 0.6,
        },
    )
    assert response.status_code == 201, response.text
    page = models_page(admin)
    assert f'data-model="{FAKE_MODEL}" data-state="loaded"' in page
    assert 'data-model="tiny" data-state="unloaded"' in page
    assert "gpt-4o-mini" in page and "$0.15 in" in page and "$0.6 out" in page
    assert f'action="/admin/models/{FAKE_MODEL}/unload"' in page and 'action="/admin/models/tiny/load"' in page


def test_the_models_page_shows_each_models_sampling_defaults(admin, tmp_path):
    response = admin.client.post(
        "/admin/api/models",
        headers=admin_headers(),
        json={"name": "qwen-like", "path": str(with_generation_config(tmp_path / "qwen-like"))},
    )
    assert response.status_code == 201, response.text
    page = models_page(admin)
    embedded, registered = (
        page[page.index(f'data-model="{FAKE_MODEL}"') :],
        page[page.index('data-model="qwen-like"') :],
    )
    pairs = re.compile(r'<span class="pair">([^<]*)</span>')
    assert pairs.findall(embedded[: embedded.index("</section>")]) == [
        f"{name} {value}" for name, value in EMBEDDED_CHAT_DEFAULTS.items()
    ]
    assert pairs.findall(registered[: registered.index("</section>")]) == [
        "temperature 0.6",
        "top_p 0.95",
        "top_k 20",
        "repetition_penalty 1.05",
        "max_tokens 256",
    ]


def test_the_unload_button_stops_serving_the_model(admin):
    key = admin.create_key(admin.create_team())
    assert chat(admin.client, key).status_code == 200
    response = admin.post(f"/admin/models/{FAKE_MODEL}/unload")
    assert response.status_code == 303 and response.headers["location"].startswith("/admin/models")
    deadline = time.monotonic() + 10
    while 'data-state="unloaded"' not in models_page(admin):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    refused = chat(admin.client, key)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_not_loaded"
    assert admin.client.get("/v1/models", headers=bearer(key)).json()["data"][0]["status"] == "unloaded"


def test_a_model_that_cannot_load_says_why(admin, tmp_path):
    admin.client.post(
        "/admin/api/models",
        headers=admin_headers(),
        json={"name": "hollow", "path": str(checkpoint(tmp_path / "hollow"))},
    )
    response = admin.post("/admin/models/hollow/load")
    assert response.status_code == 400 and "could not load" in response.text
    assert 'data-model="hollow" data-state="unloaded"' in models_page(admin)
