"""SIGTERM while requests are in flight loses no usage row: a real server process, rows only written
at shutdown (the flush interval is an hour), requests that finish in the grace period and requests
cut by it."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
from sqlalchemy import create_engine, select

from app.tables import UsageRow
from tests.support.gateway import admin_headers, bearer, chat_body
from tests.support.gateway_fake_server import start


def stream_tokens(url: str, key: str, max_tokens: int, results: list, started: threading.Event) -> None:
    body = chat_body(max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
    received, usage = 0, None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=60) as r:
            for line in r.iter_lines():
                if '"content":" tok"' in line:
                    received += 1
                    started.set()
                elif line.startswith("data: {") and '"usage":{' in line:
                    usage = json.loads(line[6:])["usage"]
    except httpx.HTTPError:
        pass  # cut by the shutdown
    results.append((received, usage))


def whole(url: str, key: str, max_tokens: int, results: list, started: threading.Event) -> None:
    started.set()  # can't be seen from here: the caller waits a little longer instead
    try:
        response = httpx.post(
            url + "/v1/chat/completions", json=chat_body(max_tokens=max_tokens), headers=bearer(key), timeout=60
        )
        results.append((max_tokens, response.json()["usage"]))
    except (httpx.HTTPError, ValueError):  # cut by the shutdown
        results.append((0, None))


def run_scenario(
    database_url: str, tmp_path: Path, *, delay: float, grace: float, max_tokens: int, streams_only: bool = False
):
    # usage rows are written at shutdown only
    process, url = start(database_url, tmp_path, str(delay), str(grace), TOKENMILL_USAGE_FLUSH_INTERVAL_S="3600")
    try:
        team = httpx.post(url + "/admin/api/teams", json={"name": "t"}, headers=admin_headers()).json()
        key = httpx.post(url + "/admin/api/keys", json={"team_id": team["id"]}, headers=admin_headers()).json()["key"]
        results: list = []
        started = [threading.Event() for _ in range(12)]
        threads = [
            threading.Thread(
                target=stream_tokens if i % 2 or streams_only else whole,
                args=(url, key, max_tokens, results, started[i]),
            )
            for i in range(12)
        ]
        for thread in threads:
            thread.start()
        assert all(event.wait(30) for event in started)
        time.sleep(0.2)  # every request admitted and producing, none finished
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        assert process.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    finally:
        if process.poll() is None:
            process.kill()
    engine = create_engine(database_url)
    with engine.connect() as c:
        rows = c.execute(select(UsageRow.status, UsageRow.completion_tokens)).all()
    engine.dispose()
    return results, rows


def test_sigterm_flushes_requests_finished_in_the_grace_period(database_url, tmp_path):
    results, rows = run_scenario(database_url, tmp_path, delay=0.05, grace=10, max_tokens=20)
    assert len(rows) == 12 and {status for status, _ in rows} == {"ok"}
    assert all(usage is not None and usage["completion_tokens"] == 20 for _, usage in results)
    assert sum(tokens for _, tokens in rows) == sum(usage["completion_tokens"] for _, usage in results)


def test_sigterm_bills_requests_cut_by_the_grace_period(database_url, tmp_path):
    results, rows = run_scenario(database_url, tmp_path, delay=0.05, grace=0.5, max_tokens=200, streams_only=True)
    assert len(rows) == 12  # every request that was admitted has its row
    assert {status for status, _ in rows} == {"aborted"}
    assert all(0 < tokens < 200 for _, tokens in rows)
    received = sorted(received for received, _ in results)
    billed = sorted(tokens for _, tokens in rows)
    assert all(b >= r for b, r in zip(billed, received))  # billed for all it produced, sent or not
