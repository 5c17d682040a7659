"""POST /v1/embeddings on a real server (uvicorn in a thread) through the official openai client: both
encodings, order, token-id input, OpenAI-shaped errors, and usage metered into the gateway's rows."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest

from app.main import create_app
from app.settings import Settings
from tests.support.gateway import (
    FAKE_MODEL,
    FakeEngine,
    bearer,
    build_app,
    create_key,
    create_team,
    serve_in_thread,
    usage_rows,
)

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["The capital of France is Paris.", "Ünïcödé café 日本語 🚀", "a"]


def serve_embedder(app, embedder) -> None:
    """Make `embedder` a loaded embedding model of the app's registry (as if loaded from its wheel)."""
    from app.registry.served import ServedModel
    from app.registry.spec import ModelSpec

    spec = ModelSpec(
        name=embedder.name,
        kind="embedding",
        source="default",
        architecture="bert",
        max_model_len=embedder.max_input_tokens,
    )
    pool = app.state.context.models
    pool.specs[spec.name] = spec
    pool.served[spec.name] = ServedModel(spec, embedder=embedder, owned=False)


@pytest.fixture(scope="module")
def served_app(minilm):
    """A server without the gateway (its chat engine is a fake): (app, base URL, openai client)."""
    app = create_app(Settings(hardware_cost_per_hour=3.6), FakeEngine())
    serve_embedder(app, minilm)
    with serve_in_thread(app) as url:
        yield app, url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def server(served_app):
    """(base URL, openai client)."""
    return served_app[1:]


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)


def expected_vectors(minilm, texts) -> list[list[float]]:
    return minilm.encode(texts)[0].tolist()


def test_the_clients_default_base64_and_float_decode_to_the_same_vectors(server, minilm):
    _, client = server
    default = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    as_floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.embedding for d in default.data] == [d.embedding for d in as_floats.data]
    assert np.allclose([d.embedding for d in as_floats.data], expected_vectors(minilm, TEXTS), atol=1e-6)
    assert len(as_floats.data[0].embedding) == 384


def test_base64_is_little_endian_float32(server, minilm):
    _, client = server
    response = client.embeddings.create(model=MODEL, input="hello", encoding_format="base64")
    raw = response.data[0].embedding
    assert isinstance(raw, str)
    decoded = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert np.allclose(decoded, expected_vectors(minilm, ["hello"])[0], atol=1e-6)


def test_the_response_has_openais_shape_and_usage(server, minilm):
    url, _ = server
    body = post(url, {"model": MODEL, "input": TEXTS, "encoding_format": "float", "user": "someone"}).json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", i) for i in range(len(TEXTS))]
    tokens = sum(len(ids) for ids in minilm.token_ids(TEXTS))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_list_input_keeps_its_order(server):
    _, client = server
    texts = [f"text number {i}" + " more" * i for i in range(40)]  # lengths vary, so batches get sorted
    forward = client.embeddings.create(model=MODEL, input=texts).data
    backward = client.embeddings.create(model=MODEL, input=texts[::-1]).data
    assert [d.index for d in forward] == list(range(40))
    assert np.allclose([d.embedding for d in forward], [d.embedding for d in backward][::-1], atol=1e-6)


def test_token_ids_in_give_the_text_vectors(server, minilm):
    _, client = server
    ids = minilm.token_ids(TEXTS)
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float").data
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float").data
    expected = expected_vectors(minilm, TEXTS)
    assert np.allclose(one[0].embedding, expected[0], atol=1e-6)  # alone vs in a batch: padding moves the last bits
    assert np.allclose([d.embedding for d in many], expected, atol=1e-6)


def test_dimensions_equal_to_the_models_are_accepted(server):
    _, client = server
    assert len(client.embeddings.create(model=MODEL, input="x", dimensions=384).data[0].embedding) == 384


def test_other_dimensions_are_refused_clearly(server):
    _, client = server
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input="x", dimensions=128)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "dimensions" and "384" in caught.value.body["message"]


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"input": ""}, "input", None),
        ({"input": []}, "input", None),
        ({"input": ["fine", ""]}, "input", None),
        ({"input": [[]]}, "input", None),
        ({"input": ["x"] * 2049}, "input", None),
        ({"input": "long " * 300}, "input", "context_length_exceeded"),
        ({"input": [[101, 40_000_000, 102]]}, "input", None),
        ({"input": [[101, -1, 102]]}, "input", None),
        ({"input": [1.5]}, "input", None),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", None),
        ({"input": "x", "dimensions": "384"}, "dimensions", None),
        ({}, "input", None),
    ],
)
def test_bad_input_gets_an_openai_shaped_400(server, body, param, code):
    url, _ = server
    response = post(url, {"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert error["message"]


def test_an_unknown_model_is_404(server):
    url, _ = server
    response = post(url, {"model": "no-such-model", "input": "x"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_a_chat_model_is_not_an_embedding_model(server):
    url, _ = server
    response = post(url, {"model": FAKE_MODEL, "input": "x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


def test_concurrent_requests_each_get_their_own_vectors(server, minilm):
    url, _ = server
    texts = [f"request {i}: " + "word " * (i * 13 % 60) for i in range(12)]

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        responses = await asyncio.gather(*(client.embeddings.create(model=MODEL, input=[text]) for text in texts))
        await client.close()
        return [r.data[0].embedding for r in responses]

    got = asyncio.run(run())
    assert np.allclose(got, expected_vectors(minilm, texts), atol=1e-5)


def test_embedding_tokens_count_in_the_real_cost_per_token(served_app, minilm):
    app, _, client = served_app
    meter = app.state.context.cost_meter
    before = meter.snapshot()["windows"]["hour"]["models"].get(MODEL, {}).get("tokens", 0)
    response = client.embeddings.create(model=MODEL, input=TEXTS)
    hour = meter.snapshot()["windows"]["hour"]["models"][MODEL]
    assert hour["tokens"] - before == response.usage.prompt_tokens
    assert hour["usd_per_1m_tokens"] > 0


@pytest.fixture
def gateway(make_gateway):  # the fixture imported above
    """The real gateway on a fresh database (SQLite, then PostgreSQL)."""
    return make_gateway()


@pytest.fixture
def metered_server(gateway, minilm):
    """(base URL, a team key) of a server behind the real gateway."""
    app = build_app(gateway)
    serve_embedder(app, minilm)
    with serve_in_thread(app) as url:
        admin = httpx.Client(base_url=url)
        yield url, create_key(admin, create_team(admin)["id"])


def test_embeddings_are_metered_into_a_usage_row(metered_server, gateway):
    url, key = metered_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key["key"], max_retries=0)
    response = client.embeddings.create(model=MODEL, input=TEXTS)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).embeddings.create(model=MODEL, input="x")
    [row] = usage_rows(gateway)
    assert (row.model, row.key_id, row.status) == (MODEL, key["id"], "ok")
    assert row.prompt_tokens == response.usage.prompt_tokens > 0 and row.completion_tokens == 0


def test_an_over_long_input_is_a_rejected_row_without_tokens(metered_server, gateway):
    url, key = metered_server
    response = httpx.post(
        f"{url}/v1/embeddings", json={"model": MODEL, "input": "long " * 300}, headers=bearer(key["key"])
    )
    assert response.status_code == 400
    [row] = usage_rows(gateway)
    assert (row.status, row.prompt_tokens) == ("rejected", 0)


def test_embeddings_are_held_to_the_teams_budget_like_any_request(make_gateway, minilm):
    """Concurrent embeddings together never pass the team's budget, and a team at its budget gets 429."""
    from app.gateway.config import parse_prices

    gateway = make_gateway(prices=parse_prices({"*": [1000.0, 0.0, 0.0]}))  # $0.001 per input token
    app = build_app(gateway)
    serve_embedder(app, minilm)
    text = "The capital of France is Paris."
    [ids] = minilm.token_ids([text])
    tokens = len(ids)
    with serve_in_thread(app) as url:
        admin = httpx.Client(base_url=url)
        team = create_team(admin, max_budget_usd=round(2.5 * tokens * 0.001, 9))  # room for two requests
        key = create_key(admin, team["id"])["key"]

        async def together(count: int) -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": MODEL, "input": text}
                return await asyncio.gather(
                    *(client.post(f"{url}/v1/embeddings", json=body, headers=bearer(key)) for _ in range(count))
                )

        first = asyncio.run(together(6))
        [late] = asyncio.run(together(1))
    assert sorted(r.status_code for r in first) == [200, 200, 429, 429, 429, 429]
    assert all(r.json()["usage"]["prompt_tokens"] == tokens for r in first if r.status_code == 200)
    assert late.status_code == 429 and late.json()["error"]["code"] == "insufficient_quota"
    spent = sum(row.cost_nano_usd for row in usage_rows(gateway)) / 1e9
    assert spent == pytest.approx(2 * tokens * 0.001)
