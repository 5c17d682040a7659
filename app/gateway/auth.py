"""Who is calling: API key -> Principal (key + team and their limits), by SHA-256 lookup, cached.

The cache keeps a replica off the database on the hot path; a key changed through this process's
admin API is dropped from it at once, a key changed elsewhere (CLI, another replica) within
`ttl_s`. Expiry is checked on every request against the clock, not cached.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

from sqlalchemy.orm import Session, sessionmaker

from app import gateway_hooks as hooks
from app.gateway.budget import BudgetScope
from app.gateway.crud import find_key
from app.gateway.keys import hash_key
from app.gateway.ratelimit import Scope


@dataclass(frozen=True)
class Principal(hooks.Principal):
    """A team's key and the limits that apply to it. team_id / key_id are the database ids."""

    key_prefix: str = ""
    key_name: str = ""
    team_name: str = ""
    key_models: frozenset[str] = frozenset()
    team_models: frozenset[str] = frozenset()
    rate_scopes: tuple[Scope, ...] = ()
    budget_scopes: tuple[BudgetScope, ...] = ()
    expires_at: float | None = None  # unix seconds: the earlier of key and team expiry
    active: bool = False  # not revoked, team neither blocked nor deleted

    def allows(self, model: str) -> bool:
        return (not self.key_models or model in self.key_models) and (not self.team_models or model in self.team_models)

    def valid_at(self, now: float) -> bool:
        return self.active and (self.expires_at is None or now < self.expires_at)


def _unix(value: datetime | None) -> float | None:
    return None if value is None else value.replace(tzinfo=timezone.utc).timestamp()


def load_principal(sessions: sessionmaker[Session], key_hash: str) -> Principal | None:
    with sessions() as session:
        found = find_key(session, key_hash=key_hash)
    if found is None:
        return None
    key, team = found
    expiries = [t for t in (_unix(key.expires_at), _unix(team.expires_at)) if t is not None]
    return Principal(
        key_id=key.id, key_prefix=key.key_prefix, key_name=key.name, team_id=team.id, team_name=team.name,
        key_models=frozenset(key.allowed_models or ()), team_models=frozenset(team.allowed_models or ()),
        rate_scopes=(Scope(f"key:{key.id}", key.rpm_limit, key.tpm_limit),
                     Scope(f"team:{team.id}", team.rpm_limit, team.tpm_limit)),
        budget_scopes=tuple(
            BudgetScope(kind, ident, budget, period)
            for kind, ident, budget, period in (("key", key.id, key.max_budget_usd, key.budget_period),
                                                ("team", team.id, team.max_budget_usd, team.budget_period))
            if budget is not None),
        expires_at=min(expiries) if expiries else None,
        active=key.revoked_at is None and team.deleted_at is None and not team.blocked,
    )


class KeyCache:
    """hash -> Principal | None (unknown keys too, so guessing doesn't hammer the database)."""

    def __init__(self, sessions: sessionmaker[Session], *, ttl_s: float = 5.0, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sessions = sessions
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[str, tuple[Principal | None, float]] = OrderedDict()
        self.by_key_id: dict[int, Principal] = {}  # the latest principal loaded per key, for tpm accounting

    def cached(self, key: str) -> tuple[bool, Principal | None]:
        key_hash = hash_key(key)
        entry = self._entries.get(key_hash)
        if entry is None or self.clock() - entry[1] > self.ttl_s:
            return False, None
        return True, entry[0]

    def last_known(self, key: str) -> tuple[bool, Principal | None]:
        """The entry however old, for when the database can't be asked."""
        entry = self._entries.get(hash_key(key))
        return (False, None) if entry is None else (True, entry[0])

    def load(self, key: str) -> Principal | None:
        """Blocking: reads the database. Run it off the event loop."""
        key_hash = hash_key(key)
        principal = load_principal(self.sessions, key_hash)
        self._entries[key_hash] = (principal, self.clock())
        if principal is not None:
            self.by_key_id[principal.key_id] = principal
        self._entries.move_to_end(key_hash)
        while len(self._entries) > self.max_entries:
            _, (evicted, _) = self._entries.popitem(last=False)
            if evicted is not None:
                self.by_key_id.pop(evicted.key_id, None)
        return principal

    def invalidate(self, key_hashes: list[str] | None = None) -> None:
        if key_hashes is None:
            self._entries.clear()
        for key_hash in key_hashes or ():
            self._entries.pop(key_hash, None)


class FailedAuthLimiter:
    """Failed authentications per client address in a sliding window. Past `limit` the address is
    refused (429) before any key it sends is looked at, so keys can't be guessed at speed."""

    def __init__(self, limit: int = 10, *, window_s: float = 60.0, max_clients: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_clients = max_clients
        self.clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def retry_after(self, client: str) -> float | None:
        """Seconds until `client` may try again, or None when it may try now."""
        if self.limit <= 0:
            return None
        failures = self._recent(client)
        if failures is None or len(failures) < self.limit:
            return None
        return max(failures[0] + self.window_s - self.clock(), 0.0)

    def failed(self, client: str) -> None:
        if self.limit <= 0:
            return
        failures = self._recent(client)
        if failures is None:
            failures = self._failures[client] = deque()
        failures.append(self.clock())
        self._failures.move_to_end(client)
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)

    def _recent(self, client: str) -> deque[float] | None:
        failures = self._failures.get(client)
        if failures is None:
            return None
        horizon = self.clock() - self.window_s
        while failures and failures[0] <= horizon:
            failures.popleft()
        if not failures:
            del self._failures[client]
            return None
        return failures
