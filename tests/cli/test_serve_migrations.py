"""`tokenmill serve` migrates the database once per start: before the model loads (so a bad --api-key or an
unreachable database fails fast), and never again when the gateway starts."""

from __future__ import annotations

import httpx
import uvicorn

import app.db
from app.cli.main import main
from tests.support.gateway import FakeEngine, serve_in_thread


class StoppableFakeEngine(FakeEngine):
    model_name = "fake-model"

    def shutdown(self) -> None:
        pass


def test_serve_runs_the_migrations_once_per_start(tmp_path, monkeypatch):
    from app.gateway.wiring import gateway_from_settings
    from app.main import create_app

    runs = []
    real_migrate = app.db.migrate

    def counted_migrate(engine) -> None:  # engine: a SQLAlchemy engine
        runs.append(str(engine.url))
        real_migrate(engine)

    for module in ("app.gateway.wiring", "app.gateway.service"):
        monkeypatch.setattr(f"{module}.migrate", counted_migrate)
    monkeypatch.setattr(
        "app.scaleout.replica_app.build_server",
        lambda settings, migrated=False: (
            create_app(
                settings, engine := StoppableFakeEngine(), gateway=gateway_from_settings(settings, migrated=migrated)
            ),
            engine,
        ),
    )
    answers = []

    def run(application, **options) -> None:  # as uvicorn.run is called
        options = {name: value for name, value in options.items() if name not in ("host", "port")}
        with serve_in_thread(application, **options) as url:
            answers.append(httpx.get(f"{url}/health").status_code)

    monkeypatch.setattr(uvicorn, "run", run)
    database = f"sqlite:///{tmp_path / 'tokenmill.db'}"
    for _ in range(2):  # a first start (tables created, admin key made) and a second one
        runs.clear()
        assert (
            main(
                [
                    "serve",
                    "--data-dir",
                    str(tmp_path),
                    "--database-url",
                    database,
                    "--log-level",
                    "warning",
                    "--api-key",
                    "sk-chosen-by-the-operator-0123456789",
                ]
            )
            == 0
        )
        assert runs == [database]
    assert answers == [200, 200]
