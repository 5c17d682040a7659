"""Reading the audit log: filtered, newest first, keyset pages (`after`: the last id seen) or CSV; and
pruning it after the retention setting. Writing it is app.gateway.audit's."""

from __future__ import annotations

import asyncio
import csv
import io
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, Text, delete, or_, select
from sqlalchemy import cast as sql_cast
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from app.gateway.crud import utcnow
from app.tables import AuditEntry

log = logging.getLogger("tokenmill.audit")

CSV_COLUMNS = (
    "id",
    "created_at",
    "actor_kind",
    "actor_id",
    "actor_display",
    "action",
    "target_type",
    "target_id",
    "before",
    "after",
)
CSV_PAGE = 5000


@dataclass(frozen=True)
class AuditFilter:
    actor: str | None = None  # an actor's id or display (an admin credential id, an SSO subject or email)
    action: str | None = None  # exact ("key.rotate"), or every action on a target type ("key.")
    target_type: str | None = None
    target_id: str | None = None
    since: datetime | None = None  # inclusive, naive UTC
    until: datetime | None = None  # exclusive

    def where(self) -> list[Any]:
        clauses: list[Any] = []
        if self.actor:
            clauses.append(or_(AuditEntry.actor_id == self.actor, AuditEntry.actor_display == self.actor))
        if self.action:
            action = self.action
            if action.endswith("."):
                clauses.append(AuditEntry.action.startswith(action, autoescape=True))
            else:
                clauses.append(AuditEntry.action == action)
        if self.target_type:
            clauses.append(AuditEntry.target_type == self.target_type)
        if self.target_id:
            clauses.append(AuditEntry.target_id == self.target_id)
        if self.since is not None:
            clauses.append(AuditEntry.created_at >= self.since)
        if self.until is not None:
            clauses.append(AuditEntry.created_at < self.until)
        return clauses


def list_entries(session: Session, where: AuditFilter, *, limit: int, after: int | None = None) -> Sequence[AuditEntry]:
    """Newest first; `after` is the last id of the previous page."""
    query = select(AuditEntry).where(*where.where()).order_by(AuditEntry.id.desc()).limit(limit)
    if after is not None:
        query = query.where(AuditEntry.id < after)
    return session.scalars(query).all()


def csv_chunks(sessions: sessionmaker[Session], where: AuditFilter) -> Iterator[str]:
    """The whole filtered log as CSV, a page of rows per chunk (a session per page: a long download
    holds no transaction open)."""
    yield _csv_lines([CSV_COLUMNS])
    # Plain rows, the JSON columns as the database's text: no objects built, no JSON parsed and dumped
    # again (that was half the time of a 100k-row export).
    columns = [
        sql_cast(column, Text).label(name) if name in ("before", "after") else column
        for name, column in ((name, getattr(AuditEntry, name)) for name in CSV_COLUMNS)
    ]
    after: int | None = None
    while True:
        query = select(*columns).where(*where.where()).order_by(AuditEntry.id.desc()).limit(CSV_PAGE)
        if after is not None:
            query = query.where(AuditEntry.id < after)
        with sessions() as session:
            page = session.execute(query).all()
        yield _csv_lines([csv_row(dict(row._mapping)) for row in page])
        if len(page) < CSV_PAGE:
            return
        after = page[-1].id


def csv_row(values: Mapping[str, Any]) -> list[Any]:
    cells = dict(values)
    cells["created_at"] = values["created_at"].isoformat() + "Z"
    for column in ("before", "after"):
        cells[column] = "" if values[column] in (None, "null") else values[column]
    return [cells[column] for column in CSV_COLUMNS]


def _csv_lines(rows: Sequence[Sequence[Any]]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer).writerows([_inert(cell) for cell in row] for row in rows)
    return buffer.getvalue()


def _inert(cell: Any) -> Any:
    """A cell a spreadsheet would run as a formula (a team named "=HYPERLINK(...)") is made text."""
    if isinstance(cell, str) and cell[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + cell
    return "" if cell is None else cell


# retention


def prune(session: Session, *, retention_days: float, now: datetime | None = None) -> int:
    """Deletes the rows older than the retention; returns how many went."""
    horizon = (now or utcnow()) - timedelta(days=retention_days)
    removed = session.execute(delete(AuditEntry).where(AuditEntry.created_at < horizon))
    return cast(CursorResult[Any], removed).rowcount  # a DELETE's result is a CursorResult


class AuditPruner:
    """Prunes at start and then every `interval_s`, in a thread (replicas doing it at once is harmless:
    the second finds nothing to delete)."""

    def __init__(self, sessions: sessionmaker[Session], *, retention_days: float, interval_s: float = 3600.0) -> None:
        self.sessions = sessions
        self.retention_days = retention_days
        self.interval_s = interval_s
        self._task: asyncio.Task[Any] | None = None

    def prune_now(self) -> int:
        with self.sessions() as session, session.begin():
            return prune(session, retention_days=self.retention_days)

    async def astart(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._every())

    async def astop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _every(self) -> None:
        while True:
            try:
                removed = await run_in_threadpool(self.prune_now)
                if removed:
                    log.info("pruned %d audit rows older than %g days", removed, self.retention_days)
            except Exception as error:  # the store may be away for a while; try again next round
                log.warning("could not prune the audit log: %s", error)
            await asyncio.sleep(self.interval_s)
