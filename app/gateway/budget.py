"""Budgets: spend per key / team in the current day or month (UTC) against `max_budget_usd`.

Spend = what the daily roll-up holds (cached briefly) + what this process has queued but not yet
committed. The roll-up is the ledger, so budgets survive restarts and a Redis flush; replicas see
each other's spend within a flush interval plus the cache TTL. Like any pre-request check it is
soft by the requests already in flight.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import date, datetime, timezone
from typing import Callable, Sequence

from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from app.gateway.models import NANO, UsageDaily
from app.gateway.usage import UsageEvent


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


class BudgetTracker:
    def __init__(self, sessions: sessionmaker[Session], *, cache_ttl_s: float = 2.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.sessions = sessions
        self.cache_ttl_s = cache_ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._committed: dict[tuple[str, date], tuple[int, float]] = {}  # -> (nano USD, fetched at)
        self._pending: dict[tuple[str, date], int] = {}  # (scope, day) -> nano USD queued, not committed
        self._generation = 0

    def today(self) -> date:
        return datetime.fromtimestamp(self.clock(), timezone.utc).date()

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
                committed = stale[0]  # the store is away: the last spend we saw plus what we queued since
        with self._lock:
            pending = sum(v for (name, day), v in self._pending.items() if name == scope.name and day >= start)
        return committed + pending

    def needs_refresh(self, scope: BudgetScope) -> bool:
        return self._cached(scope, period_start(scope.period, self.today())) is None

    def first_exhausted(self, scopes: Sequence[BudgetScope]) -> BudgetScope | None:
        for scope in scopes:
            if scope.max_budget_usd is not None and self.spent_nano_usd(scope) >= scope.max_budget_usd * NANO:
                return scope
        return None

    def _cached(self, scope: BudgetScope, start: date) -> int | None:
        entry = self._committed.get((scope.name, start))
        if entry is None or time.monotonic() - entry[1] > self.cache_ttl_s:
            return None
        return entry[0]

    def _refresh(self, scope: BudgetScope, start: date) -> int:
        column = UsageDaily.key_id if scope.kind == "key" else UsageDaily.team_id
        generation = self._generation
        with self.sessions() as session:
            total = session.scalar(select(func.coalesce(func.sum(UsageDaily.cost_nano_usd), 0))
                                  .where(column == scope.id, UsageDaily.day >= start))
        with self._lock:
            # A batch committed while we read may or may not be in `total`: don't trust it for long.
            fetched_at = time.monotonic() if generation == self._generation else 0.0
            self._committed[(scope.name, start)] = (int(total), fetched_at)
        return int(total)

    # fed by the gateway (queued) and the usage writer (committed)

    def queued(self, event: UsageEvent) -> None:
        if not event.cost_nano_usd:
            return
        day = event.created_at.date()
        with self._lock:
            for name in (f"key:{event.key_id}", f"team:{event.team_id}"):
                self._pending[(name, day)] = self._pending.get((name, day), 0) + event.cost_nano_usd

    def committed(self, events: Sequence[UsageEvent]) -> None:
        spent: dict[tuple[str, date], int] = {}
        for event in events:
            if event.cost_nano_usd:
                day = event.created_at.date()
                for name in (f"key:{event.key_id}", f"team:{event.team_id}"):
                    spent[(name, day)] = spent.get((name, day), 0) + event.cost_nano_usd
        with self._lock:
            self._generation += 1
            for slot, amount in spent.items():
                left = self._pending.get(slot, 0) - amount
                if left > 0:
                    self._pending[slot] = left
                else:
                    self._pending.pop(slot, None)
            for (name, start), (total, fetched_at) in list(self._committed.items()):
                added = sum(v for (n, day), v in spent.items() if n == name and day >= start)
                if added:
                    self._committed[(name, start)] = (total + added, fetched_at)
