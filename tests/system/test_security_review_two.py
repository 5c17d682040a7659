"""The second outside review's findings, each as a user (or an attacker) would meet it, over the real
gateway (SQLite) and the fake engine: no 500s on deeply nested tool-call arguments, batches that fail
cleanly and stay cancellable, lines refused by size, revocation that stops a running batch, tpm errors
that say when a request can never fit, names without control characters, private data at rest, a file
storage quota, stored conversations that grow linearly, and fair batch seats across teams."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.support.batches import download, jsonl, line, serving, submit, team_client, wait_for
from tests.support.gateway import FAKE_MODEL, bearer, chat_body, create_key, create_team

DEEP = "[" * 3000 + "]" * 3000  # deeper than Python's recursion limit, 6 KB


def deep_call_messages() -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
    ]


def openai_client(http, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key=key, http_client=http, max_retries=0)


def batch_row(gateway, batch_id: str, timeout: float = 20):
    """The batch as the database has it, once it is final (its key may no longer read it)."""
    from app.tables import BatchJob
    from tests.support.batches import FINAL

    deadline = time.monotonic() + timeout
    while True:
        with gateway.sessions() as session:
            row = session.get(BatchJob, batch_id)
        if row.status in FINAL:
            return row
        assert time.monotonic() < deadline, f"batch stuck: {row.status}"
        time.sleep(0.02)


def team_key(http, name: str = "alpha", **limits) -> str:
    team = create_team(http, name)
    return create_key(http, team["id"], **limits)["key"]


# ---- 6: deeply nested tool-call arguments are a 400, never a 500 ----


def test_deeply_nested_tool_arguments_are_refused_in_chat_and_tokenize(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        key = team_key(http)
        chat = http.post(
            "/v1/chat/completions", json={"model": FAKE_MODEL, "messages": deep_call_messages()}, headers=bearer(key)
        )
        tokenize = http.post(
            "/tokenize", json={"model": FAKE_MODEL, "messages": deep_call_messages()}, headers=bearer(key)
        )
    for response in (chat, tokenize):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "nested" in error["message"]


def test_deeply_nested_tool_arguments_are_refused_in_responses(make_gateway, tmp_path):
    items = [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
    ]
    with serving(make_gateway(), tmp_path) as http:
        key = team_key(http)
        response = http.post("/v1/responses", json={"model": FAKE_MODEL, "input": items}, headers=bearer(key))
    assert response.status_code == 400, response.text
    assert "nested" in response.json()["error"]["message"]


def test_a_deeply_nested_batch_line_is_that_lines_error(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        client = team_client(http)
        deep = {**line("deep"), "body": {"model": FAKE_MODEL, "messages": deep_call_messages()}}
        batch = wait_for(client, submit(client, [line("ok"), deep]).id)
        assert batch.status == "completed", batch
        assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
        errors = download(client, batch.error_file_id)
        assert [e["custom_id"] for e in errors] == ["deep"]
        assert errors[0]["response"]["status_code"] == 400


# ---- 2: one bad line or one failing batch never stops the others; cancelling always works ----


def deep_body_line(custom_id: str) -> bytes:
    head = json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"})[:-1]
    return (head + f', "body": {{"model": "{FAKE_MODEL}", "x": ' + DEEP + "}}").encode()


def test_a_line_nested_too_deep_fails_alone_and_other_teams_batches_run(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        alpha, beta = team_client(http, "alpha"), team_client(http, "beta")
        first = submit(alpha, [line("ok"), deep_body_line("deep")])
        second = submit(beta, [line("b1")])
        done_first, done_second = wait_for(alpha, first.id), wait_for(beta, second.id)
        assert done_first.status == "completed", done_first
        assert (done_first.request_counts.completed, done_first.request_counts.failed) == (1, 1)
        assert done_second.status == "completed" and done_second.request_counts.completed == 1
        errors = download(alpha, done_first.error_file_id)
        assert errors[0]["error"]["code"] == "invalid_request" and "JSON" in errors[0]["error"]["message"]


def failing_pass(monkeypatch, batch_ids: set[str]) -> None:
    """Every pass over a batch in `batch_ids` raises, as a bug or a corrupt row would make it."""
    from app.batches.jobs import BatchStore

    real = BatchStore.finished_lines

    def finished_lines(self, batch_id: str) -> set[int]:
        if batch_id in batch_ids or "*" in batch_ids:
            raise RuntimeError("injected: this batch's pass fails")
        return real(self, batch_id)

    monkeypatch.setattr(BatchStore, "finished_lines", finished_lines)


def test_a_batch_whose_pass_keeps_failing_fails_with_a_reason_and_the_next_runs(make_gateway, tmp_path, monkeypatch):
    with serving(make_gateway(), tmp_path) as http:
        alpha, beta = team_client(http, "alpha"), team_client(http, "beta")
        doomed: set[str] = {"*"}
        failing_pass(monkeypatch, doomed)
        first = submit(alpha, [line("a1")])
        ended = wait_for(alpha, first.id)
        doomed.discard("*")
        doomed.add(first.id)
        second = wait_for(beta, submit(beta, [line("b1")]).id)
    assert ended.status == "failed", ended
    assert ended.errors.data[0].code == "batch_failed" and "server" in ended.errors.data[0].message
    assert second.status == "completed"


def test_cancelling_a_batch_whose_pass_fails_cancels_it(make_gateway, tmp_path, monkeypatch):
    import app.batches.runner as runner

    monkeypatch.setattr(runner, "MAX_FAILED_PASSES", 10_000)  # it would be retried until the cancel comes
    with serving(make_gateway(), tmp_path) as http:
        alpha = team_client(http, "alpha")
        failing_pass(monkeypatch, {"*"})
        batch = submit(alpha, [line("a1"), line("a2")])
        time.sleep(0.3)
        alpha.batches.cancel(batch.id)
        ended = wait_for(alpha, batch.id)
    assert ended.status == "cancelled", ended


# ---- 3: a line over max_request_bytes is refused before it is parsed; lines are streamed ----


def test_a_line_over_the_request_size_cap_is_refused_unparsed(make_gateway, tmp_path):
    huge = {**line("huge"), "body": chat_body("hello " * 400_000)}  # 2.4 MB > the 2 MiB default cap
    with serving(make_gateway(), tmp_path) as http:
        client = team_client(http)
        batch = wait_for(client, submit(client, [line("ok"), huge, line("after")]).id)
        errors = download(client, batch.error_file_id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    assert errors[0]["custom_id"] is None  # never parsed, so its custom_id is unknown
    assert errors[0]["error"]["code"] == "line_too_large" and "2097152" in errors[0]["error"]["message"]


def test_batch_lines_are_read_one_at_a_time(tmp_path):
    from app.batches.lines import read_lines

    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([line(f"l{n}") for n in range(3)]))
    lines = read_lines(path, "/v1/chat/completions", max_line_bytes=4096)
    assert not isinstance(lines, list)  # an iterator: a 50,000-line file is never held whole
    assert [found.custom_id for found in lines] == ["l0", "l1", "l2"]


# ---- 5: revoking the key (or blocking its team, lowering its budget) stops its running batch ----


def test_revoking_the_key_stops_its_running_batch(make_gateway, tmp_path):
    from tests.support.batches import StoppableEngine
    from tests.support.gateway import admin_headers

    engine = StoppableEngine(token_delay_s=0.02)
    gateway = make_gateway()
    with serving(gateway, tmp_path, engine=engine, batch_max_in_flight=2) as http:
        team = create_team(http, "alpha")
        key = create_key(http, team["id"])
        client = openai_client(http, key["key"])
        batch = submit(client, [line(f"l{n}", max_tokens=5) for n in range(30)])
        wait_for(client, batch.id, until=lambda b: b.request_counts.completed >= 2)
        revoked = http.delete(f"/admin/api/keys/{key['id']}", headers=admin_headers())
        assert revoked.status_code == 200, revoked.text
        started_at_revocation = len(engine.tenancies)
        ended = batch_row(gateway, batch.id)
    assert len(engine.tenancies) - started_at_revocation <= 2  # at most the lines already being started
    assert ended.status == "failed" and ended.errors[0]["code"] == "invalid_api_key"


def test_blocking_the_team_stops_its_running_batch(make_gateway, tmp_path):
    from tests.support.batches import StoppableEngine
    from tests.support.gateway import admin_headers

    engine = StoppableEngine(token_delay_s=0.02)
    gateway = make_gateway()
    with serving(gateway, tmp_path, engine=engine, batch_max_in_flight=2) as http:
        team = create_team(http, "alpha")
        client = openai_client(http, create_key(http, team["id"])["key"])
        batch = submit(client, [line(f"l{n}", max_tokens=5) for n in range(30)])
        wait_for(client, batch.id, until=lambda b: b.request_counts.completed >= 2)
        blocked = http.patch(f"/admin/api/teams/{team['id']}", json={"blocked": True}, headers=admin_headers())
        assert blocked.status_code == 200, blocked.text
        started_at_block = len(engine.tenancies)
        ended = batch_row(gateway, batch.id)
    assert len(engine.tenancies) - started_at_block <= 2
    assert ended.status == "failed" and ended.errors[0]["code"] == "invalid_api_key"


# ---- 4: batch lines of different teams share the batch seats fairly, weights included ----


def test_a_short_batch_does_not_wait_behind_another_teams_long_one(make_gateway, tmp_path):
    from tests.support.batches import StoppableEngine

    engine = StoppableEngine(token_delay_s=0.02)
    with serving(make_gateway(), tmp_path, engine=engine, batch_max_in_flight=2) as http:
        alpha, beta = team_client(http, "alpha"), team_client(http, "beta")
        long = submit(alpha, [line(f"a{n}", max_tokens=5) for n in range(24)])
        wait_for(alpha, long.id, until=lambda b: b.request_counts.completed >= 1)
        short = wait_for(beta, submit(beta, [line(f"b{n}", max_tokens=5) for n in range(2)]).id)
        long_then = alpha.batches.retrieve(long.id)
        wait_for(alpha, long.id)
    assert short.status == "completed"
    assert long_then.request_counts.completed <= 12, long_then  # FCFS: all 24 before beta's first line


def test_batch_seats_follow_the_team_weights(make_gateway, tmp_path):
    from tests.support.batches import StoppableEngine
    from tests.support.gateway import admin_headers

    engine = StoppableEngine(token_delay_s=0.01)
    with serving(make_gateway(), tmp_path, engine=engine, batch_max_in_flight=1) as http:
        clients = {}
        for name, weight in (("heavy", 3.0), ("light", 1.0)):
            team = create_team(http, name)
            patched = http.patch(
                f"/admin/api/teams/{team['id']}", json={"scheduling_weight": weight}, headers=admin_headers()
            )
            assert patched.status_code == 200, patched.text
            clients[name] = (team["id"], openai_client(http, create_key(http, team["id"])["key"]))
        batches = {
            name: submit(client, [line(f"{name}{n}", max_tokens=4) for n in range(20)])
            for name, (_, client) in clients.items()
        }
        for name, (_, client) in clients.items():
            wait_for(client, batches[name].id, timeout=60)
    order = [tenancy.team for tenancy in engine.tenancies]
    heavy = f"team:{clients['heavy'][0]}"
    first = order[4:20]  # once both batches are running
    assert 10 <= first.count(heavy) <= 14, [(t.team, t.weight) for t in engine.tenancies]  # 3:1 of 16 is 12


# ---- 8: a request bigger than the whole tpm limit is told it can never fit, not to retry ----


def test_a_request_over_the_whole_tpm_limit_is_not_told_to_retry(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        key = team_key(http, tpm_limit=50)
        too_big = http.post("/v1/chat/completions", json=chat_body(max_tokens=100), headers=bearer(key))
        fits = http.post("/v1/chat/completions", json=chat_body(max_tokens=5), headers=bearer(key))
    assert too_big.status_code == 400, too_big.text
    assert "retry-after" not in too_big.headers
    error = too_big.json()["error"]
    assert error["code"] == "request_too_large" and "tpm" in error["message"] and "50" in error["message"]
    assert fits.status_code == 200


# ---- 7: no control characters in names; a CR in a CSV cell is quoted, so the formula guard holds ----


def test_names_with_control_or_bidi_characters_are_refused(make_gateway, tmp_path):
    from tests.support.gateway import admin_headers

    with serving(make_gateway(), tmp_path) as http:
        team = create_team(http, "alpha")
        statuses = [
            http.post("/admin/api/teams", json={"name": "\r=1+1"}, headers=admin_headers()).status_code,
            http.post("/admin/api/teams", json={"name": "evil\u202etxt.exe"}, headers=admin_headers()).status_code,
            http.patch(f"/admin/api/teams/{team['id']}", json={"name": "a\nb"}, headers=admin_headers()).status_code,
            http.post(
                "/admin/api/keys", json={"team_id": team["id"], "name": "k\x00"}, headers=admin_headers()
            ).status_code,
        ]
        fine = http.post("/admin/api/teams", json={"name": "Équipe ünïcode 東京"}, headers=admin_headers())
    assert statuses == [400, 400, 400, 400] or statuses == [422] * 4, statuses
    assert fine.status_code == 201


def test_a_carriage_return_in_a_name_is_quoted_in_the_usage_csv(make_gateway, tmp_path):
    import csv
    import io

    from app.tables import Team
    from tests.support.gateway import admin_headers

    gateway = make_gateway()
    with serving(gateway, tmp_path) as http:
        team = create_team(http, "alpha")
        key = create_key(http, team["id"])["key"]
        with gateway.sessions() as session, session.begin():  # a name stored before names were checked
            session.get(Team, team["id"]).name = "\r=1+1"
        assert http.post("/v1/chat/completions", json=chat_body(), headers=bearer(key)).status_code == 200
        assert gateway.writer.flush(10)
        text = http.get("/admin/api/usage.csv?group_by=team", headers=admin_headers()).text
    assert "\"'\r=1+1\"" in text  # quoted: a spreadsheet keeps the CR inside the cell
    cells = [cell for row in csv.reader(io.StringIO(text, newline="")) for cell in row]
    assert "'\r=1+1" in cells and not any(cell.startswith("=") for cell in cells)


def test_an_uploaded_files_name_loses_its_control_and_bidi_characters(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        client = team_client(http)
        uploaded = client.files.create(file=("invoice\u202egpj\u2066.exe", b"hello"), purpose="user_data")
        listed = client.files.retrieve(uploaded.id)
    assert uploaded.filename == listed.filename == "invoicegpj.exe"


# ---- smaller: best_of is refused, not silently ignored ----


def test_best_of_is_refused_with_a_clear_error(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        key = team_key(http)
        body = {"model": FAKE_MODEL, "prompt": "say hello", "max_tokens": 3, "best_of": 3}
        refused = http.post("/v1/completions", json=body, headers=bearer(key))
        one = http.post("/v1/completions", json={**body, "best_of": 1}, headers=bearer(key))
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "best_of" and "best_of" in refused.json()["error"]["message"]
    assert one.status_code == 200  # best_of 1 is what runs anyway


# ---- 11: the data folder and everything in it is private to the server's user, later files too ----


def test_the_data_folder_is_private_also_for_files_made_later(tmp_path, monkeypatch):
    import os
    import stat

    import httpx

    from app.cli.main import main
    from tests.support.gateway import ADMIN_KEY, admin_headers, serve_fake_engine, uvicorn_in_thread

    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o755)
    (data_dir / "old.log").write_text("from an older version")
    (data_dir / "old.log").chmod(0o644)
    monkeypatch.setenv("TOKENMILL_ADMIN_KEY", ADMIN_KEY)
    monkeypatch.delenv("TOKENMILL_DATABASE_URL", raising=False)
    serve_fake_engine(monkeypatch)

    def probe(url: str) -> None:
        team = httpx.post(url + "/admin/api/teams", json={"name": "t"}, headers=admin_headers()).json()
        key = httpx.post(url + "/admin/api/keys", json={"team_id": team["id"]}, headers=admin_headers()).json()
        uploaded = httpx.post(
            url + "/v1/files",
            files={"file": ("in.jsonl", b"{}\n")},
            data={"purpose": "user_data"},
            headers=bearer(key["key"]),
        )
        assert uploaded.status_code == 200, uploaded.text

    uvicorn_in_thread(monkeypatch, probe)
    umask = os.umask(0o022)
    try:
        assert main(["serve", "--data-dir", str(data_dir), "--log-level", "warning"]) == 0
    finally:
        os.umask(umask)  # serve set the process's umask; the other tests expect the usual one
    modes = {
        str(path.relative_to(data_dir)): stat.S_IMODE(path.lstat().st_mode)
        for path in [data_dir, *data_dir.rglob("*")]
        if not path.is_symlink()
    }
    assert "tokenmill.db" in modes and any(name.startswith("files/file-") for name in modes), modes
    loose = {name: oct(mode) for name, mode in modes.items() if mode & 0o077}
    assert not loose, loose


# ---- 1: /v1/responses truncation "auto": cheap checks first, one pass over the turns ----


def counting_renders(monkeypatch) -> list[int]:
    """How many times the whole conversation is rendered through the chat template, one entry each."""
    import app.api.responses as responses

    calls: list[int] = []
    real = responses.prepare_chat

    def prepare_chat(tokenizer, body):
        calls.append(len(body.messages))
        return real(tokenizer, body)

    monkeypatch.setattr(responses, "prepare_chat", prepare_chat)
    return calls


def many_turns(count: int) -> list[dict]:
    return [{"role": "user", "content": "say hello world one two three"} for _ in range(count)]


def test_auto_truncation_renders_the_conversation_a_few_times_not_once_per_dropped_turn(
    make_gateway, tmp_path, monkeypatch
):
    renders = counting_renders(monkeypatch)
    with serving(make_gateway(), tmp_path) as http:
        key = team_key(http)
        body = {"model": FAKE_MODEL, "input": many_turns(2000), "truncation": "auto", "max_output_tokens": 5}
        response = http.post("/v1/responses", json=body, headers=bearer(key))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["input_tokens"] <= 4096 - 5
    assert len(renders) <= 4, len(renders)  # before: one render per dropped turn, ~1,400 of them


def test_hopeless_responses_requests_are_refused_before_any_rendering(make_gateway, tmp_path, monkeypatch):
    renders = counting_renders(monkeypatch)
    with serving(make_gateway(), tmp_path) as http:
        key = team_key(http)
        no_room = {"model": FAKE_MODEL, "input": many_turns(2000), "truncation": "auto", "max_output_tokens": 4096}
        too_many = {"model": FAKE_MODEL, "input": [{"role": "user", "content": "hi"}] * 10_001, "truncation": "auto"}
        refused = [http.post("/v1/responses", json=body, headers=bearer(key)) for body in (no_room, too_many)]
    assert [r.status_code for r in refused] == [400, 400], [r.text for r in refused]
    assert [r.json()["error"]["param"] for r in refused] == ["max_output_tokens", "input"]
    assert renders == []


# ---- 10: files have a per-team storage quota, and uploads count against rpm ----


def test_a_team_over_its_file_quota_gets_a_clear_error(make_gateway, tmp_path):
    from tests.support.gateway import admin_headers

    with serving(make_gateway(), tmp_path) as http:
        team = create_team(http, "alpha")
        set_quota = http.patch(
            f"/admin/api/teams/{team['id']}", json={"file_quota_bytes": 1000}, headers=admin_headers()
        )
        assert set_quota.status_code == 200 and set_quota.json()["file_quota_bytes"] == 1000, set_quota.text
        client = openai_client(http, create_key(http, team["id"])["key"])
        client.files.create(file=("a.txt", b"x" * 600), purpose="user_data")
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=("b.txt", b"x" * 600), purpose="user_data")
        error = refused.value.body
        assert error["code"] == "storage_quota_exceeded" and "1000" in error["message"]
        assert len(client.files.list().data) == 1  # nothing of the refused upload is kept
        page = http.get(f"/admin/api/teams/{team['id']}", headers=admin_headers()).json()
    assert page["file_quota_bytes"] == 1000


def test_a_team_has_a_default_file_quota(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path, default_file_quota_bytes=1000) as http:
        client = team_client(http)
        client.files.create(file=("a.txt", b"x" * 900), purpose="user_data")
        with pytest.raises(openai.BadRequestError):
            client.files.create(file=("b.txt", b"x" * 200), purpose="user_data")


def test_uploads_count_against_the_keys_rpm(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        client = openai_client(http, team_key(http, rpm_limit=1))
        client.files.create(file=("a.txt", b"x"), purpose="user_data")
        with pytest.raises(openai.RateLimitError):
            client.files.create(file=("b.txt", b"x"), purpose="user_data")


def test_the_team_page_shows_and_sets_the_file_quota(make_gateway, tmp_path):
    from tests.support.dashboard import DashboardClient

    gateway = make_gateway()
    with serving(gateway, tmp_path) as http:
        admin = DashboardClient(http, gateway, http.app)
        admin.log_in()
        team_id = admin.create_team("alpha")
        saved = admin.post(f"/admin/teams/{team_id}", name="alpha", budget_period="month", file_quota_bytes="5000")
        assert saved.status_code == 303, saved.text
        page = http.get(f"/admin/teams/{team_id}").text
    assert 'name="file_quota_bytes" inputmode="numeric" value="5000"' in page
    assert "Files stored: 0 of 5,000 bytes." in page


def test_the_cli_creates_a_team_with_a_file_quota(tmp_path, capsys):
    from sqlalchemy import create_engine, select

    from app.cli.main import main
    from app.tables import Team

    database_url = f"sqlite:///{tmp_path / 'cli.db'}"
    flags = ["--database-url", database_url, "--data-dir", str(tmp_path)]
    assert main(["teams", "create", "alpha", "--file-quota-bytes", "12345", *flags]) == 0
    with create_engine(database_url).connect() as connection:
        assert connection.execute(select(Team.file_quota_bytes)).scalar_one() == 12345


# ---- 9: a stored conversation keeps each turn's own input once; the chain is rebuilt on reading ----


def test_stored_conversations_grow_linearly_and_list_the_whole_input(make_gateway, tmp_path):
    from sqlalchemy import select

    from app.tables import StoredResponseItem

    gateway = make_gateway()
    turn_text = "say hello " * 2000  # 20 KB a turn
    with serving(gateway, tmp_path) as http:
        key = team_key(http)
        previous = None
        for _ in range(12):
            body = {"model": FAKE_MODEL, "input": turn_text, "max_output_tokens": 2, "store": True}
            if previous is not None:
                body["previous_response_id"] = previous
            answered = http.post("/v1/responses", json=body, headers=bearer(key))
            assert answered.status_code == 200, answered.text
            previous = answered.json()["id"]
        items = http.get(f"/v1/responses/{previous}/input_items?limit=100&order=asc", headers=bearer(key)).json()
    with gateway.sessions() as session:
        stored = sum(len(json.dumps(item)) for item in session.scalars(select(StoredResponseItem.item)))
    sent = 12 * len(turn_text)
    assert stored < 1.2 * sent, (stored, sent)  # before: 1 + 2 + ... + 12 turns, 6.5x what was sent
    roles = [item["role"] for item in items["data"]]
    assert roles == ["user", "assistant"] * 11 + ["user"]  # the whole input, earlier outputs included
