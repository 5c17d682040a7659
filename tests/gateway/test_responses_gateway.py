"""Stored responses with the real gateway, on SQLite and PostgreSQL: owned by the team whose key made
them, metered like chat, nothing stored for a refused request, expired rows pruned."""

from __future__ import annotations

import dataclasses
import json
import time

import httpx
import openai
import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from app.db import make_engine, migrate, session_factory
from app.serving.responses.store import SqlResponseStore
from app.tables import StoredResponse, StoredResponseItem
from engine.outputs import RequestOutput, SequenceDelta
from tests.support.gateway import (
    FAKE_MODEL,
    FakeClock,
    FakeEngine,
    admin_headers,
    bearer,
    build_app,
    create_key,
    create_team,
    serve_in_thread,
    usage_rows,
)
from tests.support.server import MODEL, running_server


def team_key(url: str, name: str) -> dict:
    team = httpx.post(f"{url}/admin/api/teams", json={"name": name}, headers=admin_headers()).json()
    key = httpx.post(f"{url}/admin/api/keys", json={"team_id": team["id"]}, headers=admin_headers()).json()
    return {"team_id": team["id"], "key": key["key"]}


def stored_counts(gateway) -> tuple[int, int]:
    with gateway.sessions() as session:
        return (
            session.scalar(select(func.count()).select_from(StoredResponse)),
            session.scalar(select(func.count()).select_from(StoredResponseItem)),
        )


@pytest.mark.real_model
def test_a_stored_response_is_its_teams_alone_and_metered_like_chat(smollm2, make_gateway):
    gateway = make_gateway()
    with running_server(smollm2, gateway=gateway) as server:
        alpha, beta = team_key(server.url, "alpha"), team_key(server.url, "beta")
        mine, theirs = server.client(api_key=alpha["key"]), server.client(api_key=beta["key"])
        first = mine.responses.create(
            model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=12
        )
        second = mine.responses.create(
            model=MODEL, input="And of Italy?", previous_response_id=first.id, temperature=0, max_output_tokens=12
        )
        assert second.usage.input_tokens_details.cached_tokens > 0
        assert stored_counts(gateway) == (2, 1 + 1)  # each turn holds its own input; the chain has the rest (#44)
        for attempt in (
            lambda: theirs.responses.retrieve(first.id),
            lambda: theirs.responses.delete(first.id),
            lambda: theirs.responses.input_items.list(first.id),
        ):
            with pytest.raises(openai.NotFoundError):
                attempt()
        with pytest.raises(openai.NotFoundError) as hidden:
            theirs.responses.create(model=MODEL, input="Continue.", previous_response_id=first.id)
        assert hidden.value.body["param"] == "previous_response_id"
        assert mine.responses.retrieve(first.id).output_text == first.output_text
        rows = usage_rows(gateway)
    assert [(row.team_id, row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.status) for row in rows] == [
        (
            alpha["team_id"],
            r.usage.input_tokens,
            r.usage.input_tokens_details.cached_tokens,
            r.usage.output_tokens,
            "ok",
        )
        for r in (first, second)
    ]


@pytest.mark.real_model
def test_refused_requests_store_nothing(smollm2, make_gateway):
    gateway = make_gateway()
    with running_server(smollm2, gateway=gateway) as server:
        key = team_key(server.url, "alpha")["key"]
        first = server.client(api_key=key).responses.create(
            model=MODEL, input="Hi!", temperature=0, max_output_tokens=4
        )
        before = stored_counts(gateway)
        bad_inputs = [
            {"input": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]},
            {
                "input": [{"type": "function_call_output", "call_id": "call_unknown", "output": "1"}],
                "previous_response_id": first.id,
            },
            {"input": "hi", "previous_response_id": "resp_does_not_exist"},
            {"input": "hi " * 9000},  # longer than the context
            {"input": [{"type": "message", "role": "user"}]},
        ]
        statuses = [
            httpx.post(
                f"{server.base_url}/responses", json={"model": MODEL, **body}, headers=bearer(key), timeout=60
            ).status_code
            for body in bad_inputs
        ]
        assert stored_counts(gateway) == before
    assert all(400 <= status < 500 for status in statuses), statuses


def test_expired_responses_are_pruned(database_url):
    engine = make_engine(database_url)
    migrate(engine)
    clock = FakeClock()
    store = SqlResponseStore(session_factory(engine), retention_s=3600, clock=clock)
    item = {
        "id": "msg_1",
        "type": "message",
        "role": "user",
        "status": "completed",
        "content": [{"type": "input_text", "text": "hi"}],
    }
    store.save(7, {"id": "resp_old", "model": MODEL, "output": []}, [item])
    clock.advance(1800)
    store.save(7, {"id": "resp_new", "model": MODEL, "output": []}, [item])
    clock.advance(1801)
    assert store.get("resp_old", 7) is None  # expired: gone for readers before the pruner runs
    assert store.get("resp_new", 7).input_items == [item]
    assert store.get("resp_new", 8) is None
    assert store.prune() == 1
    with engine.connect() as connection:
        assert connection.scalar(select(func.count()).select_from(StoredResponseItem)) == 1
        assert list(connection.scalars(select(StoredResponse.id))) == ["resp_new"]
    engine.dispose()


class FailingEngine(FakeEngine):
    """Writes two tokens, then its step fails."""

    async def generate(self, request_id: str, prompt_token_ids: list[int], params, tenancy=None, capacity=True):
        yield RequestOutput(request_id, len(prompt_token_ids), 0, [SequenceDelta(0, " tok", [3], None, None)])
        yield RequestOutput(request_id, len(prompt_token_ids), 0, [SequenceDelta(0, " tok", [3], None, None)])
        raise RuntimeError("the engine step failed")


def stream_events(client: httpx.Client, key: str, stop_after_deltas: int | None = None, **body) -> list[dict]:
    events = []
    with client.stream(
        "POST",
        "/v1/responses",
        headers=bearer(key),
        json={"model": FAKE_MODEL, "input": "say hello", "stream": True, **body},
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                deltas = sum(event["type"] == "response.output_text.delta" for event in events)
                if stop_after_deltas is not None and deltas == stop_after_deltas:
                    break  # closing the response drops the connection mid-stream
    return events


def wait_for_rows(gateway) -> list:
    deadline = time.monotonic() + 10
    while not (rows := usage_rows(gateway)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return rows


def test_a_failing_engine_ends_the_stream_with_response_failed(make_gateway):
    gateway = make_gateway()
    with serve_in_thread(build_app(gateway, FailingEngine())) as url, httpx.Client(base_url=url, timeout=30) as client:
        key = create_key(client, create_team(client)["id"])["key"]
        events = stream_events(client, key)
        rows = wait_for_rows(gateway)
    assert [event["type"] for event in events][-1] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "server_error"
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert stored_counts(gateway) == (0, 0)
    [row] = rows
    assert (row.status, row.completion_tokens) == ("error", 2)


def test_a_client_gone_mid_stream_aborts_and_stores_nothing(make_gateway):
    gateway = make_gateway()
    engine = FakeEngine(token_delay_s=0.05)
    with serve_in_thread(build_app(gateway, engine)) as url, httpx.Client(base_url=url, timeout=30) as client:
        key = create_key(client, create_team(client)["id"])["key"]
        events = stream_events(client, key, stop_after_deltas=3, max_output_tokens=100)
        rows = wait_for_rows(gateway)
    assert events[0]["type"] == "response.created"
    [row] = rows
    assert row.status == "aborted" and 3 <= row.completion_tokens < 100
    assert engine.aborted == [events[0]["response"]["id"]]
    assert stored_counts(gateway) == (0, 0)


class AwayStore:
    """A response store whose database does not answer."""

    def __getattr__(self, name: str):
        def unavailable(*args, **kwargs):
            raise OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))

        return unavailable


def test_a_store_that_is_away_is_a_503_to_retry(make_gateway):
    gateway = make_gateway()
    app = build_app(gateway, FakeEngine())
    app.state.context = dataclasses.replace(app.state.context, responses=AwayStore())
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        key = create_key(client, create_team(client)["id"])["key"]
        whole = client.post("/v1/responses", headers=bearer(key), json={"model": FAKE_MODEL, "input": "say hi"})
        read = client.get("/v1/responses/resp_x", headers=bearer(key))
        events = stream_events(client, key)
    for reply in (whole, read):
        assert reply.status_code == 503 and reply.headers["retry-after"] == "2"
        assert reply.json()["error"]["code"] == "service_unavailable"
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "service_unavailable"
