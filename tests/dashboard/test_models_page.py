"""The Models page changes the registry as the admin API does: register (name, path, kind, aliases,
prices, hardware cost, engine settings), edit, enable / disable, load / unload, remove, and the server's
hardware cost; each refused with the API's own message and status, on the page, never a bare 400 or a
stack trace. The API's answer for the same input is asked too, so the two can't drift apart."""

from __future__ import annotations

import json
import re
import struct

import pytest
from fastapi.testclient import TestClient

from app.registry.registration import PRICE_FIELDS
from tests.registry.test_registry import checkpoint
from tests.support.dashboard import BASE_URL, bearer, chat, make_dashboard_gateway
from tests.support.gateway import FAKE_MODEL, FakeEngine, admin_headers, build_app


def submit(client, url: str, /, **fields):
    """A form post with the session's CSRF token (positional-only: a form has a field named `path`)."""
    return client.client.post(url, data={"csrf_token": client.csrf, **fields}, follow_redirects=False)


def page_error(html: str) -> str:
    found = re.search(r'<p class="error" role="alert">([^<]*)</p>', html)
    return "" if found is None else found.group(1).replace("&#39;", "'").replace("&#34;", '"')


def api_error(admin, method: str, path: str, body: dict | None = None) -> dict:
    response = admin.client.request(method, f"/admin/api{path}", headers=admin_headers(), json=body)
    assert response.status_code >= 400, response.text
    return {"status": response.status_code, **response.json()["error"]}


def model(admin, name: str) -> dict:
    response = admin.client.get(f"/admin/api/models/{name}", headers=admin_headers())
    assert response.status_code == 200, response.text
    return response.json()


def register_form(path, name: str = "tiny", **fields) -> dict:
    return {"name": name, "path": str(path), "kind": "chat", **fields}


def with_big_kv_header(folder):
    """A checkpoint whose safetensors header says: 2 layers of 64-wide keys. The memory check reads only
    that header, so a pool of 10 billion blocks is refused before anything loads."""
    header = {
        f"model.layers.{layer}.self_attn.k_proj.weight": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 0]}
        for layer in range(2)
    }
    raw = json.dumps(header).encode()
    (checkpoint(folder) / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return folder


def test_registering_a_model_with_prices_aliases_and_settings(admin, tmp_path):
    response = submit(
        admin,
        "/admin/models",
        **register_form(
            checkpoint(tmp_path / "tiny"),
            aliases="gpt-4o-mini, mini",
            max_model_len="256",
            price_input_per_1m="0.15",
            price_output_per_1m="0.6",
            price_batch_output_per_1m="0.2",
            hardware_cost_per_hour="1.5",
            **{"engine.num_kv_blocks": "64", "engine.enable_prefix_caching": "false", "engine.preemption_mode": "swap"},
        ),
    )
    assert response.status_code == 303 and response.headers["location"] == "/admin/models?done=registered#tiny"
    registered = model(admin, "tiny")
    assert registered["aliases"] == ["gpt-4o-mini", "mini"] and registered["max_model_len"] == 256
    assert registered["price"] == {
        "input_per_1m": 0.15,
        "cached_input_per_1m": 0.15,
        "output_per_1m": 0.6,
        "batch_input_per_1m": None,
        "batch_output_per_1m": 0.2,
    }
    assert registered["hardware_cost_per_hour"] == 1.5
    assert registered["engine_settings"] == {
        "num_kv_blocks": 64,
        "enable_prefix_caching": False,
        "preemption_mode": "swap",
    }
    page = admin.client.get(response.headers["location"]).text
    assert "Model registered." in page and "$0.15 in · $0.6 out" in page and "batch $0.075 in · $0.2 out" in page
    card = page[page.index('data-model="tiny"') :]
    assert 'name="engine.num_kv_blocks" inputmode="decimal" value="64"' in card  # the edit form shows it


@pytest.mark.parametrize(
    ("fields", "body", "param"),
    [
        ({"name": "bad name!"}, {"name": "bad name!"}, "name"),
        ({"price_input_per_1m": "-1"}, {"price_input_per_1m": -1}, "price_input_per_1m"),
        ({"price_output_per_1m": "lots"}, {"price_output_per_1m": "lots"}, "price_output_per_1m"),
        ({"engine.block_size": "7"}, {"engine_settings": {"block_size": 7}}, "engine_settings"),
        ({"max_model_len": "100000"}, {"max_model_len": 100000}, "max_model_len"),
        ({"aliases": FAKE_MODEL}, {"aliases": [FAKE_MODEL]}, "aliases"),
        ({"kind": "audio"}, {"kind": "audio"}, "kind"),
        ({"dtype": "float16"}, {"dtype": "float16"}, "dtype"),
        ({"hardware_cost_per_hour": "1e999"}, {"hardware_cost_per_hour": "1e999"}, "hardware_cost_per_hour"),
    ],
)
def test_a_refused_registration_shows_the_admin_apis_error(admin, tmp_path, fields, body, param):
    path = checkpoint(tmp_path / "tiny")
    expected = api_error(admin, "POST", "/models", {"name": "tiny", "path": str(path), **body})
    response = submit(admin, "/admin/models", **{**register_form(path), **fields})
    assert expected["param"] == param
    assert response.status_code == expected["status"] and page_error(response.text) == expected["message"]
    assert f'value="{fields.get("name", "tiny")}"' in response.text  # what was typed stays in the form
    assert admin.client.get("/admin/api/models/tiny", headers=admin_headers()).status_code == 404


def test_a_missing_path_or_a_taken_name_is_refused_like_the_api(admin, tmp_path):
    missing = tmp_path / "nowhere"
    expected = api_error(admin, "POST", "/models", {"name": "ghost", "path": str(missing)})
    response = submit(admin, "/admin/models", **register_form(missing, name="ghost"))
    assert (response.status_code, page_error(response.text)) == (expected["status"], expected["message"]) != (400, "")

    taken = api_error(admin, "POST", "/models", {"name": FAKE_MODEL, "path": str(checkpoint(tmp_path / "t"))})
    response = submit(admin, "/admin/models", **register_form(tmp_path / "t", name=FAKE_MODEL))
    assert taken["status"] == 409 and taken["code"] == "conflict"
    assert (response.status_code, page_error(response.text)) == (409, taken["message"])


def test_editing_prices_aliases_hardware_cost_and_settings(admin, tmp_path):
    submit(admin, "/admin/models", **register_form(checkpoint(tmp_path / "tiny"), price_input_per_1m="1"))
    edit = admin.client.get("/admin/models").text
    assert 'action="/admin/models/tiny/save"' in edit
    response = submit(
        admin,
        "/admin/models/tiny/save",
        path=str(tmp_path / "tiny"),
        aliases="cheap",
        max_model_len="512",
        dtype="float32",
        price_input_per_1m="",
        price_cached_input_per_1m="",
        price_output_per_1m="2",
        price_batch_input_per_1m="",
        price_batch_output_per_1m="",
        hardware_cost_per_hour="0.5",
        **{"engine.max_num_seqs": "4"},
    )
    assert response.status_code == 303 and "done=save" in response.headers["location"]
    changed = model(admin, "tiny")
    assert changed["aliases"] == ["cheap"] and changed["engine_settings"] == {"max_num_seqs": 4}
    assert (changed["price"]["input_per_1m"], changed["price"]["output_per_1m"]) == (0, 2)
    assert changed["hardware_cost_per_hour"] == 0.5

    # Emptied, they are removed: no aliases, no own hardware cost (a share of the server's), no settings.
    response = submit(
        admin,
        "/admin/models/tiny/save",
        path=str(tmp_path / "tiny"),
        aliases="",
        max_model_len="512",
        hardware_cost_per_hour="",
        **dict.fromkeys(PRICE_FIELDS, ""),  # the form sends every price field, filled or not
    )
    assert response.status_code == 303
    cleared = model(admin, "tiny")
    assert (cleared["aliases"], cleared["hardware_cost_per_hour"], cleared["engine_settings"]) == ([], None, {})
    assert cleared["price"] is None


def test_a_refused_edit_shows_the_apis_error_and_changes_nothing(admin, tmp_path):
    submit(admin, "/admin/models", **register_form(checkpoint(tmp_path / "tiny"), aliases="keep-me"))
    expected = api_error(admin, "PATCH", "/models/tiny", {"engine_settings": {"max_num_seqs": 0}})
    response = submit(admin, "/admin/models/tiny/save", path=str(tmp_path / "tiny"), **{"engine.max_num_seqs": "0"})
    assert (response.status_code, page_error(response.text)) == (400, expected["message"])
    assert "max_num_seqs must be at least 1" in expected["message"]
    assert '<details class="edit" open>' in response.text  # the failed form stays open with what was typed
    typed = submit(admin, "/admin/models/tiny/save", path=str(tmp_path / "tiny"), **{"engine.max_num_seqs": "many"})
    assert typed.status_code == 400 and "engine setting max_num_seqs must be a whole number" in page_error(typed.text)
    assert model(admin, "tiny")["aliases"] == ["keep-me"]


def test_disable_then_enable_a_served_model(admin):
    key = admin.create_key(admin.create_team())
    response = submit(admin, f"/admin/models/{FAKE_MODEL}/disable")
    assert response.status_code == 303
    assert model(admin, FAKE_MODEL)["enabled"] is False
    refused = chat(admin.client, key)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_not_loaded"
    page = admin.client.get("/admin/models").text
    assert (
        f'action="/admin/models/{FAKE_MODEL}/enable"' in page
        and "Model disabled" in admin.client.get(response.headers["location"]).text
    )

    load = submit(admin, f"/admin/models/{FAKE_MODEL}/load")  # the API refuses a disabled model's load
    expected = api_error(admin, "POST", f"/models/{FAKE_MODEL}/load")
    assert (load.status_code, page_error(load.text)) == (expected["status"], expected["message"])
    assert expected["code"] == "model_disabled"
    assert submit(admin, f"/admin/models/{FAKE_MODEL}/enable").status_code == 303
    assert model(admin, FAKE_MODEL)["enabled"] is True


def test_remove_forgets_the_model(admin, tmp_path):
    submit(admin, "/admin/models", **register_form(checkpoint(tmp_path / "tiny"), aliases="gone-too"))
    response = submit(admin, "/admin/models/tiny/remove")
    assert response.status_code == 303 and response.headers["location"] == "/admin/models?done=remove"
    assert admin.client.get("/admin/api/models/tiny", headers=admin_headers()).status_code == 404
    assert 'data-model="tiny"' not in admin.client.get("/admin/models").text
    assert submit(admin, "/admin/models/tiny/remove").status_code == 404


def test_a_load_that_would_not_fit_shows_the_memory_checks_refusal(admin, tmp_path):
    folder = with_big_kv_header(tmp_path / "huge")
    response = submit(
        admin, "/admin/models", **register_form(folder, name="huge", load="on", **{"engine.num_kv_blocks": str(10**10)})
    )
    assert response.status_code == 409
    message = page_error(response.text)
    assert message.startswith("not enough memory to load 'huge': it needs about ") and "GiB is available" in message
    assert "Traceback" not in response.text
    assert model(admin, "huge")["state"] == "unloaded"  # registered, not loaded

    again = submit(admin, "/admin/models/huge/load")
    expected = api_error(admin, "POST", "/models/huge/load")
    assert expected["code"] == "insufficient_memory"
    # the same message but for the free memory, read afresh by each check (it moves while other processes run)
    assert again.status_code == 409
    assert without_free_memory(page_error(again.text)) == without_free_memory(expected["message"])


def without_free_memory(message: str) -> str:
    return re.sub(r"[0-9.]+ GiB is available", "... GiB is available", message)


def test_the_server_hardware_cost_is_set_from_the_page_and_the_overview_links_to_it(dashboard):
    dashboard.app.state.context.models.cost_meter.set_server_cost(0.0)
    dashboard.log_in()
    overview = dashboard.client.get("/admin").text
    assert ">$0/h</a>" in overview and 'id="hardware-cost-unset"' in overview
    assert 'href="/admin/models#hardware-cost"' in overview
    assert 'id="hardware-cost"' in dashboard.client.get("/admin/models").text

    response = submit(dashboard, "/admin/hardware-cost", hardware_cost_per_hour="3.5")
    assert response.status_code == 303 and response.headers["location"] == "/admin/models?done=cost#hardware-cost"
    overview = dashboard.client.get("/admin").text
    assert ">$3.50/h</a>" in overview and 'id="hardware-cost-unset"' not in overview
    costs = dashboard.client.get("/admin/api/costs", headers=admin_headers()).json()
    assert costs["hardware_cost_per_hour"] == costs["real"]["cost_per_hour"] == 3.5
    assert dashboard.client.get("/admin/data/live").json()["hardware_cost_per_hour"] == 3.5

    for typed, body in (("-2", -2), ("free", "free")):
        expected = api_error(dashboard, "PATCH", "/costs", {"hardware_cost_per_hour": body})
        refused = submit(dashboard, "/admin/hardware-cost", hardware_cost_per_hour=typed)
        assert (refused.status_code, page_error(refused.text)) == (400, expected["message"])
        assert expected["param"] == "hardware_cost_per_hour"
    assert dashboard.client.get("/admin/api/costs", headers=admin_headers()).json()["hardware_cost_per_hour"] == 3.5


def test_the_server_hardware_cost_outlives_a_restart(dashboard, tmp_path):
    dashboard.log_in()
    assert submit(dashboard, "/admin/hardware-cost", hardware_cost_per_hour="4.25").status_code == 303
    restarted = build_app(make_dashboard_gateway(tmp_path), FakeEngine(), hardware_cost_per_hour=2.0)
    with TestClient(restarted, base_url=BASE_URL) as client:
        costs = client.get("/admin/api/costs", headers=admin_headers()).json()
    assert costs["hardware_cost_per_hour"] == costs["real"]["cost_per_hour"] == 4.25  # the flag's 2.0 lost


def test_a_models_own_hardware_cost_and_price_reach_the_overviews_numbers(admin):
    submit(
        admin,
        f"/admin/models/{FAKE_MODEL}/save",
        path=model(admin, FAKE_MODEL)["path"],
        price_input_per_1m="0.5",
        price_output_per_1m="1.5",
        hardware_cost_per_hour="7",
    )
    current = next(
        m["current"]
        for m in admin.client.get("/admin/data/live").json()["models"]
        if m["current"]["name"] == FAKE_MODEL
    )
    assert current["hardware_cost_per_hour"] == 7  # its own, not the server's $2/h
    assert (current["price"]["input_per_1m"], current["price"]["output_per_1m"]) == (0.5, 1.5)
    assert current["price"]["batch_output_per_1m"] == 0.75


@pytest.mark.parametrize("path", ["/admin/models", "/admin/hardware-cost", f"/admin/models/{FAKE_MODEL}/remove"])
def test_every_change_needs_the_csrf_token(admin, path):
    response = admin.client.post(path, data={"name": "x", "hardware_cost_per_hour": "1"}, follow_redirects=False)
    assert response.status_code == 403
    assert model(admin, FAKE_MODEL)["state"] == "loaded"


def test_an_unknown_action_or_model_is_a_404_page(admin):
    assert submit(admin, f"/admin/models/{FAKE_MODEL}/explode").status_code == 404
    assert submit(admin, "/admin/models/nobody/load").status_code == 404
    key = admin.create_key(admin.create_team())
    assert chat(admin.client, key).status_code == 200
    assert admin.client.get("/v1/models", headers=bearer(key)).status_code == 200


def test_the_embedded_embedding_model_says_it_loads_on_first_use(admin, tmp_path):
    submit(admin, "/admin/models", **register_form("default", name="all-MiniLM-L6-v2", kind="embedding"))
    submit(admin, "/admin/models", **register_form(checkpoint(tmp_path / "tiny")))
    assert model(admin, "all-MiniLM-L6-v2")["state"] == model(admin, "tiny")["state"] == "unloaded"
    page = admin.client.get("/admin/models").text
    cards = {
        name: card for name, card in re.findall(r'<section class="card model" id="([^"]+)"(.*?)</section>', page, re.S)
    }
    assert "loads on first use" in cards["all-MiniLM-L6-v2"]
    assert "loads on first use" not in cards["tiny"]  # an admin's model loads at start, or when an admin says
