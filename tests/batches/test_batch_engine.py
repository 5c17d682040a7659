"""Batches in the real engine (the tiny random Llama, so the tests run in seconds): a cancel aborts the
lines in flight through the engine's abort and their KV blocks come back; interactive time to first token stays
within 2x of its value without a batch while one runs."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from engine.config import EngineConfig
from engine.loader import load_model
from tests.support.batches import download, submit, wait_for
from tests.support.gateway import admin_headers, bearer, usage_rows
from tests.support.server import running_server


@pytest.fixture
def database_url(tmp_path):  # SQLite only: these tests are about the engine; test_batch_api.py has both
    return f"sqlite:///{tmp_path / 'batch.db'}"


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(EngineConfig(model=str(tiny_llama_dir)))


def team_client(server):
    team = httpx.post(f"{server.url}/admin/api/teams", json={"name": "batch"}, headers=admin_headers()).json()
    key = httpx.post(f"{server.url}/admin/api/keys", json={"team_id": team["id"]}, headers=admin_headers()).json()
    return server.client(api_key=key["key"])


def long_line(custom_id: str, model: str) -> dict:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def test_cancel_aborts_running_lines_in_the_engine_and_frees_their_blocks(tiny, tiny_llama_dir, make_gateway, tmp_path):
    gateway = make_gateway()
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=8)
    with running_server(
        tiny, engine_config=config, gateway=gateway, files_dir=str(tmp_path / "files"), batch_max_in_flight=4
    ) as server:
        client = team_client(server)
        model = server.engine.model_name
        created = submit(client, [long_line(f"r{i}", model) for i in range(8)], endpoint="/v1/completions")
        deadline = time.monotonic() + 30
        while not (server.engine.stats().num_running == 4 and server.engine.stats().generation_tokens_total > 40):
            assert time.monotonic() < deadline, server.engine.stats()
            time.sleep(0.02)
        assert server.engine.stats().kv_blocks_used > 0
        assert client.batches.cancel(created.id).status == "cancelling"
        batch = wait_for(client, created.id, timeout=30)
        stats = server.engine.stats()
        errors = download(client, batch.error_file_id)
    assert batch.status == "cancelled"
    assert (batch.request_counts.total, batch.request_counts.failed) == (8, 8 - batch.request_counts.completed)
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0
    cut = [e for e in errors if e["response"] is not None]
    assert len(cut) == 4 and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    made = sorted(e["response"]["body"]["usage"]["completion_tokens"] for e in cut)
    assert 0 < made[0] and made[-1] < 400  # stopped part way, not run to the end
    assert sorted(row.completion_tokens for row in usage_rows(gateway) if row.status == "aborted") == made


async def time_to_first_token(client: httpx.AsyncClient, model: str, key: str, number: int) -> float:
    body = {
        "model": model,
        "prompt": f"Question {number}: tell me",
        "max_tokens": 4,
        "stream": True,
        "ignore_eos": True,
    }
    started = time.monotonic()
    async with client.stream("POST", "/v1/completions", json=body, headers=bearer(key)) as response:
        assert response.status_code == 200
        async for text in response.aiter_lines():
            if text.startswith("data: {") and '"text":""' not in text.replace(" ", ""):
                return time.monotonic() - started
    raise AssertionError("the stream ended without a token")


async def interactive_ttfts(url: str, model: str, key: str, count: int, every_s: float) -> list[float]:
    """TTFTs of `count` streamed requests arriving every `every_s`, each on its own."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        tasks = []
        for number in range(count):
            tasks.append(asyncio.create_task(time_to_first_token(client, model, key, number)))
            await asyncio.sleep(every_s)
        return list(await asyncio.gather(*tasks))


def test_interactive_requests_stream_while_a_500_line_batch_runs(tiny, tiny_llama_dir, make_gateway, tmp_path):
    """Interactive streams arriving every 50 ms while a 500-line batch fills the engine all get their
    first token, and the batch still completes every line. How much the batch delays a chat's first token
    (the issue's target: TTFT p99 at most 2x) is a speed target, so it lives in a benchmark,
    bench/background_ttft.py; tests/engine/test_background.py holds the scheduling rule that meets it."""
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=1024, max_num_seqs=16)
    with running_server(
        tiny, engine_config=config, gateway=make_gateway(), files_dir=str(tmp_path / "files")
    ) as server:
        client = team_client(server)
        model = server.engine.model_name
        body = {"model": model, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
        lines = [
            {"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": f"Item {i}"}}
            for i in range(500)
        ]
        created = submit(client, lines, endpoint="/v1/completions")
        wait_for(client, created.id, until=lambda b: b.request_counts.completed >= 8, timeout=60)
        ttfts = asyncio.run(interactive_ttfts(server.url, model, client.api_key, 20, 0.05))
        assert client.batches.retrieve(created.id).request_counts.completed < 500  # it ran the whole time
        batch = wait_for(client, created.id, timeout=300)
    assert len(ttfts) == 20 and all(ttft > 0 for ttft in ttfts)
    assert batch.status == "completed" and batch.request_counts.completed == 500
    assert batch.request_counts.failed == 0
