"""Teams share the engine fairly: what the gateway tells the engine about each request's team, and the
prefix cache that no team shares with another unless an admin says so (through the HTTP API)."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.support.gateway import FakeEngine, admin_headers, bearer, build_app, chat_body, create_key, create_team
from tests.support.server import MODEL, running_server

SYSTEM = (
    "You are the support assistant of a company that sells bicycles, helmets and spare parts. Answer "
    "briefly, politely and precisely; when you do not know, say so and suggest contacting the shop. "
) * 3


def test_the_engine_learns_team_weight_capped_priority_and_a_per_team_cache_salt(make_gateway):
    engine = FakeEngine()
    with TestClient(build_app(make_gateway(), engine)) as client:
        alpha = create_team(client, "alpha", scheduling_weight=3)
        beta = create_team(client, "beta", cache_group="shared-docs")
        plain_key = create_key(client, alpha["id"])["key"]
        trusted_key = create_key(client, alpha["id"], priority_floor=-10)["key"]
        beta_key = create_key(client, beta["id"])["key"]
        for key, priority in ((plain_key, -5), (plain_key, 7), (trusted_key, -5), (beta_key, None)):
            extra = {} if priority is None else {"priority": priority}
            response = client.post("/v1/chat/completions", json=chat_body(**extra), headers=bearer(key))
            assert response.status_code == 200, response.text
        bad = client.post("/v1/chat/completions", json=chat_body(priority="soon"), headers=bearer(plain_key))
    first, later, trusted, grouped = engine.tenancies
    assert (first.team, first.weight, first.priority) == (f"team:{alpha['id']}", 3.0, 0)  # capped at the floor
    assert later.priority == 7 and trusted.priority == -5
    assert first.effective_cache_salt == f"team:{alpha['id']}" != grouped.effective_cache_salt
    assert grouped.effective_cache_salt == "group:shared-docs" and grouped.weight == 1.0
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"


def test_team_share_settings_are_validated_and_shown(make_gateway):
    with TestClient(build_app(make_gateway())) as client:
        team = create_team(client, "gamma")
        assert (team["scheduling_weight"], team["cache_group"]) == (1.0, None)
        for body in ({"scheduling_weight": 0}, {"scheduling_weight": None}, {"cache_group": "has space"}):
            response = client.patch(f"/admin/api/teams/{team['id']}", json=body, headers=admin_headers())
            assert response.status_code == 400, body
        response = client.patch(
            f"/admin/api/teams/{team['id']}",
            json={"scheduling_weight": 2.5, "cache_group": "g1"},
            headers=admin_headers(),
        )
        assert (response.json()["scheduling_weight"], response.json()["cache_group"]) == (2.5, "g1")


def cached_tokens(url: str, key: str, question: str) -> int:
    response = httpx.post(
        f"{url}/v1/chat/completions",
        headers=bearer(key),
        timeout=60,
        json={
            "model": MODEL,
            "max_tokens": 1,
            "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        },
    )
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.real_model
def test_a_long_system_prompt_is_cached_for_its_team_only(smollm2, make_gateway):
    with running_server(smollm2, gateway=make_gateway()) as server:
        url = server.url
        teams = [
            httpx.post(f"{url}/admin/api/teams", json={"name": name}, headers=admin_headers()).json()
            for name in ("red", "blue", "green", "yellow")
        ]
        keys = [
            httpx.post(f"{url}/admin/api/keys", json={"team_id": team["id"]}, headers=admin_headers()).json()["key"]
            for team in teams
        ]
        red, blue, green, yellow = keys
        assert cached_tokens(url, red, "Do you sell helmets?") == 0
        assert cached_tokens(url, red, "Where is the shop?") > 100
        assert cached_tokens(url, blue, "Where is the shop?") == 0  # red's blocks are not blue's
        for team in teams[2:]:
            response = httpx.patch(
                f"{url}/admin/api/teams/{team['id']}", json={"cache_group": "partners"}, headers=admin_headers()
            )
            assert response.status_code == 200
        assert cached_tokens(url, green, "Do you repair bikes?") == 0
        assert cached_tokens(url, yellow, "Do you repair bikes?") > 100  # one cache group shares


def test_the_cli_creates_a_team_with_a_weight_and_cache_group(tmp_path, capsys):
    from app.cli.main import main
    from app.db import make_engine, session_factory
    from app.gateway import crud

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    assert main(["teams", "create", "heavy", "--weight", "4", "--cache-group", "docs", "--database-url", url]) == 0
    assert main(["teams", "create", "broken", "--weight", "0", "--database-url", url]) == 1
    with session_factory(make_engine(url))() as session:
        team = crud.get_team_by_name(session, name="heavy")
        assert (team.scheduling_weight, team.cache_group) == (4.0, "docs")
        assert crud.get_team_by_name(session, name="broken") is None
