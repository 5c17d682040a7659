"""Migrations: from empty to head on both back ends, idempotent, down and up again, the schema they make
is the models' schema, concurrent start-ups are safe, and they run from an installed package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from app.db import current_revision, make_engine, migrate
from app.tables import Base

ROOT = Path(__file__).resolve().parents[2]
TABLES = {
    "teams",
    "api_keys",
    "admin_credentials",
    "admin_sessions",
    "usage",
    "reservation_holds",
    "usage_daily",
    "models",
    "responses",
    "response_input_items",
    "files",
    "batches",
    "batch_lines",
    "audit_log",
    "server_settings",
    "alembic_version",
}


def drop_everything(engine) -> None:
    Base.metadata.drop_all(engine)
    with engine.begin() as c:
        c.exec_driver_sql("DROP TABLE IF EXISTS alembic_version")


def test_migrations_run_from_empty_and_are_idempotent(database_url):
    engine = make_engine(database_url)
    drop_everything(engine)
    assert current_revision(engine) is None
    migrate(engine)
    assert set(inspect(engine).get_table_names()) == TABLES
    head = current_revision(engine)
    migrate(engine)  # a second start-up changes nothing
    assert current_revision(engine) == head
    with engine.connect() as c:
        assert compare_metadata(MigrationContext.configure(c), Base.metadata) == []
    engine.dispose()


def test_migrations_go_down_and_up_again(database_url):
    engine = make_engine(database_url)
    migrate(engine)
    from alembic import command

    from app.db import alembic_config

    config = alembic_config(engine)
    with engine.connect() as c:
        config.attributes["connection"] = c
        command.downgrade(config, "base")
        c.commit()
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    migrate(engine)
    assert set(inspect(engine).get_table_names()) == TABLES
    engine.dispose()


def test_concurrent_start_ups_migrate_once(database_url):
    engine = make_engine(database_url)
    drop_everything(engine)
    errors = []

    def start() -> None:
        try:
            migrate(make_engine(database_url))
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []  # PostgreSQL: an advisory lock; SQLite: a lock file beside the database
    assert current_revision(engine) is not None
    engine.dispose()


def test_migrations_run_from_an_installed_package(tmp_path):
    """Build the wheel, install it away from the source tree, migrate a fresh SQLite file from there."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("app", "engine", "kernels", "migrations"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", source)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
        ],
        check=True,
        cwd=tmp_path,
    )
    [wheel] = (tmp_path / "wheel").glob("tokenmill-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_path / "site"), str(wheel)],
        check=True,
        cwd=tmp_path,
    )
    script = (
        "import app.db, migrations, sys\n"
        "assert app.db.__file__.startswith(sys.argv[1]), app.db.__file__\n"
        "engine = app.db.make_engine('sqlite:///' + sys.argv[2])\n"
        "app.db.migrate(engine)\n"
        "print(app.db.current_revision(engine))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "site"), str(tmp_path / "x.db")],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0020_embedded_greedy_defaults"
