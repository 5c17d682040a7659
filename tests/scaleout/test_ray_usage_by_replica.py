"""Replicas share one database; each usage row names its replica (GatewayConfig.instance_id), and the
dashboard's usage page and CSV show each replica beside the sum. Two apps on one SQLite file stand in
for two replicas (tests/system/test_ray_serve.py does it for real on PostgreSQL)."""

from __future__ import annotations

import csv
import io

from fastapi.testclient import TestClient

from tests.support.dashboard import (
    BASE_URL,
    DashboardClient,
    chat,
    make_dashboard_gateway,
)
from tests.support.gateway import FakeEngine, build_app


def test_the_usage_page_shows_each_replica_and_the_sum(tmp_path):
    first = make_dashboard_gateway(tmp_path, instance_id="replica-a")
    second = make_dashboard_gateway(tmp_path, instance_id="replica-b")
    with (
        TestClient(build_app(first, FakeEngine()), base_url=BASE_URL) as client_a,
        TestClient(build_app(second, FakeEngine()), base_url=BASE_URL) as client_b,
    ):
        admin = DashboardClient(client_a, first, None)
        admin.log_in()
        key = admin.create_key(admin.create_team("shared"))
        assert chat(client_a, key, max_tokens=4).status_code == 200
        assert chat(client_b, key, max_tokens=4).status_code == 200  # the key, made on a, works on b
        assert chat(client_b, key, max_tokens=4).status_code == 200
        assert second.writer.flush(10)
        assert {row.replica for row in admin.usage_rows()} == {"replica-a", "replica-b"}

        page = client_a.get("/admin/usage?group=replica").text
        assert "replica-a" in page and "replica-b" in page
        assert 'data-total="requests">3<' in page and 'data-total="completion_tokens">12<' in page
        rows = list(csv.DictReader(io.StringIO(client_a.get("/admin/usage.csv?group=replica").text)))
        assert {row["replica"]: row["requests"] for row in rows} == {"replica-a": "1", "replica-b": "2"}
