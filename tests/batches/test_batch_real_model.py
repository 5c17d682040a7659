"""A batch on the real model, through the official client: every line's output equals the direct greedy
request with the same body, for chat completions and completions."""

from __future__ import annotations

import io
import json
import time

import httpx
import pytest

from tests.support.gateway import admin_headers
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model

CHAT_BODIES = [
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    },
    {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "temperature": 0},
]
COMPLETION_BODIES = [{"model": MODEL, "prompt": "The sky is", "max_tokens": 6, "temperature": 0}]


def run_batch(client, endpoint: str, bodies: list[dict]) -> dict[str, dict]:
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": endpoint, "body": body} for i, body in enumerate(bodies)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == len(bodies), batch
    outputs = [json.loads(text) for text in client.files.content(batch.output_file_id).text.splitlines()]
    return {output["custom_id"]: output["response"]["body"] for output in outputs}


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # PostgreSQL: test_batch_api.py
def test_batch_outputs_equal_direct_greedy_requests(smollm2, make_gateway, tmp_path):
    with running_server(smollm2, gateway=make_gateway(), files_dir=str(tmp_path / "files")) as server:
        team = httpx.post(f"{server.url}/admin/api/teams", json={"name": "batch"}, headers=admin_headers()).json()
        key = httpx.post(f"{server.url}/admin/api/keys", json={"team_id": team["id"]}, headers=admin_headers()).json()
        client = server.client(api_key=key["key"])
        chats = run_batch(client, "/v1/chat/completions", CHAT_BODIES)
        for i, body in enumerate(CHAT_BODIES):
            direct = client.chat.completions.create(**body)
            batched = chats[f"line-{i}"]
            assert batched["choices"][0]["message"]["content"] == direct.choices[0].message.content
            assert batched["usage"]["completion_tokens"] == direct.usage.completion_tokens
        completions = run_batch(client, "/v1/completions", COMPLETION_BODIES)
        direct_text = client.completions.create(**COMPLETION_BODIES[0]).choices[0].text
        assert completions["line-0"]["choices"][0]["text"] == direct_text
