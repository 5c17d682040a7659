"""The Batches page: every team's batches with their progress, a team filter, and a cancel button that
the running batch obeys."""

from __future__ import annotations

from sqlalchemy import select

from app.tables import AuditEntry
from tests.support.batches import line, serving, submit, team_client, wait_for
from tests.support.dashboard import DashboardClient, make_dashboard_gateway
from tests.support.gateway import FakeEngine


def test_the_batches_page_shows_progress_and_cancels_a_running_batch(tmp_path):
    gateway = make_dashboard_gateway(tmp_path)
    try:
        with serving(gateway, tmp_path, FakeEngine(token_delay_s=0.02), batch_max_in_flight=1) as http:
            client = team_client(http, "research")
            other = team_client(http, "other")
            created = submit(client, [line(f"r{i}", max_tokens=5) for i in range(20)])
            wait_for(client, created.id, until=lambda b: b.request_counts.completed >= 1)
            admin = DashboardClient(http, gateway, http.app)
            admin.log_in()
            page = http.get("/admin/batches").text
            assert created.id in page and "research" in page and "<progress" in page
            assert f'action="/admin/batches/{created.id}/cancel"' in page
            assert created.id not in http.get("/admin/batches?team=999").text
            assert admin.post(f"/admin/batches/{created.id}/cancel").status_code == 303
            batch = wait_for(client, created.id)
            assert batch.status == "cancelled" and batch.request_counts.completed < 20
            page = http.get("/admin/batches").text
            assert "cancelled" in page and f'action="/admin/batches/{created.id}/cancel"' not in page
            assert list(other.batches.list()) == []
            finished = wait_for(client, submit(client, [line("done")]).id)
            refused = admin.post(f"/admin/batches/{finished.id}/cancel")
            assert refused.headers["location"] == "/admin/batches?error=not_cancellable"
            assert "already ended" in http.get(refused.headers["location"]).text
        with gateway.sessions() as session:
            cancels = list(session.scalars(select(AuditEntry).where(AuditEntry.target_type == "batch")))
        assert [(row.action, row.target_id, row.actor_kind) for row in cancels] == [
            ("batch.cancel", created.id, "admin_key")
        ]  # one row: the refused cancel changed nothing
        assert (cancels[0].before["status"], cancels[0].after["status"]) == ("in_progress", "cancelling")
    finally:
        gateway.stop()
