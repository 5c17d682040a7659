"""Stored responses: the Response object and the input items it answered, owned by one team, kept for
the retention period. The database when the gateway has one; a bounded memory store otherwise (a
server with one shared key and no database).

Each response keeps only its own request's input items; the whole input of turn n (what input_items
lists, what turn n+1 continues) is rebuilt by walking previous_response_id back: turn 1's input, its
output, turn 2's input, ... So storage grows with what was sent, not with its square (12 turns stored
1.5 MB for 0.23 MB sent). A chain stops at a response that is gone (deleted or expired).

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


MAX_CHAIN = 10_000  # turns walked back at most (each turn has at least one input item; requests cap those)


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]  # the whole input, earlier turns included (rebuilt when read)

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a follow-up (previous_response_id) continues: the input, then the output."""
        return [*self.input_items, *self.response["output"]]


@dataclass(frozen=True)
class Link:
    """One stored response as kept: its own input items, or (not chained: stored before chaining) all."""

    response: dict[str, Any]
    items: list[dict[str, Any]]
    chained: bool


def rebuild(newest: Link, earlier: Callable[[str], Link | None]) -> Stored:
    """The newest response with its whole input: the chain walked back through previous_response_id."""
    links = [newest]
    while links[-1].chained and len(links) < MAX_CHAIN:
        previous_id = links[-1].response.get("previous_response_id")
        found = earlier(previous_id) if isinstance(previous_id, str) else None
        if found is None:
            break
        links.append(found)
    whole: list[dict[str, Any]] = []
    for link in reversed(links[1:]):
        whole.extend(link.items)
        whole.extend(link.response.get("output") or [])
    whole.extend(newest.items)
    return Stored(newest.response, whole)


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
        """`input_items`: what this request sent, not the earlier turns (previous_response_id has them)."""
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
                    chained=True,
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

            def link(wanted: str) -> Link | None:
                row = session.scalar(self._owned(select(StoredResponse), wanted, team_id))
                if row is None:
                    return None
                items = session.scalars(
                    select(StoredResponseItem.item)
                    .where(StoredResponseItem.response_id == row.id)
                    .order_by(StoredResponseItem.position)
                )
                return Link(row.body, list(items), bool(row.chained))

            newest = link(response_id)
            return None if newest is None else rebuild(newest, link)

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
        self._entries: OrderedDict[str, tuple[int | None, float, Link]] = OrderedDict()

    def save(self, team_id: int | None, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        with self._lock:
            entry = (team_id, self.clock() + self.retention_s, Link(response, list(input_items), True))
            self._entries[response["id"]] = entry
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def _link(self, response_id: str, team_id: int | None) -> Link | None:
        with self._lock:
            entry = self._entries.get(response_id)
        if entry is None or entry[0] != team_id or entry[1] <= self.clock():
            return None
        return entry[2]

    def get(self, response_id: str, team_id: int | None) -> Stored | None:
        newest = self._link(response_id, team_id)
        return None if newest is None else rebuild(newest, lambda wanted: self._link(wanted, team_id))

    def delete(self, response_id: str, team_id: int | None) -> bool:
        with self._lock:
            if self._link(response_id, team_id) is None:
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
