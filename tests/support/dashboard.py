"""Test support for the admin dashboard: an app with the real gateway (SQLite) over the fake engine,
a logged-in TestClient, and helpers that read the CSRF token and the shown-once key out of pages."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from fastapi.testclient import TestClient

from tests.support.gateway import ADMIN_KEY

BASE_URL = "http://127.0.0.1"


@dataclass
class DashboardClient:
    client: TestClient
    gateway: object  # app.gateway.service.Gateway
    app: object
    csrf: str = ""

    def log_in(self, admin_key: str = ADMIN_KEY) -> str:
        page = self.client.get("/admin/login")
        response = self.client.post(
            "/admin/login",
            data={"admin_key": admin_key, "csrf_token": login_token(page.text), "next": "/admin"},
            follow_redirects=False,
        )
        assert response.status_code == 303, response.text
        self.csrf = page_csrf(self.client.get("/admin/teams").text)
        return self.csrf

    def post(self, path: str, **fields):
        return self.client.post(path, data={"csrf_token": self.csrf, **fields}, follow_redirects=False)

    def create_team(self, name: str = "alpha", **limits) -> int:
        response = self.post("/admin/teams", name=name, budget_period="month", **limits)
        assert response.status_code == 303, response.text
        return int(re.search(r"/admin/teams/(\d+)", response.headers["location"]).group(1))

    def create_key(self, team_id: int, name: str = "k", **limits) -> str:
        response = self.post("/admin/keys", team_id=str(team_id), name=name, budget_period="month", **limits)
        assert response.status_code == 200, response.text
        return shown_key(response.text)

    def usage_rows(self) -> list:
        from sqlalchemy import select

        from app.tables import UsageRow

        assert self.gateway.writer.flush(10)
        with self.gateway.sessions() as session:
            return list(session.scalars(select(UsageRow).order_by(UsageRow.id)))


def login_token(html: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)


def page_csrf(html: str) -> str:
    return re.search(r'<meta name="csrf-token" content="([^"]*)"', html).group(1)


def shown_key(html: str) -> str:
    return re.search(r"data-new-key>([^<]+)<", html).group(1).strip()


def make_dashboard_gateway(tmp_path, **overrides):
    from app.gateway.config import GatewayConfig
    from app.gateway.service import TeamGateway

    values = {
        "database_url": f"sqlite:///{tmp_path / 'dashboard.db'}",
        "admin_key": ADMIN_KEY,
        "spill_dir": str(tmp_path / "spill"),
        "usage_flush_interval_s": 0.05,
        **overrides,
    }
    return TeamGateway(GatewayConfig(**values), clock=time.time)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(client: TestClient, key: str, content: str = "say hello", max_tokens: int = 5):
    from tests.support.gateway import chat_body

    return client.post("/v1/chat/completions", json=chat_body(content, max_tokens=max_tokens), headers=bearer(key))
