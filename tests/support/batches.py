"""Helpers of the Batch API tests: an app over the fake engine, a team's openai client, batches to submit
and wait for, their files to download."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import openai
from fastapi.testclient import TestClient
from openai.types import Batch

from engine.outputs import RequestOutput, SequenceDelta
from tests.support.gateway import FakeEngine, build_app, chat_body, create_key, create_team

FINAL = ("completed", "failed", "expired", "cancelled")


class StoppableEngine(FakeEngine):
    """A fake engine whose abort() ends a request as the real one does: a last delta with finish_reason
    "abort" after the tokens made so far. `running` holds the requests generating now."""

    def __init__(self, token_delay_s: float = 0.02) -> None:
        super().__init__(token_delay_s=token_delay_s)
        self.running: set[str] = set()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params, tenancy=None, capacity=True):
        self.tenancies.append(tenancy)
        total = params.max_tokens or 16
        self.running.add(request_id)
        try:
            for i in range(total):
                await asyncio.sleep(self.token_delay_s)
                if request_id in self.aborted:
                    deltas = [SequenceDelta(index, "", [], None, "abort") for index in range(params.n)]
                    yield RequestOutput(request_id, len(prompt_token_ids), 0, deltas, finished=True)
                    return
                reason = "length" if i == total - 1 else None
                deltas = [SequenceDelta(index, " tok", [3], None, reason) for index in range(params.n)]
                yield RequestOutput(request_id, len(prompt_token_ids), 0, deltas, finished=reason is not None)
        finally:
            self.running.discard(request_id)


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
