"""The Files and Batch APIs through the official openai client, over the real gateway (SQLite and
PostgreSQL) and the fake engine: upload -> create -> poll -> download, malformed lines, team isolation,
cancel, expiry, restart, limits and metering."""

from __future__ import annotations

import io
import time
from datetime import timedelta

import openai
import pytest
from openai.types import FileObject

from app.batches.jobs import BatchStore
from app.batches.runner import BATCH_PRIORITY
from app.gateway.config import parse_prices
from tests.support.batches import (
    StoppableEngine,
    download,
    jsonl,
    line,
    serving,
    submit,
    team_client,
    wait_for,
)
from tests.support.gateway import FAKE_MODEL, FakeEngine, chat_body, usage_rows


def test_upload_create_poll_download(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        client = team_client(http)
        uploaded = client.files.create(
            file=("in.jsonl", io.BytesIO(jsonl([line("a"), line("b", max_tokens=2)]))), purpose="batch"
        )
        assert isinstance(uploaded, FileObject) and uploaded.purpose == "batch" and uploaded.bytes > 0
        assert [f.id for f in client.files.list()] == [uploaded.id]
        assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
        created = client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"job": "nightly"},
        )
        assert created.status in ("validating", "in_progress") and created.request_counts.total == 2
        batch = wait_for(client, created.id)
        assert batch.status == "completed", batch
        assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 0)
        assert batch.error_file_id is None and batch.metadata == {"job": "nightly"}
        assert batch.completed_at and batch.in_progress_at and batch.finalizing_at
        outputs = {o["custom_id"]: o for o in download(client, batch.output_file_id)}
        assert set(outputs) == {"a", "b"}
        assert outputs["b"]["response"]["status_code"] == 200
        assert outputs["b"]["response"]["body"]["choices"][0]["message"]["content"] == " tok tok"
        assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
        assert [b.id for b in client.batches.list()] == [created.id]
        assert client.files.delete(uploaded.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(uploaded.id)


def test_malformed_lines_go_to_the_error_file_and_the_rest_run(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        client = team_client(http)
        lines = [
            line("good"),
            b"{not json",
            {"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"},
            line("wrong-url", url="/v1/embeddings"),
            line("good"),  # a custom_id used twice
            {**line("bad-body"), "body": {"model": FAKE_MODEL, "messages": "not a list"}},
            {**line("no-model"), "body": chat_body(model="no-such-model")},
        ]
        batch = wait_for(client, submit(client, lines).id)
        assert batch.status == "completed"
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (7, 1, 6)
        assert [o["custom_id"] for o in download(client, batch.output_file_id)] == ["good"]
        errors = download(client, batch.error_file_id)
        assert [e["custom_id"] for e in errors] == [None, "no-body", "wrong-url", "good", "bad-body", "no-model"]
        assert all(e["error"]["code"] and e["error"]["message"] for e in errors)
        by_id = {e["custom_id"]: e for e in errors}
        assert by_id["bad-body"]["response"]["status_code"] == 400  # judged by the chat route itself
        assert by_id["bad-body"]["response"]["body"]["error"]["param"].startswith("messages")
        assert by_id["no-model"]["response"]["status_code"] == 404
        assert by_id["no-model"]["error"]["code"] == "model_not_found"


def test_each_team_sees_only_its_own_files_and_batches(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        alpha, beta = team_client(http, "alpha"), team_client(http, "beta")
        batch = wait_for(alpha, submit(alpha, [line("a")]).id)
        for attempt in (
            lambda: beta.files.retrieve(batch.input_file_id),
            lambda: beta.files.content(batch.output_file_id),
            lambda: beta.files.delete(batch.input_file_id),
            lambda: beta.batches.retrieve(batch.id),
            lambda: beta.batches.cancel(batch.id),
            lambda: beta.batches.create(
                input_file_id=batch.input_file_id, endpoint="/v1/chat/completions", completion_window="24h"
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert list(beta.files.list()) == [] and list(beta.batches.list()) == []
        assert alpha.files.retrieve(batch.input_file_id).id == batch.input_file_id


def test_cancel_mid_way_stops_feeding_and_writes_the_partial_output(make_gateway, tmp_path):
    engine = FakeEngine(token_delay_s=0.02)
    with serving(make_gateway(), tmp_path, engine, batch_max_in_flight=1) as http:
        client = team_client(http)
        created = submit(client, [line(f"r{i}", max_tokens=5) for i in range(12)])
        wait_for(client, created.id, until=lambda b: b.request_counts.completed >= 2)
        cancelling = client.batches.cancel(created.id)
        assert cancelling.status in ("cancelling", "cancelled")
        batch = wait_for(client, created.id)
        assert batch.status == "cancelled" and batch.cancelled_at
        done = [o["custom_id"] for o in download(client, batch.output_file_id)]
        skipped = download(client, batch.error_file_id)
        assert 2 <= len(done) < 12
        assert sorted(done + [e["custom_id"] for e in skipped], key=lambda c: int(c[1:])) == [
            f"r{i}" for i in range(12)
        ]
        assert {e["error"]["code"] for e in skipped} == {"batch_cancelled"}
        assert len(engine.tenancies) == len(done)  # nothing past the cancel reached the engine
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(wait_for(client, submit(client, [line("x")]).id).id)


def test_cancel_aborts_the_lines_in_flight_and_bills_the_tokens_they_made(make_gateway, tmp_path):
    gateway = make_gateway()
    engine = StoppableEngine(token_delay_s=0.02)
    with serving(gateway, tmp_path, engine, batch_max_in_flight=3) as http:
        client = team_client(http)
        created = submit(client, [line(f"r{i}", max_tokens=500) for i in range(6)])  # 10 s a line if let run
        deadline = time.monotonic() + 10
        while len(engine.running) < 3:
            assert time.monotonic() < deadline, "the batch never filled its seats"
            time.sleep(0.01)
        time.sleep(0.2)  # each line in flight has made some tokens
        started = time.monotonic()
        assert client.batches.cancel(created.id).status == "cancelling"
        batch = wait_for(client, created.id)
        assert time.monotonic() - started < 5  # not the ~10 s the lines in flight had left
        assert batch.status == "cancelled" and batch.cancelling_at and batch.cancelled_at
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (6, 0, 6)
        assert batch.output_file_id is None
        errors = {e["custom_id"]: e for e in download(client, batch.error_file_id)}
    assert sorted(errors) == [f"r{i}" for i in range(6)]
    assert len(engine.aborted) == 3 and not engine.running  # the engine stopped every line in flight
    cut = [e for e in errors.values() if e["response"] is not None]
    assert {e["custom_id"] for e in cut} == {"r0", "r1", "r2"}
    assert all(e["error"]["code"] == "batch_cancelled" and e["response"]["status_code"] == 499 for e in cut)
    made = sorted(e["response"]["body"]["usage"]["completion_tokens"] for e in cut)
    assert 0 < made[0] and made[-1] < 500
    never_ran = [e for e in errors.values() if e["response"] is None]
    assert {e["error"]["code"] for e in never_ran} == {"batch_cancelled"}
    rows = [row for row in usage_rows(gateway) if row.batch]  # metered once each, as far as they got
    assert sorted(row.completion_tokens for row in rows) == made
    assert {row.status for row in rows} == {"aborted"}


def test_a_restart_resumes_without_redoing_or_losing_a_line(make_gateway, tmp_path):
    gateway = make_gateway()
    first = FakeEngine(token_delay_s=0.02)
    with serving(gateway, tmp_path, first, batch_max_in_flight=2) as http:
        client = team_client(http)
        created = submit(client, [line(f"r{i}", content=f"line {i}", max_tokens=5) for i in range(10)])
        wait_for(client, created.id, until=lambda b: b.request_counts.completed >= 3)
    # The server stopped mid-batch; the lines in flight were dropped unrecorded. As if it had been killed
    # instead, its lease is still held for a moment: the next server waits it out, then resumes.
    BatchStore(gateway.sessions).renew(created.id, "killed-process", timedelta(seconds=1))
    second = FakeEngine()
    with serving(make_gateway(), tmp_path, second) as http:
        client.__init__(base_url=f"{http.base_url}/v1", api_key=client.api_key, http_client=http, max_retries=0)
        batch = wait_for(client, created.id)
        assert batch.status == "completed" and batch.request_counts.completed == 10
        done = [o["custom_id"] for o in download(client, batch.output_file_id)]
    assert sorted(done) == sorted(f"r{i}" for i in range(10))  # each once: none lost, none twice
    assert len(first.tenancies) + len(second.tenancies) - 10 <= 2  # only lines in flight at the stop ran twice
    assert 0 < len(second.tenancies) < 10


def test_a_batch_past_its_completion_window_expires(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path, FakeEngine(token_delay_s=0.05), batch_max_in_flight=1) as http:
        client = team_client(http)
        batch = wait_for(client, submit(client, [line(f"r{i}", max_tokens=10) for i in range(20)], window="1s").id)
        assert batch.status == "expired" and batch.expired_at
        counts = batch.request_counts
        assert counts.completed < 20 and counts.completed + counts.failed == 20
        assert {e["error"]["code"] for e in download(client, batch.error_file_id)} == {"batch_expired"}


def test_limits_are_clear_400s(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path, max_file_bytes=2000, max_batch_lines=3) as http:
        client = team_client(http)
        with pytest.raises(openai.BadRequestError, match="larger than the 2000 bytes"):
            client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 2001)), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="purpose"):
            client.files.create(file=("a.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError, match="at most 3"):
            submit(client, [line(f"r{i}") for i in range(4)])
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            submit(client, [line("a")], window="soon")
        note = client.files.create(file=("notes.txt", io.BytesIO(b"hello")), purpose="user_data")
        with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
            client.batches.create(input_file_id=note.id, endpoint="/v1/chat/completions", completion_window="24h")
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            client.batches.create(
                input_file_id=note.id,
                endpoint="/v1/moderations",  # type: ignore[arg-type]
                completion_window="24h",
            )
        too_big = http.post(
            "/v1/files",
            content=b"x" * 200_000,
            headers={"Authorization": f"Bearer {client.api_key}", "Content-Type": "multipart/form-data; boundary=x"},
        )
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"


def test_batch_lines_are_metered_at_the_batch_price_outside_the_interactive_limits(make_gateway, tmp_path):
    gateway = make_gateway(prices=parse_prices({FAKE_MODEL: [1.0, 1.0, 2.0]}))
    with serving(gateway, tmp_path, FakeEngine(token_delay_s=0.01), batch_max_in_flight=3) as http:
        client = team_client(http, rpm_limit=2, max_in_flight=1)  # the upload is one request of the minute
        batch = wait_for(client, submit(client, [line(f"r{i}", max_tokens=4) for i in range(3)]).id)
        # 3 lines at once on a key of 2 requests per minute (one spent on the upload) and 1 in flight: none refused
        assert batch.status == "completed" and batch.request_counts.completed == 3
        client.chat.completions.create(**chat_body(max_tokens=4))  # the interactive minute is still free
        rows = usage_rows(gateway)
    batch_rows = [row for row in rows if row.batch]
    [interactive] = [row for row in rows if not row.batch]
    assert len(batch_rows) == 3 and all(row.status == "ok" for row in batch_rows)
    assert all(row.cost_nano_usd * 2 == interactive.cost_nano_usd for row in batch_rows)


def test_batch_lines_run_below_every_interactive_request(make_gateway, tmp_path):
    engine = FakeEngine()
    with serving(make_gateway(), tmp_path, engine) as http:
        client = team_client(http)
        # A line may not ask to go earlier: its priority is capped at the batch priority like any key's floor.
        batch = wait_for(client, submit(client, [line("a"), {**line("b"), "body": chat_body(priority=-5)}]).id)
        assert batch.request_counts.completed == 2
        client.chat.completions.create(**chat_body(max_tokens=2))
    assert [tenancy.priority for tenancy in engine.tenancies] == [BATCH_PRIORITY, BATCH_PRIORITY, 0]


def test_a_responses_batch_runs_through_the_responses_route(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        client = team_client(http)
        body = {"model": FAKE_MODEL, "input": "say hello", "max_output_tokens": 3, "store": False}
        lines = [{"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": body}]
        batch = wait_for(client, submit(client, lines, endpoint="/v1/responses").id)
        assert batch.status == "completed", batch
        [output] = download(client, batch.output_file_id)
    response = output["response"]["body"]
    assert response["object"] == "response" and response["output"][0]["content"][0]["text"] == " tok tok tok"


def test_two_replicas_on_one_database_never_run_a_line_twice(make_gateway, tmp_path):
    engines = [FakeEngine(token_delay_s=0.05), FakeEngine(token_delay_s=0.05)]
    with (
        serving(make_gateway(), tmp_path, engines[0], batch_max_in_flight=2) as first,
        serving(make_gateway(), tmp_path, engines[1], batch_max_in_flight=2) as second,
    ):
        client = team_client(first)
        created = [submit(client, [line(f"b{b}-r{i}", max_tokens=5) for i in range(6)]) for b in range(2)]
        second.get("/v1/models")  # both runners are up and polling the same table
        batches = [wait_for(client, batch.id) for batch in created]
        outputs = [o["custom_id"] for batch in batches for o in download(client, batch.output_file_id)]
    assert sorted(outputs) == sorted(f"b{b}-r{i}" for b in range(2) for i in range(6))
    assert len(engines[0].tenancies) + len(engines[1].tenancies) == 12  # each line ran once, on one replica
