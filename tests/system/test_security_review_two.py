"""The second outside review's findings, each as a user (or an attacker) would meet it, over the real
gateway (SQLite) and the fake engine: no 500s on deeply nested tool-call arguments, batches that fail
cleanly and stay cancellable, lines refused by size, revocation that stops a running batch, tpm errors
that say when a request can never fit, names without control characters, private data at rest, a file
storage quota, stored conversations that grow linearly, and fair batch seats across teams."""

from __future__ import annotations

from tests.support.batches import download, line, serving, submit, team_client, wait_for
from tests.support.gateway import FAKE_MODEL, bearer, create_key, create_team

DEEP = "[" * 3000 + "]" * 3000  # deeper than Python's recursion limit, 6 KB


def deep_call_messages() -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
    ]


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
