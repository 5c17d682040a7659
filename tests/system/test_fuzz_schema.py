"""Schemathesis against our own OpenAPI schema: every /v1 and /admin/api operation with generated
parameters and bodies (valid keys sent), a bounded number of examples each, on a live server. No 5xx,
and every error in OpenAI's shape. The fake engine answers: these claims are about the app."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from app.gateway import crud
from app.gateway.audit import SYSTEM
from app.gateway.config import GatewayConfig
from app.gateway.service import TeamGateway
from tests.support.gateway import admin_headers, bearer, build_app, serve_in_thread

EXAMPLES = 30


def our_schema() -> dict:
    """The schema doesn't depend on the database: read it from an app whose gateway is never started."""
    return build_app(TeamGateway(GatewayConfig(database_url="sqlite://"))).openapi()


schema = schemathesis.openapi.from_dict(our_schema()).include(path_regex=r"^/(v1|admin/api)/")


@pytest.fixture
def live(make_gateway):
    gateway = make_gateway(auth_failures_per_minute=0)
    with gateway.sessions() as session:
        team = crud.create_team(session, actor=SYSTEM, name="fuzz")
        session.flush()
        _, team_key = crud.create_key(session, actor=SYSTEM, team=team)
        session.commit()
    with serve_in_thread(build_app(gateway)) as url:
        yield url, team_key


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_operation_answers_5xx_or_an_unshaped_error(case, live):
    url, team_key = live
    headers = admin_headers() if case.path.startswith("/admin/") else bearer(team_key)
    response = case.call(base_url=url, headers=headers, timeout=10)
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text


# What the fuzz found, pinned down: each was a 500.


def test_ids_and_limits_beyond_int64_are_refused_not_500(make_gateway):
    from fastapi.testclient import TestClient

    from tests.support.gateway import create_team

    gateway = make_gateway()
    huge = 2**80
    with TestClient(build_app(gateway)) as client:
        team = create_team(client)
        responses = [
            client.get(f"/admin/api/teams/{huge}", headers=admin_headers()),
            client.delete(f"/admin/api/keys/{huge}", headers=admin_headers()),
            client.patch(f"/admin/api/teams/{team['id']}", json={"rpm_limit": huge}, headers=admin_headers()),
            client.post("/admin/api/keys", json={"team_id": team["id"], "tpm_limit": huge}, headers=admin_headers()),
        ]
    for response in responses:
        assert response.status_code in (400, 404, 422), response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_null_for_a_field_that_must_hold_a_value_is_400(make_gateway):
    from fastapi.testclient import TestClient

    from tests.support.gateway import create_key, create_team

    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:
        team = create_team(client)
        key = create_key(client, team["id"])
        for path, body in (
            (f"/admin/api/teams/{team['id']}", {"blocked": None}),
            (f"/admin/api/teams/{team['id']}", {"name": None}),
            (f"/admin/api/keys/{key['id']}", {"name": None}),
        ):
            response = client.patch(path, json=body, headers=admin_headers())
            assert response.status_code == 400, response.text
        assert client.get(f"/admin/api/teams/{team['id']}", headers=admin_headers()).json()["blocked"] is False
