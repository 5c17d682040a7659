"""Alembic environment. app.db.migrate passes a live connection; `alembic` on the command line
(with `-x url=...` or TOKENMILL_DATABASE_URL) builds its own."""

from __future__ import annotations

import os

from alembic import context

from app.db import make_engine, normalize_url
from app.tables import Base

config = context.config
target_metadata = Base.metadata


def run_offline() -> None:
    url = config.get_main_option("sqlalchemy.url")
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    url = url or os.environ.get("TOKENMILL_DATABASE_URL")
    engine = make_engine(normalize_url(url))
    with engine.connect() as connection:
        _run(connection)
        connection.commit()


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # ALTER TABLE on SQLite = copy-and-move
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
