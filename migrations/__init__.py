"""Alembic migrations, shipped in the package so start-up can run them (see app.db.migrate)."""
