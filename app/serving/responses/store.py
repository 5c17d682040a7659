"""Stored responses: the Response object and the input items it answered, owned by one team, kept for
the retention period. The database when the gateway has one; a bounded memory store otherwise (a
server with one shared key and no database).

Blocking: call from a thread (run_in_threadpool)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import CursorResult, Select, delete, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from app.tables import StoredResponse, StoredResponseItem

log = logging.getLogger("tokenmill.responses")
PRUNE_EVERY_S = 60.0  # expired rows are removed at most this often, by the next write


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a follow-up (previous_response_id) continues: the input, then the output."""
        return [*self.input_items, *self.response["output"]]


def _naive_utc(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, UTC).replace(tzinfo=None)


class SqlResponseStore:
    def __init__(
        self, sessions: sessionmaker[Session], *, retention_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.sessions = sessions
        self.retention_s = retention_s
        self.clock = clock
        self._pruned_at = float("-inf")

    def save(self, team_id: int | None, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        now = self.clock()
        with self.sessions.begin() as session:  # the response and all its items, or nothing
            session.add(
                StoredResponse(
                    id=response["id"],
                    team_id=team_id,
                    model=response["model"],
                    created_at=_naive_utc(now),
                    expires_at=_naive_utc(now + self.retention_s),
                    body=response,
                )
            )
            session.flush()
            session.add_all(
                StoredResponseItem(response_id=response["id"], position=position, item=item)
                for position, item in enumerate(input_items)
            )
        if now - self._pruned_at >= PRUNE_EVERY_S:
            try:
                self.prune()
            except SQLAlchemyError:  # the response is kept; expired rows wait for the next write
                log.warning("pruning expired responses failed", exc_info=True)

    def get(self, response_id: str, team_id: int | None) -> Stored | None:
        with self.sessions() as session:
            row = session.scalar(self._owned(select(StoredResponse), response_id, team_id))
            if row is None:
                return None
            items = session.scalars(
                select(StoredResponseItem.item)
                .where(StoredResponseItem.response_id == row.id)
                .order_by(StoredResponseItem.position)
            )
            return Stored(row.body, list(items))

    def delete(self, response_id: str, team_id: int | None) -> bool:
        with self.sessions.begin() as session:
            row = session.scalar(self._owned(select(StoredResponse.id), response_id, team_id))
            if row is None:
                return False
            session.execute(delete(StoredResponseItem).where(StoredResponseItem.response_id == response_id))
            session.execute(delete(StoredResponse).where(StoredResponse.id == response_id))
            return True

    def prune(self) -> int:
        """Removes expired responses and their items; returns how many responses went."""
        now = self.clock()
        self._pruned_at = now
        expired = select(StoredResponse.id).where(StoredResponse.expires_at <= _naive_utc(now))
        with self.sessions.begin() as session:
            session.execute(delete(StoredResponseItem).where(StoredResponseItem.response_id.in_(expired)))
            removed = session.execute(delete(StoredResponse).where(StoredResponse.expires_at <= _naive_utc(now)))
            return cast(CursorResult[Any], removed).rowcount  # a DELETE's result is a CursorResult

    def _owned(self, query: Select[Any], response_id: str, team_id: int | None) -> Select[Any]:
        team = StoredResponse.team_id.is_(None) if team_id is None else StoredResponse.team_id == team_id
        return query.where(StoredResponse.id == response_id, team, StoredResponse.expires_at > _naive_utc(self.clock()))


class MemoryResponseStore:
    """The same contract in memory, for a server without a database: the newest `capacity` responses."""

    def __init__(self, *, retention_s: float, capacity: int = 10_000, clock: Callable[[], float] = time.time) -> None:
        self.retention_s = retention_s
        self.capacity = capacity
        self.clock = clock
        self._lock = threading.RLock()  # delete() reads under the lock it holds
        self._entries: OrderedDict[str, tuple[int | None, float, Stored]] = OrderedDict()

    def save(self, team_id: int | None, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        with self._lock:
            self._entries[response["id"]] = (team_id, self.clock() + self.retention_s, Stored(response, input_items))
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str, team_id: int | None) -> Stored | None:
        with self._lock:
            entry = self._entries.get(response_id)
        if entry is None or entry[0] != team_id or entry[1] <= self.clock():
            return None
        return entry[2]

    def delete(self, response_id: str, team_id: int | None) -> bool:
        with self._lock:
            if self.get(response_id, team_id) is None:
                return False
            del self._entries[response_id]
            return True

    def prune(self) -> int:
        now = self.clock()
        with self._lock:
            expired = [key for key, (_, expires_at, _) in self._entries.items() if expires_at <= now]
            for key in expired:
                del self._entries[key]
        return len(expired)


ResponseStore = SqlResponseStore | MemoryResponseStore


def response_store(sessions: sessionmaker[Session] | None, retention_s: float) -> ResponseStore:
    if sessions is None:
        return MemoryResponseStore(retention_s=retention_s)
    return SqlResponseStore(sessions, retention_s=retention_s)
