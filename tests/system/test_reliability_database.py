"""PostgreSQL goes away for longer than the key and budget caches live: known keys keep being served
(budgets included), an unknown key gets a 503 with Retry-After instead of a 500, and every usage row
is written once the database is back. (tests/gateway/test_gateway_usage.py covers an outage shorter than
the caches.) The outage is made on this test's own database only: connections refused, backends ended."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from tests.support.gateway import (
    bearer,
    build_app,
    chat_body,
    create_key,
    create_team,
    new_gateway,
    reset_pg,
    usage_rows,
)

CACHE_TTL_S = 0.2


class Outage:
    def __init__(self, database_url: str) -> None:
        self.name = database_url.rsplit("/", 1)[1]
        self.admin = create_engine(database_url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")

    def begin(self) -> None:
        with self.admin.connect() as c:
            c.execute(text(f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS false'))
            c.execute(text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{self.name}'"))

    def end(self) -> None:
        with self.admin.connect() as c:
            c.execute(text(f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS true'))
        self.admin.dispose()


def test_an_outage_longer_than_the_caches_keeps_known_keys_served_and_loses_no_row(pg_session_url, tmp_path):
    reset_pg(pg_session_url)
    gateway = new_gateway(pg_session_url, tmp_path, key_cache_ttl_s=CACHE_TTL_S, budget_cache_ttl_s=CACHE_TTL_S)
    outage = Outage(pg_session_url)
    with TestClient(build_app(gateway)) as client:
        team = create_team(client)
        plain = create_key(client, team["id"])["key"]
        budgeted = create_key(client, team["id"], max_budget_usd=100.0)["key"]
        unseen = create_key(client, team["id"])["key"]
        for key in (plain, budgeted):
            assert (
                client.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers=bearer(key)).status_code
                == 200
            )
        usage_rows(gateway)
        outage.begin()
        try:
            statuses = []
            for _ in range(5):
                time.sleep(CACHE_TTL_S * 1.5)  # every cached key and budget is stale by now
                for key in (plain, budgeted):
                    statuses.append(
                        client.post(
                            "/v1/chat/completions", json=chat_body(max_tokens=2), headers=bearer(key)
                        ).status_code
                    )
            refused = client.post("/v1/chat/completions", json=chat_body(), headers=bearer(unseen))
            assert statuses == [200] * 10
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert refused.json()["error"]["code"] == "service_unavailable"
            assert gateway.writer.failures > 0 and gateway.writer.pending == 10
        finally:
            outage.end()
        rows = usage_rows(gateway)
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(unseen)).status_code == 200
    gateway.stop()
    gateway.engine.dispose()
    assert len(rows) == 12 and sum(r.completion_tokens for r in rows) == 2 + 20
