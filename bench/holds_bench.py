"""Admission holds, measured: how long one admission's hold (a key's in-flight seat and two budgets, all or
none) takes in each store, with the previous admission's release sent along as it is in service.

    python bench/holds_bench.py              # process, Redis, SQLite and PostgreSQL (all must be up)
    python bench/holds_bench.py -n 1000

Redis and PostgreSQL come from TOKENMILL_TEST_REDIS / TOKENMILL_TEST_PG (the test defaults otherwise); a
scratch PostgreSQL database is created and dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, text

from app.db import make_engine, migrate
from app.gateway.holds import REFUSED_NONE, HoldItem, Holds, LocalHolds
from app.gateway.holds_store import DatabaseHolds, RedisHolds

PG_SERVER = os.environ.get("TOKENMILL_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("TOKENMILL_TEST_REDIS", "redis://127.0.0.1:6379/0")
ITEMS = [
    HoldItem("in_flight:key:1", 10**9, 1),
    HoldItem("budget:key:1", 10**15, 5000),
    HoldItem("budget:team:1", 10**15, 5000),
]


async def timed(holds: Holds, count: int) -> tuple[float, float]:
    """p50 and p99 of one acquire, in ms."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        assert await holds.acquire(ITEMS) == REFUSED_NONE
        times.append(time.perf_counter() - started)
        holds.adjust({item.scope: -item.amount for item in ITEMS})
    await holds.close()
    times.sort()
    return statistics.median(times) * 1e3, times[int(0.99 * (len(times) - 1))] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=300, help="admissions per store")
    count = parser.parse_args().n
    stores = {"process": LocalHolds, "redis": lambda: RedisHolds(REDIS_URL, prefix=f"bench:{uuid.uuid4().hex[:8]}:")}
    scratch = Path(tempfile.mkdtemp()) / "holds.db"
    sqlite = make_engine(f"sqlite:///{scratch}")
    migrate(sqlite)
    stores["sqlite"] = lambda: DatabaseHolds(sqlite)
    admin = create_engine(PG_SERVER, isolation_level="AUTOCOMMIT")
    name = f"tokenmill_holds_bench_{os.getpid()}"
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        pg = make_engine(PG_SERVER.rsplit("/", 1)[0] + "/" + name)
        migrate(pg)
        stores["postgresql"] = lambda: DatabaseHolds(pg)
        for label, make in stores.items():
            p50, p99 = asyncio.run(timed(make(), count))
            print(f"{label:>10}: acquire p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  ({count} in a row)")
        pg.dispose()
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


if __name__ == "__main__":
    main()
