"""A key learns nothing about models it may not use: the access check answers first, in the words the
caller used; endpoints without a key say only what a load balancer needs; the API map is off by default."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.support.gateway import FAKE_MODEL, admin_headers, bearer, build_app, chat_body, create_key, create_team


@pytest.fixture
def database_url(tmp_path):
    return f"sqlite:///{tmp_path / 'tokenmill.db'}"


@pytest.fixture
def client(make_gateway, tmp_path):
    with TestClient(build_app(make_gateway())) as client:
        assert (
            client.patch(
                f"/admin/api/models/{FAKE_MODEL}", json={"aliases": ["friendly"]}, headers=admin_headers()
            ).status_code
            == 200
        )
        folder = tmp_path / "parked"  # registered, never loaded
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 8)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 512}))
        assert (
            client.post(
                "/admin/api/models", json={"name": "parked-secret", "path": str(folder)}, headers=admin_headers()
            ).status_code
            == 201
        )
        yield client


@pytest.fixture
def outsider(client) -> dict[str, str]:
    """A key of a team that may use one model only, and none of the above."""
    return bearer(create_key(client, create_team(client, "outsiders")["id"], allowed_models=["only-this"])["key"])


def assert_not_found_naming_only(response, asked: str) -> None:
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_found"
    assert error["message"] == f"The model `{asked}` does not exist or you do not have access to it."


def test_an_alias_the_key_may_not_use_does_not_name_the_model_behind_it(client, outsider):
    response = client.post("/v1/chat/completions", json=chat_body(model="friendly"), headers=outsider)
    assert_not_found_naming_only(response, "friendly")
    assert FAKE_MODEL not in response.text


def test_a_forbidden_model_looks_like_a_missing_one(client, outsider):
    forbidden = client.post("/v1/chat/completions", json=chat_body(model=FAKE_MODEL), headers=outsider)
    missing = client.post("/v1/chat/completions", json=chat_body(model="no-such-model"), headers=outsider)
    assert_not_found_naming_only(forbidden, FAKE_MODEL)
    assert_not_found_naming_only(missing, "no-such-model")


def test_the_embeddings_kind_check_comes_after_the_access_check(client, outsider):
    response = client.post("/v1/embeddings", json={"model": FAKE_MODEL, "input": "hi"}, headers=outsider)
    assert_not_found_naming_only(response, FAKE_MODEL)


def test_an_unloaded_model_the_key_may_not_use_is_a_404_not_a_503(client, outsider):
    for path, body in (
        ("/v1/chat/completions", chat_body(model="parked-secret")),
        ("/v1/completions", {"model": "parked-secret", "prompt": "hi"}),
        ("/v1/embeddings", {"model": "parked-secret", "input": "hi"}),
    ):
        assert_not_found_naming_only(client.post(path, json=body, headers=outsider), "parked-secret")


def test_a_key_that_may_use_it_still_hears_it_is_not_loaded(client):
    key = bearer(create_key(client, create_team(client, "insiders")["id"])["key"])
    response = client.post("/v1/chat/completions", json=chat_body(model="parked-secret"), headers=key)
    assert response.status_code == 503 and response.json()["error"]["code"] == "model_not_loaded"


def test_health_says_ok_and_nothing_else(client):
    response = client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_the_api_map_is_off_by_default(client):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert client.get(path).status_code == 404, path


def test_api_docs_turns_the_map_on(make_gateway):
    with TestClient(build_app(make_gateway(), api_docs=True)) as client:
        assert client.get("/openapi.json").status_code == 200
        assert client.get("/docs").status_code == 200
