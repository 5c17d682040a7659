"""Usage metering: rows match what the client was told (whole, streamed, aborted), errors are rows too,
roll-ups agree with rows, reports and CSV, last-used batching, a database outage loses nothing."""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime

import httpx
from fastapi.testclient import TestClient
from sqlalchemy import event, func, select, text

from app.gateway import usage as usage_module
from app.gateway.usage import UsageEvent
from app.tables import ApiKey, UsageDaily, UsageRow
from tests.support.gateway import (
    FAKE_MODEL,
    FakeEngine,
    admin_headers,
    bearer,
    build_app,
    chat_body,
    create_key,
    create_team,
    prompt_tokens_of,
    serve_in_thread,
    usage_rows,
)


def test_non_streamed_usage_row_matches_the_response(make_gateway):
    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:
        key = create_key(client, create_team(client)["id"])
        response = client.post(
            "/v1/chat/completions", json=chat_body("say hello world", max_tokens=7), headers=bearer(key["key"])
        )
    usage = response.json()["usage"]
    [row] = usage_rows(gateway)
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
    )
    assert (row.status, row.model, row.key_id) == ("ok", FAKE_MODEL, key["id"])
    assert row.latency_ms >= 0 and row.ttft_ms is not None


def read_stream(response: httpx.Response) -> tuple[list[dict], dict | None]:
    chunks, usage = [], None
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            payload = json.loads(line[6:])
            if payload.get("usage"):
                usage = payload["usage"]
            elif payload["choices"] and payload["choices"][0]["delta"].get("content"):
                chunks.append(payload)
    return chunks, usage


def test_streamed_usage_row_matches_the_usage_chunk(make_gateway):
    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:
        key = create_key(client, create_team(client)["id"])
        body = chat_body(max_tokens=9, stream=True, stream_options={"include_usage": True})
        with client.stream("POST", "/v1/chat/completions", json=body, headers=bearer(key["key"])) as response:
            chunks, usage = read_stream(response)
    [row] = usage_rows(gateway)
    assert len(chunks) == 9 == usage["completion_tokens"] == row.completion_tokens
    assert row.prompt_tokens == usage["prompt_tokens"] == prompt_tokens_of("say hello")
    assert row.status == "ok"


def test_aborted_stream_is_billed_for_what_was_produced(make_gateway):
    gateway = make_gateway()
    engine = FakeEngine(token_delay_s=0.05)
    with serve_in_thread(build_app(gateway, engine)) as url, httpx.Client(base_url=url, timeout=30) as client:
        key = create_key(client, create_team(client)["id"])
        body = chat_body(max_tokens=100, stream=True)
        received = 0
        with client.stream("POST", "/v1/chat/completions", json=body, headers=bearer(key["key"])) as response:
            for line in response.iter_lines():
                if '"content":" tok"' in line:
                    received += 1
                if received == 4:
                    break  # closing the response drops the connection mid-stream
        deadline = time.monotonic() + 10
        while not (rows := usage_rows(gateway)) and time.monotonic() < deadline:
            time.sleep(0.05)
    [row] = rows
    assert row.status == "aborted"
    assert received <= row.completion_tokens <= received + 10  # what the engine made before it heard
    assert row.prompt_tokens == prompt_tokens_of("say hello")
    assert engine.aborted  # and the engine was told to stop


def test_requests_refused_after_admission_are_rows_too(make_gateway):
    gateway = make_gateway()
    engine = FakeEngine()
    with TestClient(build_app(gateway, engine)) as client:
        key = create_key(client, create_team(client)["id"], allowed_models=["other"])
        open_key = create_key(client, create_team(client, "b")["id"])
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key["key"])).status_code == 404
        engine.queue_full = True
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(open_key["key"])).status_code == 503
        gateway.writer.flush()
        report = client.get("/admin/api/usage", params={"group_by": "key"}, headers=admin_headers()).json()
    rows = usage_rows(gateway)
    assert sorted((r.key_id, r.status) for r in rows) == [(key["id"], "forbidden"), (open_key["id"], "rejected")]
    assert [(r["key_id"], r["requests"], r["errors"]) for r in report["data"]] == [
        (key["id"], 1, 1),
        (open_key["id"], 1, 1),
    ]


def test_rollup_agrees_with_rows_and_reports_group_and_filter(make_gateway):
    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:
        team_a, team_b = create_team(client, "a"), create_team(client, "b")
        key_a1, key_a2, key_b = (create_key(client, t["id"]) for t in (team_a, team_a, team_b))
        for key, tokens in ((key_a1, 2), (key_a1, 3), (key_a2, 4), (key_b, 5)):
            assert (
                client.post(
                    "/v1/chat/completions", json=chat_body(max_tokens=tokens), headers=bearer(key["key"])
                ).status_code
                == 200
            )
        gateway.writer.flush()
        by_team = client.get("/admin/api/usage", params={"group_by": "team"}, headers=admin_headers()).json()
        by_key = client.get(
            "/admin/api/usage", params={"group_by": "key", "team_id": team_a["id"]}, headers=admin_headers()
        ).json()
        by_day_model = client.get("/admin/api/usage", params={"group_by": "day,model"}, headers=admin_headers()).json()
        last_hour = client.get(
            "/admin/api/usage",
            headers=admin_headers(),
            params={"group_by": "team", "since": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() - 3600))},
        ).json()
    assert [(r["team_name"], r["requests"], r["completion_tokens"]) for r in by_team["data"]] == [
        ("a", 3, 9),
        ("b", 1, 5),
    ]
    assert [(r["key_id"], r["completion_tokens"]) for r in by_key["data"]] == [(key_a1["id"], 5), (key_a2["id"], 4)]
    assert [(r["model"], r["requests"]) for r in by_day_model["data"]] == [(FAKE_MODEL, 4)]
    assert by_day_model["data"][0]["day"] == time.strftime("%Y-%m-%d", time.gmtime())
    assert last_hour["data"] == by_team["data"]  # partial-day range: read from the rows, same answer
    with gateway.sessions() as session:
        rows = session.execute(select(func.count(), func.sum(UsageRow.completion_tokens))).one()
        rollup = session.execute(select(func.sum(UsageDaily.requests), func.sum(UsageDaily.completion_tokens))).one()
    assert tuple(rows) == tuple(rollup) == (4, 14)


def test_usage_csv_both_ways(make_gateway):
    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:
        key = create_key(client, create_team(client, "acme")["id"])
        client.post("/v1/chat/completions", json=chat_body(max_tokens=3), headers=bearer(key["key"]))
        gateway.writer.flush()
        as_param = client.get(
            "/admin/api/usage", params={"format": "csv", "group_by": "team,model"}, headers=admin_headers()
        )
        as_path = client.get("/admin/api/usage.csv", params={"group_by": "team,model"}, headers=admin_headers())
        team_csv = client.get("/v1/usage", params={"format": "csv"}, headers=bearer(key["key"]))
    assert as_param.headers["content-type"].startswith("text/csv")
    assert as_param.text == as_path.text
    header, line = as_param.text.strip().splitlines()
    assert header == (
        "team_id,team_name,model,requests,errors,prompt_tokens,cached_tokens,completion_tokens,total_tokens,cost_usd"
    )
    assert line.split(",")[1:4] == ["acme", FAKE_MODEL, "1"]
    assert team_csv.text.splitlines()[0].startswith("day,requests")


def test_usage_request_rows_and_lists_are_paginated(make_gateway):
    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:
        teams = [create_team(client, f"t{i}") for i in range(5)]
        page1 = client.get("/admin/api/teams", params={"limit": 2}, headers=admin_headers()).json()
        page2 = client.get(
            "/admin/api/teams", params={"limit": 2, "after": page1["last_id"]}, headers=admin_headers()
        ).json()
        page3 = client.get(
            "/admin/api/teams", params={"limit": 2, "after": page2["last_id"]}, headers=admin_headers()
        ).json()
        assert [t["name"] for t in page1["data"] + page2["data"] + page3["data"]] == [t["name"] for t in teams]
        assert (page1["has_more"], page2["has_more"], page3["has_more"]) == (True, True, False)
        key = create_key(client, teams[0]["id"])
        for _ in range(3):
            client.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers=bearer(key["key"]))
        gateway.writer.flush()
        newest = client.get("/admin/api/usage/requests", params={"limit": 2}, headers=admin_headers()).json()
        older = client.get(
            "/admin/api/usage/requests", params={"limit": 2, "before": newest["last_id"]}, headers=admin_headers()
        ).json()
    assert newest["has_more"] and not older["has_more"]
    assert len(newest["data"]) + len(older["data"]) == 3
    assert newest["data"][0]["id"] > newest["data"][1]["id"] > older["data"][0]["id"]


def test_last_used_is_written_in_batches_not_per_request(make_gateway):
    gateway = make_gateway(last_used_flush_s=3600)
    updates = []

    @event.listens_for(gateway.engine, "before_cursor_execute")
    def count(conn, cursor, statement, *args):
        if statement.lstrip().upper().startswith("UPDATE API_KEYS"):
            updates.append(statement)

    with TestClient(build_app(gateway)) as client:
        key = create_key(client, create_team(client)["id"])
        for _ in range(20):
            client.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers=bearer(key["key"]))
        usage_rows(gateway)
        assert updates == []  # 20 requests, rows written, last-used not due yet
    gateway.stop()  # shutdown writes it
    assert len(updates) == 1
    with gateway.sessions() as session:
        assert session.scalar(select(ApiKey.last_used_at)) is not None


def make_event(key_id: int = 1, team_id: int = 1, tokens: int = 1) -> UsageEvent:
    return UsageEvent(
        created_at=datetime.now(UTC).replace(tzinfo=None),
        team_id=team_id,
        key_id=key_id,
        model=FAKE_MODEL,
        prompt_tokens=1,
        cached_tokens=0,
        completion_tokens=tokens,
        latency_ms=1,
        ttft_ms=1,
        status="ok",
        cost_nano_usd=0,
    )


def test_writer_keeps_rows_while_the_database_is_down_and_retries(make_gateway, monkeypatch):
    gateway = make_gateway()
    real_write = usage_module.write_batch
    failures = {"left": 3}

    def flaky(*args, **kwargs):
        if failures["left"] > 0:
            failures["left"] -= 1
            raise ConnectionError("database is down")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(usage_module, "write_batch", flaky)
    for i in range(50):
        gateway.writer.submit(make_event(tokens=i))
    assert gateway.writer.flush(timeout=30)
    assert failures["left"] == 0 and gateway.writer.failures == 3
    with gateway.sessions() as session:
        assert session.scalar(select(func.count()).select_from(UsageRow)) == 50
        assert session.scalar(select(func.sum(UsageDaily.completion_tokens))) == sum(range(50))


def test_rows_still_unwritten_at_shutdown_are_spilled_and_replayed(make_gateway, monkeypatch):
    gateway = make_gateway()
    monkeypatch.setattr(usage_module, "write_batch", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("down")))
    for _ in range(7):
        gateway.writer.submit(make_event())
    gateway.writer.close(timeout=0.3)
    gateway.started = False
    spilled = list(gateway.writer.spill_dir.glob("usage-spill-*.jsonl"))
    assert len(spilled) == 1 and len(spilled[0].read_text().splitlines()) == 7
    monkeypatch.undo()
    again = make_gateway()  # the next start replays the file, then removes it
    with again.sessions() as session:
        assert session.scalar(select(func.count()).select_from(UsageRow)) == 7
    assert not list(again.writer.spill_dir.glob("usage-spill-*"))


def test_a_real_postgresql_outage_loses_no_row(pg_session_url, tmp_path):
    from tests.support.gateway import new_gateway, reset_pg

    database_url = pg_session_url
    reset_pg(database_url)
    gateway = new_gateway(database_url, tmp_path)
    name = database_url.rsplit("/", 1)[1]
    with TestClient(build_app(gateway)) as client:
        key = create_key(client, create_team(client)["id"])
        client.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers=bearer(key["key"]))
        usage_rows(gateway)
        admin = __import__("sqlalchemy").create_engine(
            database_url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT"
        )
        with admin.connect() as c:
            c.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
            c.execute(text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"))
        try:
            for _ in range(10):  # keys are cached: requests go on while the database is away
                assert (
                    client.post(
                        "/v1/chat/completions", json=chat_body(max_tokens=2), headers=bearer(key["key"])
                    ).status_code
                    == 200
                )
            time.sleep(0.5)
            assert gateway.writer.failures > 0 and gateway.writer.pending == 10
        finally:
            with admin.connect() as c:
                c.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
            admin.dispose()
        rows = usage_rows(gateway)
    gateway.stop()
    gateway.engine.dispose()
    assert len(rows) == 11 and sum(r.completion_tokens for r in rows) == 21


def test_no_plaintext_key_in_any_log_line(make_gateway, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    gateway = make_gateway()
    engine = FakeEngine()
    with (
        serve_in_thread(build_app(gateway, engine), log_level="debug", access_log=True) as url,
        httpx.Client(base_url=url) as client,
    ):
        key = create_key(client, create_team(client)["id"], rpm_limit=2)
        for _ in range(3):
            client.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers=bearer(key["key"]))
        client.delete(f"/admin/api/keys/{key['id']}", headers=admin_headers())
        client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key["key"]))
        client.get("/v1/usage", headers=bearer(key["key"]))
    out, err = capfd.readouterr()
    logged = caplog.text + out + err
    assert "POST /v1/chat/completions" in logged  # the access log was on
    assert key["key"] not in logged and key["key"][len(key["key_prefix"]) :] not in logged
