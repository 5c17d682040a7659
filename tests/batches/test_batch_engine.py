"""Batches in the real engine (the tiny random Llama, so the tests run in seconds): a cancel aborts the
lines in flight through the engine's abort and their KV blocks come back."""

from __future__ import annotations

import time

import httpx
import pytest

from engine.config import EngineConfig
from engine.loader import load_model
from tests.support.batches import download, submit, wait_for
from tests.support.gateway import admin_headers, usage_rows
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
