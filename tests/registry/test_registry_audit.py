"""Model changes through /admin/api/models are audited: register, aliases, prices, hardware cost,
disable / enable, unload and remove each write one row with the values before and after, as the admin
who made them; a refused change writes none."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import select

from app.tables import AuditEntry
from tests.registry.test_registry import checkpoint
from tests.support.gateway import FAKE_MODEL, admin_headers, build_app


def model_rows(gateway) -> list[AuditEntry]:
    query = select(AuditEntry).where(AuditEntry.target_type == "model", AuditEntry.actor_kind != "system")
    with gateway.sessions() as session:
        return list(session.scalars(query.order_by(AuditEntry.id)))


def test_each_model_change_writes_one_row_with_before_and_after(make_gateway, tmp_path):
    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:

        def admin(method: str, tail: str, **body):
            response = client.request(method, f"/admin/api/models{tail}", json=body or None, headers=admin_headers())
            assert response.status_code < 300, response.text
            return response

        admin("POST", "", name="tiny", path=str(checkpoint(tmp_path / "tiny")))
        admin("PATCH", "/tiny", aliases=["small"], price_input_per_1m=0.5, price_output_per_1m=1.5)
        admin("PATCH", "/tiny", hardware_cost_per_hour=2.25)
        admin("PATCH", "/tiny", enabled=False)
        admin("PATCH", "/tiny", enabled=True)
        admin("POST", f"/{FAKE_MODEL}/unload")
        admin("DELETE", "/tiny")
        refused = client.post(
            "/admin/api/models", json={"name": "bad", "path": str(tmp_path / "missing")}, headers=admin_headers()
        )
        assert refused.status_code == 400
    rows = model_rows(gateway)
    assert [(r.action, r.target_id) for r in rows] == [
        ("model.register", "tiny"),
        ("model.update", "tiny"),
        ("model.update", "tiny"),
        ("model.disable", "tiny"),
        ("model.enable", "tiny"),
        ("model.unload", FAKE_MODEL),
        ("model.remove", "tiny"),
    ]
    register, prices, hardware, disable, enable, unload, remove = rows
    assert register.before is None and register.after["source"].endswith("tiny") and register.after["enabled"]
    assert (prices.before["aliases"], prices.before["price_input_per_1m"], prices.before["price_output_per_1m"]) == (
        [],
        None,
        None,
    )
    assert (prices.after["aliases"], prices.after["price_input_per_1m"], prices.after["price_output_per_1m"]) == (
        ["small"],
        0.5,
        1.5,
    )
    assert (hardware.before, hardware.after) == ({"hardware_cost_per_hour": None}, {"hardware_cost_per_hour": 2.25})
    assert (disable.before, disable.after) == ({"enabled": True}, {"enabled": False})
    assert (enable.before, enable.after) == ({"enabled": False}, {"enabled": True})
    assert (unload.before, unload.after) == ({"state": "loaded"}, {"state": "draining"})
    assert remove.before["name"] == "tiny" and remove.after is None
    assert {r.actor_kind for r in rows} == {"admin_key"}
