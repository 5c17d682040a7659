"""Faults: a model step that raises for one request fails that request alone, through HTTP, in OpenAI's
shape; a server killed with SIGKILL comes back clean on the same database and data folder (migrations
are a no-op, old keys work, spill files are replayed, including one a killed process was replaying).
SIGTERM draining and flushing is covered by tests/gateway/test_gateway_shutdown.py and test_gateway_e2e.py."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, func, select

from app.gateway.usage import UsageEvent
from app.tables import UsageRow
from engine.config import EngineConfig
from tests.support import gateway_fake_server
from tests.support.gateway import FAKE_MODEL, admin_headers, bearer, chat_body
from tests.support.server import MODEL, running_server

POISON = "xylophone"


@pytest.fixture
def faulty_server(smollm2):
    """A real server whose model step raises for any batch holding a prompt that mentions POISON."""
    config = EngineConfig(dtype="float32", num_kv_blocks=128, max_num_seqs=8)
    with running_server(smollm2, engine_config=config) as server:
        runner = server.engine.core.runner
        real_forward = runner.forward
        tokenizer = smollm2.tokenizer

        def forward(requests, counts):
            if any(POISON in tokenizer.decode(r.prompt_token_ids) for r in requests):
                raise RuntimeError("injected fault in the model step")
            return real_forward(requests, counts)

        runner.forward = forward
        yield server


def ask(content: str, **fields) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0.0,
        **fields,
    }


@pytest.mark.real_model
def test_a_failing_model_step_fails_only_its_request(faulty_server):
    results: dict[str, httpx.Response] = {}
    with httpx.Client(base_url=faulty_server.base_url, timeout=60) as http:

        def post(name: str, body: dict) -> None:
            results[name] = http.post("/chat/completions", json=body)

        threads = [threading.Thread(target=post, args=(f"healthy-{i}", ask(f"Name a colour {i}."))) for i in range(3)]
        threads += [threading.Thread(target=post, args=("poison", ask(f"Spell {POISON}.")))]
        threads += [threading.Thread(target=post, args=("poison-stream", ask(f"Play the {POISON}.", stream=True)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        after = http.post("/chat/completions", json=ask("Name a colour."))
    for i in range(3):
        assert results[f"healthy-{i}"].status_code == 200
        assert results[f"healthy-{i}"].json()["choices"][0]["message"]["content"]
    poison = results["poison"]
    assert poison.status_code == 500
    error = poison.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    stream = results["poison-stream"]
    assert stream.status_code == 200  # the headers were out before the step failed
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert after.status_code == 200
    faulty_server.wait_for_metrics(lambda m: m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0)


# ---- SIGKILL and restart (the fake engine: the claim is about the store, not the model) ----


def start(database_url: str, data_dir: Path) -> tuple[subprocess.Popen, str]:
    return gateway_fake_server.start(database_url, data_dir, "0.05", TOKENMILL_USAGE_FLUSH_INTERVAL_S="0.1")


def spilled(team_id: int, key_id: int, count: int) -> str:
    now = datetime.now(UTC).replace(tzinfo=None)
    return "".join(
        UsageEvent(
            created_at=now,
            team_id=team_id,
            key_id=key_id,
            model=FAKE_MODEL,
            prompt_tokens=1,
            cached_tokens=0,
            completion_tokens=100,
            latency_ms=1,
            ttft_ms=1,
            status="ok",
            cost_nano_usd=0,
        ).to_json()
        + "\n"
        for _ in range(count)
    )


def rows(database_url: str) -> tuple[int, int]:
    engine = create_engine(database_url)
    with engine.connect() as c:
        count, tokens = c.execute(select(func.count(), func.coalesce(func.sum(UsageRow.completion_tokens), 0))).one()
    engine.dispose()
    return count, tokens


def test_a_server_killed_with_sigkill_comes_back_clean(tmp_path):
    database_url = f"sqlite:///{tmp_path / 'tokenmill.db'}"
    process, url = start(database_url, tmp_path)
    try:
        team = httpx.post(url + "/admin/api/teams", json={"name": "t"}, headers=admin_headers()).json()
        key = httpx.post(url + "/admin/api/keys", json={"team_id": team["id"]}, headers=admin_headers()).json()
        for _ in range(3):
            assert (
                httpx.post(
                    url + "/v1/chat/completions", json=chat_body(max_tokens=2), headers=bearer(key["key"]), timeout=10
                ).status_code
                == 200
            )
        deadline = time.monotonic() + 10
        while rows(database_url)[0] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)

        def cut_short() -> None:
            try:
                httpx.post(
                    url + "/v1/chat/completions", json=chat_body(max_tokens=400), headers=bearer(key["key"]), timeout=30
                )
            except httpx.TransportError:
                pass  # the server dies under it

        in_flight = threading.Thread(target=cut_short)
        in_flight.start()
        time.sleep(0.5)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    in_flight.join(30)
    assert rows(database_url) == (3, 6)
    # what dead processes leave behind: a spill file, and one claimed by a process killed while replaying it
    (tmp_path / "usage-spill-999-deadbeef.jsonl").write_text(spilled(team["id"], key["id"], 4))
    (tmp_path / "usage-spill-998-deadbeef.replaying").write_text(spilled(team["id"], key["id"], 5))
    process, url = start(database_url, tmp_path)
    try:
        assert (
            httpx.post(
                url + "/v1/chat/completions", json=chat_body(max_tokens=2), headers=bearer(key["key"]), timeout=10
            ).status_code
            == 200
        )
        assert not list(tmp_path.glob("usage-spill-99*"))
        deadline = time.monotonic() + 10
        while rows(database_url)[0] < 3 + 4 + 5 + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rows(database_url) == (13, 6 + 900 + 2)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    log = "".join(p.read_text() for p in tmp_path.glob("server-*.log"))
    assert "Traceback" not in log, log
