"""`tokenmill serve` migrates the database once per start: before the model loads (so a bad --api-key or an
unreachable database fails fast), and never again when the gateway starts."""

from __future__ import annotations

import httpx

import app.db
from tests.support.gateway import serve_and_probe


def test_serve_runs_the_migrations_once_per_start(tmp_path, monkeypatch):
    runs = []
    real_migrate = app.db.migrate

    def counted_migrate(engine) -> None:  # engine: a SQLAlchemy engine
        runs.append(str(engine.url))
        real_migrate(engine)

    for module in ("app.gateway.wiring", "app.gateway.service"):
        monkeypatch.setattr(f"{module}.migrate", counted_migrate)
    database = f"sqlite:///{tmp_path / 'tokenmill.db'}"
    for _ in range(2):  # a first start (tables created, admin key made) and a second one
        runs.clear()
        health = serve_and_probe(
            tmp_path,
            monkeypatch,
            lambda url: httpx.get(f"{url}/health").status_code,
            "--api-key",
            "sk-chosen-by-the-operator-0123456789",
            admin_key=None,
        )
        assert health == 200
        assert runs == [database]
