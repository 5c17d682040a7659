"""Budgets: spend per key / team in the current day or month (UTC) against `max_budget_usd`.

Spend = what the daily roll-up holds (cached briefly) + what this process has queued but not yet
committed. The roll-up is the ledger, so budgets survive restarts and a Redis flush; replicas see
each other's spend within a flush interval plus the cache TTL. Spends in use are reloaded ahead of
their TTL in the background (one grouped query per kind and period), so requests don't wait on the
database for them.

What requests in flight may still cost is held apart (app/gateway/holds.py). With shared holds (Redis
or the database, for replicas) a finished request's cost stays held there until every replica's cached
spend includes it, so this tracker then counts only the roll-up: no local pending, and a cached spend
is trusted for the TTL from when its read began.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime

from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from app.gateway.refresh import RefreshRounds
from app.gateway.usage import UsageEvent
from app.tables import NANO, UsageDaily


@dataclass(frozen=True)
class BudgetScope:
    kind: str  # "key" | "team"
    id: int
    max_budget_usd: float | None
    period: str  # "day" | "month"

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.id}"


def period_start(period: str, today: date) -> date:
    return today if period == "day" else today.replace(day=1)


class _Spend:
    __slots__ = ("fetched_at", "nano_usd", "used")

    def __init__(self, nano_usd: int, fetched_at: float) -> None:
        self.nano_usd = nano_usd
        self.fetched_at = fetched_at  # monotonic; 0.0: not to be trusted, read again before use
        self.used = False  # asked for since it was read: worth reading again ahead of its TTL


class BudgetTracker:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        cache_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        shared: bool = False,
    ) -> None:
        self.sessions = sessions
        self.shared = shared
        self.cache_ttl_s = cache_ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._committed: dict[tuple[str, date], _Spend] = {}  # (scope, period start) -> committed spend
        self._pending: dict[str, dict[date, int]] = {}  # scope -> day -> nano USD queued, not committed
        self._generation = 0  # bumped per committed batch
        self.refreshes = RefreshRounds(self.refresh_due, "budget")

    def today(self) -> date:
        return datetime.fromtimestamp(self.clock(), UTC).date()

    def spent_nano_usd(self, scope: BudgetScope) -> int:
        """Blocking (may query the DB): call off the event loop when not cached."""
        start = period_start(scope.period, self.today())
        committed = self._cached(scope, start)
        if committed is None:
            try:
                committed = self._refresh(scope, start)
            except SQLAlchemyError:
                stale = self._committed.get((scope.name, start))
                if stale is None:
                    raise
                committed = stale.nano_usd  # the store is away: the last spend we saw plus what we queued since
        with self._lock:
            pending = sum(v for day, v in self._pending.get(scope.name, {}).items() if day >= start)
        return committed + pending

    def needs_refresh(self, scope: BudgetScope) -> bool:
        """Whether the spend must be read before answering (unknown, or older than the TTL). On the
        event loop, a cached spend past half its TTL is reloaded in the background."""
        entry = self._committed.get((scope.name, period_start(scope.period, self.today())))
        if entry is None:
            return True
        age = time.monotonic() - entry.fetched_at
        if age > self.cache_ttl_s:
            return True
        entry.used = True
        if age > self.cache_ttl_s / 2:
            self.refreshes.soon()
        return False

    def read_at(self, scope: BudgetScope) -> float:
        """When (monotonic) the cached spend's read began; -inf when none is cached."""
        entry = self._committed.get((scope.name, period_start(scope.period, self.today())))
        return entry.fetched_at if entry is not None and entry.fetched_at else float("-inf")

    def left_nano_usd(self, scope: BudgetScope) -> int:
        """What is left of the scope's budget before holds (cached: call after needs_refresh is False)."""
        assert scope.max_budget_usd is not None
        return round(scope.max_budget_usd * NANO) - self.spent_nano_usd(scope)

    def _cached(self, scope: BudgetScope, start: date) -> int | None:
        entry = self._committed.get((scope.name, start))
        if entry is None or time.monotonic() - entry.fetched_at > self.cache_ttl_s:
            return None
        return entry.nano_usd

    def _refresh(self, scope: BudgetScope, start: date) -> int:
        column = UsageDaily.key_id if scope.kind == "key" else UsageDaily.team_id
        generation, started = self._generation, time.monotonic()
        with self.sessions() as session:
            total = session.execute(  # one row: an aggregate's
                select(func.coalesce(func.sum(UsageDaily.cost_nano_usd), 0)).where(
                    column == scope.id, UsageDaily.day >= start
                )
            ).scalar_one()
        with self._lock:
            # A batch committed while we read may or may not be in `total`: don't trust it for long.
            if self.shared:  # a batch committed before the read began is in it, whoever committed it
                fetched_at = started
            else:
                fetched_at = time.monotonic() if generation == self._generation else 0.0
            self._committed[(scope.name, start)] = _Spend(int(total), fetched_at)
        return int(total)

    def refresh_due(self) -> int:
        """Blocking: read again every spend in use that is past half its TTL (or nearly so, so that
        reads come in rounds), one grouped query per kind and period start. Returns how many."""
        generation, now = self._generation, time.monotonic()
        horizon = now - self.cache_ttl_s / 4
        groups: dict[tuple[str, date], list[int]] = {}
        with self._lock:
            for (name, start), entry in self._committed.items():
                if entry.used and entry.fetched_at < horizon:
                    kind, _, ident = name.partition(":")
                    groups.setdefault((kind, start), []).append(int(ident))
        if not groups:
            return 0
        totals: dict[tuple[str, date], int] = {}
        with self.sessions() as session:
            for (kind, start), ids in groups.items():
                column = UsageDaily.key_id if kind == "key" else UsageDaily.team_id
                sums = dict.fromkeys(ids, 0)
                sums.update(
                    session.execute(
                        select(column, func.sum(UsageDaily.cost_nano_usd))
                        .where(column.in_(ids), UsageDaily.day >= start)
                        .group_by(column)
                    ).all()
                )
                totals.update({(f"{kind}:{ident}", start): int(total or 0) for ident, total in sums.items()})
        with self._lock:
            if generation == self._generation:  # else a batch landed meanwhile: keep the entries it updated
                for slot, total in totals.items():
                    self._committed[slot] = _Spend(total, now)
        return len(totals)

    # fed by the gateway (queued) and the usage writer (committed)

    def queued(self, event: UsageEvent) -> None:
        if not event.cost_nano_usd or self.shared:  # shared: its cost is held until committed and seen
            return
        day = event.created_at.date()
        with self._lock:
            for name in (f"key:{event.key_id}", f"team:{event.team_id}"):
                days = self._pending.setdefault(name, {})
                days[day] = days.get(day, 0) + event.cost_nano_usd

    def committed(self, events: Sequence[UsageEvent]) -> None:
        if self.shared:  # a cached spend that lacks them is trusted no longer than their holds last
            return
        spent: dict[tuple[str, date], int] = {}
        for event in events:
            if event.cost_nano_usd:
                day = event.created_at.date()
                for name in (f"key:{event.key_id}", f"team:{event.team_id}"):
                    spent[(name, day)] = spent.get((name, day), 0) + event.cost_nano_usd
        by_scope: dict[str, list[date]] = {}
        for name, day in spent:
            by_scope.setdefault(name, []).append(day)
        with self._lock:
            self._generation += 1
            for (name, day), amount in spent.items():
                days = self._pending.get(name, {})
                left = days.get(day, 0) - amount
                if left > 0:
                    days[day] = left
                else:
                    days.pop(day, None)
                    if not days:
                        self._pending.pop(name, None)
            for (name, start), entry in self._committed.items():
                for day in by_scope.get(name, ()):
                    if day >= start:
                        entry.nano_usd += spent[(name, day)]
