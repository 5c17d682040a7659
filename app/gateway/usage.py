"""Usage metering: one thin row per request, written in batches by a background thread that also
keeps the daily roll-up (same transaction, so the two never disagree).

The request path only appends to a deque. If the database is down the writer keeps the rows and
retries with backoff; rows beyond `buffer_max`, and rows still unwritten at shutdown, go to a JSONL
spill file that the next start replays. Nothing queued is dropped.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, Table, TextClause, text
from sqlalchemy.dialects import sqlite
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.orm import Session

from app.gateway.crud import touch_last_used
from app.tables import Base, UsageDaily, UsageRow

log = logging.getLogger("tokenmill.gateway.usage")

OK, ABORTED = "ok", "aborted"  # anything else counts as an error in the roll-up
ROLLUP_SUMS = ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_nano_usd")
SPILL_GLOB = "usage-spill-*.jsonl"
CLAIMED_GLOB = "usage-spill-*.replaying"  # being replayed, or left by a process that died replaying


@dataclass(slots=True)
class UsageEvent:
    created_at: datetime  # naive UTC, when the request arrived
    team_id: int
    key_id: int
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    latency_ms: int
    ttft_ms: int | None
    status: str
    cost_nano_usd: int
    replica: str | None = None  # GatewayConfig.instance_id of the process that served it
    batch: bool = False  # a line of a batch (Batch API)

    @property
    def is_error(self) -> bool:
        return self.status not in (OK, ABORTED)

    def row(self) -> dict[str, Any]:
        """The usage table's columns (dataclasses.asdict, without its deep copies)."""
        return {name: getattr(self, name) for name in self.__slots__}

    def to_json(self) -> str:
        data = self.row()
        data["created_at"] = self.created_at.isoformat()
        return json.dumps(data)

    @classmethod
    def from_json(cls, line: str) -> UsageEvent:
        data = json.loads(line)
        data["created_at"] = datetime.fromisoformat(data["created_at"])
        return cls(**data)


def rollup(events: Iterable[UsageEvent]) -> list[dict[str, Any]]:
    """Sum a batch per (day, key, model), sorted so concurrent writers lock roll-up rows in one order."""
    sums: dict[tuple[date, int, str], dict[str, Any]] = {}
    for e in events:
        row = sums.get((e.created_at.date(), e.key_id, e.model))
        if row is None:
            row = sums[(e.created_at.date(), e.key_id, e.model)] = {
                "day": e.created_at.date(),
                "key_id": e.key_id,
                "model": e.model,
                "team_id": e.team_id,
                **dict.fromkeys(ROLLUP_SUMS, 0),
            }
        row["requests"] += 1
        row["errors"] += e.is_error
        row["prompt_tokens"] += e.prompt_tokens
        row["cached_tokens"] += e.cached_tokens
        row["completion_tokens"] += e.completion_tokens
        row["cost_nano_usd"] += e.cost_nano_usd
    return [sums[k] for k in sorted(sums)]


def sqlite_rollup_upsert() -> sqlite.Insert:  # an Insert ... ON CONFLICT DO UPDATE
    """Add a roll-up row to the one already there: one statement run as executemany, so SQLAlchemy
    compiles it once (a multi-VALUES insert is compiled afresh for every batch size)."""
    stmt = sqlite.insert(UsageDaily)
    return stmt.on_conflict_do_update(
        index_elements=["day", "key_id", "model"],
        set_={name: getattr(UsageDaily, name) + getattr(stmt.excluded, name) for name in ROLLUP_SUMS},
    )


def unnest_insert(table: Table, columns: Sequence[str], suffix: str = "") -> TextClause:
    """PostgreSQL: INSERT ... SELECT FROM unnest(one array per column), a whole batch in one statement
    (psycopg's executemany sends and waits on the server row by row, all of it Python work on the
    writer thread)."""
    dialect = PGDialect_psycopg()  # postgresql.dialect, named as its class (a typed name)
    arrays = ", ".join(f"CAST(:{name} AS {table.c[name].type.compile(dialect=dialect)}[])" for name in columns)
    return text(f"INSERT INTO {table.name} ({', '.join(columns)}) SELECT * FROM unnest({arrays}) {suffix}")


def table_of(mapped: type[Base]) -> Table:
    """A declarative class's table (SQLAlchemy types it as any FromClause: a class may map a join)."""
    table = mapped.__table__
    assert isinstance(table, Table)
    return table


USAGE_TABLE = table_of(UsageRow)
USAGE_COLUMNS = UsageEvent.__slots__
ROLLUP_COLUMNS = ("day", "key_id", "model", "team_id", *ROLLUP_SUMS)
SQLITE_ROLLUP_UPSERT = sqlite_rollup_upsert()
PG_USAGE_COPY = f"COPY {UsageRow.__tablename__} ({', '.join(USAGE_COLUMNS)}) FROM STDIN"
PG_ROLLUP_UPSERT = unnest_insert(
    table_of(UsageDaily),
    ROLLUP_COLUMNS,
    "ON CONFLICT (day, key_id, model) DO UPDATE SET "
    + ", ".join(f"{name} = usage_daily.{name} + excluded.{name}" for name in ROLLUP_SUMS),
)


def write_batch(
    engine: Engine,
    events: Sequence[UsageEvent],
    *,
    key_times: dict[int, datetime] | None = None,
    team_times: dict[int, datetime] | None = None,
) -> None:
    with Session(engine) as session, session.begin():
        if events:
            # Core, not the ORM's bulk path: far less Python work per row (this thread holds the GIL
            # beside the event loop while it works).
            connection = session.connection()
            sums = rollup(events)
            if engine.dialect.name == "postgresql":  # COPY + one upsert: a third of executemany's CPU
                psycopg_connection = connection.connection.driver_connection
                assert psycopg_connection is not None  # a connection in use holds its driver's
                with psycopg_connection.cursor() as cursor, cursor.copy(PG_USAGE_COPY) as copy:
                    for event in events:
                        copy.write_row([getattr(event, name) for name in USAGE_COLUMNS])
                connection.execute(PG_ROLLUP_UPSERT, {name: [row[name] for row in sums] for name in ROLLUP_COLUMNS})
            else:  # SQLite's executemany loops in C
                connection.execute(USAGE_TABLE.insert(), [e.row() for e in events])
                connection.execute(SQLITE_ROLLUP_UPSERT, sums)
        if key_times or team_times:
            touch_last_used(session, key_times=key_times or {}, team_times=team_times or {})


class UsageWriter:
    def __init__(
        self,
        engine: Engine,
        *,
        spill_dir: str | os.PathLike[str],
        flush_interval_s: float = 0.5,
        batch_max: int = 5000,
        buffer_max: int = 2_000_000,
        last_used_flush_s: float = 10.0,
        on_committed: Callable[[Sequence[UsageEvent]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.spill_dir = Path(spill_dir)
        self.flush_interval_s = flush_interval_s
        self.batch_max = batch_max
        self.buffer_max = buffer_max
        self.last_used_flush_s = last_used_flush_s
        self.on_committed = on_committed
        self._buffer: deque[UsageEvent] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._key_times: dict[int, datetime] = {}
        self._team_times: dict[int, datetime] = {}
        self._last_used_flushed = time.monotonic()
        self._spill_lock = threading.Lock()
        self._spill_path = self.spill_dir / f"usage-spill-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        self._count_lock = threading.Lock()
        self.submitted = 0
        self.rows_written = 0
        self.rows_spilled = 0
        self.failures = 0

    # request side

    def submit(self, event: UsageEvent) -> None:
        with self._count_lock:
            self.submitted += 1
            queued = not self._closed and len(self._buffer) < self.buffer_max
            if queued:
                self._buffer.append(event)
        if not queued:
            self._spill([event])  # after shutdown, or the DB has been down for a very long time
            return
        if len(self._buffer) >= self.batch_max:
            with self._wake:
                self._wake.notify()

    def touch(self, *, key_id: int, team_id: int, when: datetime) -> None:
        """Remember last use; written with the next batch, at most every `last_used_flush_s`."""
        self._key_times[key_id] = when
        self._team_times[team_id] = when

    @property
    def pending(self) -> int:
        """Submitted but neither committed nor spilled yet."""
        return self.submitted - self.rows_written - self.rows_spilled

    # lifecycle

    def start(self) -> None:
        self.replay_spills()
        self._thread = threading.Thread(target=self._run, name="tokenmill-usage-writer", daemon=True)
        self._thread.start()

    def flush(self, timeout: float = 10.0) -> bool:
        """Write everything queued so far (tests, shutdown). True when the buffer is empty."""
        target = self.submitted
        deadline = time.monotonic() + timeout
        while self.rows_written + self.rows_spilled < target and time.monotonic() < deadline:
            if self._thread is None or not self._thread.is_alive():
                if not self._write_some(force_last_used=True):
                    time.sleep(0.05)
            else:
                with self._wake:
                    self._wake.notify()
                time.sleep(0.005)
        return self.rows_written + self.rows_spilled >= target

    def close(self, timeout: float = 30.0) -> None:
        """Graceful shutdown: flush; whatever the DB won't take in `timeout` is spilled to disk."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        deadline = time.monotonic() + max(timeout, 1.0)
        while self._buffer and time.monotonic() < deadline:
            if not self._write_some(force_last_used=True):
                time.sleep(0.2)
        with self._count_lock:
            self._closed = True  # from here on submit() spills straight to disk
        while self._buffer and self._write_some(force_last_used=True):
            pass
        if self._buffer:
            remaining = list(self._buffer)
            self._buffer.clear()
            self._spill(remaining)
            log.error("database unavailable at shutdown: %d usage rows spilled to %s", len(remaining), self._spill_path)
        elif self._key_times or self._team_times:
            self._write_some(force_last_used=True)

    # writer thread

    def _run(self) -> None:
        backoff = self.flush_interval_s
        while True:
            with self._wake:
                if not self._stopping and len(self._buffer) < self.batch_max:
                    self._wake.wait(backoff)
                stopping = self._stopping
            if self._buffer or self._last_used_due():
                ok = self._write_some(force_last_used=stopping)
                backoff = self.flush_interval_s if ok else min(max(backoff * 2, 0.5), 5.0)
                if ok and len(self._buffer) >= self.batch_max:
                    continue
            if stopping and (not self._buffer or backoff > self.flush_interval_s):
                return

    def _last_used_due(self) -> bool:
        return bool(self._key_times) and time.monotonic() - self._last_used_flushed >= self.last_used_flush_s

    def _write_some(self, *, force_last_used: bool = False) -> bool:
        batch: list[UsageEvent] = []
        while self._buffer and len(batch) < self.batch_max:
            batch.append(self._buffer.popleft())
        key_times: dict[int, datetime] = {}  # none due: write_batch touches nothing
        team_times: dict[int, datetime] = {}
        if force_last_used or self._last_used_due():
            key_times, self._key_times = self._key_times, {}
            team_times, self._team_times = self._team_times, {}
        try:
            write_batch(self.engine, batch, key_times=key_times, team_times=team_times)
        except Exception as exc:  # keep the rows, retry later
            self._buffer.extendleft(reversed(batch))
            if key_times:
                self._key_times = {**key_times, **self._key_times}
                self._team_times = {**team_times, **self._team_times}
            self.failures += 1
            if self.failures == 1 or self.failures % 20 == 0:
                log.warning(
                    "usage write failed (%d rows kept for retry): %s",
                    len(self._buffer),
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
            return False
        if key_times is not None:
            self._last_used_flushed = time.monotonic()
        with self._count_lock:
            self.rows_written += len(batch)
        if batch and self.on_committed is not None:
            self.on_committed(batch)
        return True

    # spill files

    def _spill(self, events: Sequence[UsageEvent]) -> None:
        with self._spill_lock:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            with open(self._spill_path, "a", encoding="utf-8") as f:
                f.writelines(e.to_json() + "\n" for e in events)
                f.flush()
                os.fsync(f.fileno())
        with self._count_lock:
            self.rows_spilled += len(events)

    def replay_spills(self) -> int:
        """Write rows a previous process spilled; each file is removed only after its rows committed.
        A file claimed by a process that died while replaying it (its lock went with it) is taken over."""
        if not self.spill_dir.is_dir():
            return 0
        paths = sorted({*self.spill_dir.glob(SPILL_GLOB), *self.spill_dir.glob(CLAIMED_GLOB)})
        return sum(self._replay(path) for path in paths if path != self._spill_path)

    def _replay(self, path: Path) -> int:
        claimed = path if path.suffix == ".replaying" else path.with_suffix(".replaying")
        if path != claimed:
            try:
                path.rename(claimed)  # one replica claims each file
            except OSError:
                return 0
        try:
            handle = open(claimed, encoding="utf-8")  # held locked while its rows are written
        except OSError:  # another replica replayed it meanwhile
            return 0
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a live replica is replaying it
                return 0
            try:
                if os.stat(claimed).st_ino != os.fstat(handle.fileno()).st_ino:
                    return 0
            except FileNotFoundError:  # replayed and removed while we waited for the lock
                return 0
            events = [UsageEvent.from_json(line) for line in handle.read().splitlines() if line.strip()]
            write_batch(self.engine, events)  # one transaction: all or none, so a retry can't double-bill
            claimed.unlink()
        if self.on_committed is not None:
            self.on_committed(events)
        log.info("replayed %d spilled usage rows from %s", len(events), path.name)
        return len(events)
