"""The dashboard tests' app: the real gateway on SQLite over the fake engine, with a client."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.support.dashboard import BASE_URL, DashboardClient, make_dashboard_gateway
from tests.support.gateway import FakeEngine, build_app


@pytest.fixture
def dashboard(tmp_path):
    """A fresh app (fake engine, real gateway on SQLite) and a client that is not logged in yet."""
    gateway = make_dashboard_gateway(tmp_path)
    app = build_app(gateway, FakeEngine(), hardware_cost_per_hour=2.0)
    with TestClient(app, base_url=BASE_URL) as client:
        yield DashboardClient(client, gateway, app)


@pytest.fixture
def admin(dashboard):
    """The same, logged in."""
    dashboard.log_in()
    return dashboard
