"""End to end with the real model: the openai client against the real server and the real gateway,
and `tokenmill serve` itself (migrations at start-up, the admin key written once, SIGTERM flush)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import create_engine, select

from app.tables import UsageRow
from bench.servers import ROOT, serve_command
from tests.support import MODEL_CACHE
from tests.support.gateway import admin_headers, bearer, free_port, usage_rows, window_start_clock
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model


def team_key(url: str, **limits) -> dict:
    team = httpx.post(
        f"{url}/admin/api/teams", json={"name": f"team-{time.monotonic_ns()}"}, headers=admin_headers()
    ).json()
    return httpx.post(f"{url}/admin/api/keys", json={"team_id": team["id"], **limits}, headers=admin_headers()).json()


def test_openai_client_usage_is_metered_exactly(smollm2, make_gateway):
    gateway = make_gateway()
    with running_server(smollm2, gateway=gateway) as server:
        key = team_key(server.url)
        client = server.client(api_key=key["key"])
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        streamed_usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
        time.sleep(0.2)
        rows = usage_rows(gateway)
    assert [(r.prompt_tokens, r.completion_tokens, r.status, r.model) for r in rows] == [
        (whole.usage.prompt_tokens, whole.usage.completion_tokens, "ok", MODEL),
        (streamed_usage.prompt_tokens, streamed_usage.completion_tokens, "ok", MODEL),
    ]


def test_openai_client_sees_auth_and_rate_limit_errors(smollm2, make_gateway):
    gateway = make_gateway(clock=window_start_clock())
    with running_server(smollm2, gateway=gateway) as server:
        key = team_key(server.url, rpm_limit=1)
        client = server.client(api_key=key["key"])
        messages = [{"role": "user", "content": "Hi"}]
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2)
        assert raw.headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError) as limited:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert limited.value.code == "rate_limit_exceeded"
        assert limited.value.response.headers["x-ratelimit-limit-requests"] == "1"
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="sk-wrong").models.list()
        assert [m.id for m in client.models.list()] == [MODEL]


def start_serve(tmp_path: Path, database_url: str, env_extra: dict | None = None) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log_path = tmp_path / f"serve-{port}.log"
    env = {**os.environ, "TOKENMILL_DATABASE_URL": database_url, **(env_extra or {})}
    for name in ("TOKENMILL_ADMIN_KEY", "TOKENMILL_REDIS_URL", "TOKENMILL_API_KEY"):
        env.pop(name, None)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            serve_command(port, MODEL_CACHE, "--num-kv-blocks", "256"),
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("serve exited:\n" + log_path.read_text())
        try:
            httpx.get(f"{url}/v1/models", timeout=1)
            return process, url, log_path
        except httpx.TransportError:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError("serve did not start:\n" + log_path.read_text())


def test_tokenmill_serve_migrates_writes_the_admin_key_once_and_flushes_on_sigterm(smollm2, tmp_path):
    database_url = f"sqlite:///{tmp_path / 'serve.db'}"
    process, url, log_path = start_serve(tmp_path, database_url)
    try:
        said = log_path.read_text()
        assert "sk-admin-" not in said  # the output ends up in nohup files and docker logs: only where it is
        [where] = re.findall(r"it is in (\S+) \(readable by this user only\)", said)
        admin_key = Path(where).read_text().strip()
        Path(where).unlink()  # as the operator is told to
        team = httpx.post(
            f"{url}/admin/api/teams", json={"name": "serve"}, headers={"Authorization": f"Bearer {admin_key}"}
        ).json()
        key = httpx.post(
            f"{url}/admin/api/keys", json={"team_id": team["id"]}, headers={"Authorization": f"Bearer {admin_key}"}
        ).json()["key"]
        finished: list[int] = []  # completion tokens of streams that ended with their usage chunk
        cut: list[int] = []  # content chunks of streams the shutdown's grace period cut short
        started = [threading.Event() for _ in range(4)]

        def stream(event: threading.Event) -> None:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Count to fifty."}],
                "max_tokens": 16,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            chunks = 0
            try:
                with httpx.stream(
                    "POST", f"{url}/v1/chat/completions", json=body, headers=bearer(key), timeout=120
                ) as r:
                    for line in r.iter_lines():
                        event.set()
                        if '"usage":{' in line:
                            finished.append(int(re.search(r'"completion_tokens":(\d+)', line)[1]))
                            return
                        chunks += re.search(r'"content":"[^"]', line) is not None  # not the role chunk
            except httpx.HTTPError:
                pass
            cut.append(chunks)

        threads = [threading.Thread(target=stream, args=(event,)) for event in started]
        for thread in threads:
            thread.start()
        assert all(event.wait(120) for event in started)
        process.send_signal(signal.SIGTERM)  # all four in flight
        for thread in threads:
            thread.join(120)
        assert process.wait(120) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
    engine = create_engine(database_url)
    with engine.connect() as c:
        rows = c.execute(select(UsageRow.completion_tokens, UsageRow.status)).all()
    engine.dispose()
    assert len(rows) == 4  # every request in flight at SIGTERM has its row
    assert sorted(tokens for tokens, status in rows if status == "ok") == sorted(finished)
    aborted = sorted(tokens for tokens, status in rows if status == "aborted")
    assert len(aborted) == len(cut) and all(b >= c for b, c in zip(aborted, sorted(cut)))
    # A second start: nothing new to migrate, no new admin key, the old one still works.
    process, url, log_path = start_serve(tmp_path, database_url)
    try:
        assert "sk-admin-" not in log_path.read_text()
        assert httpx.get(f"{url}/admin/api/teams", headers={"Authorization": f"Bearer {admin_key}"}).status_code == 200
        assert key not in log_path.read_text()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
