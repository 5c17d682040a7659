"""Helpers of the Batch API tests: an app over the fake engine, a team's openai client, batches to submit
and wait for, their files to download."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import openai
from fastapi.testclient import TestClient
from openai.types import Batch

from tests.support.gateway import FakeEngine, build_app, chat_body, create_key, create_team

FINAL = ("completed", "failed", "expired", "cancelled")


@contextmanager
def serving(gateway, tmp_path, engine=None, **settings) -> Iterator[TestClient]:
    app = build_app(gateway, engine or FakeEngine(), files_dir=str(tmp_path / "files"), **settings)
    with TestClient(app) as client:
        yield client


def team_client(http: TestClient, name: str = "alpha", **limits) -> openai.OpenAI:
    team = create_team(http, name)
    key = create_key(http, team["id"], **limits)
    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key=key["key"], http_client=http, max_retries=0)


def line(custom_id: str, content: str = "say hello", max_tokens: int = 3, url: str = "/v1/chat/completions") -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": chat_body(content, max_tokens=max_tokens, temperature=0),
    }


def jsonl(lines: list) -> bytes:
    return b"".join((item if isinstance(item, bytes) else json.dumps(item).encode()) + b"\n" for item in lines)


def submit(client: openai.OpenAI, lines: list, window: str = "24h", endpoint: str = "/v1/chat/completions") -> Batch:
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window=window,
    )  # type: ignore[arg-type]


def wait_for(client: openai.OpenAI, batch_id: str, until=lambda b: b.status in FINAL, timeout: float = 20) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.02)


def download(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(text) for text in client.files.content(file_id).text.splitlines()]
