"""Who is calling: API key -> KeyPrincipal (key + team and their limits), by SHA-256 lookup, cached.

The cache keeps a replica off the database on the hot path. A key changed through this process's
admin API is dropped from it at once; a key changed elsewhere (CLI, another replica) within `ttl_s`,
because no entry older than that is ever served. Keys in use are reloaded ahead of their TTL, in the
background and all in one query, so a request only waits on the database for a key it hasn't seen
lately. Expiry is checked on every request against the clock, not cached.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from app.gateway import contract
from app.gateway.budget import BudgetScope
from app.gateway.crud import find_key
from app.gateway.keys import hash_key
from app.gateway.ratelimit import Scope
from app.gateway.refresh import RefreshRounds
from app.tables import ApiKey, Team


@dataclass(frozen=True)
class KeyPrincipal(contract.Principal):
    """A team's key and the limits that apply to it. team_id / key_id are the database ids."""

    team_id: int  # a key always has both (Principal's are None for callers without a key)
    key_id: int
    key_prefix: str = ""
    key_name: str = ""
    team_name: str = ""
    key_models: frozenset[str] = frozenset()
    team_models: frozenset[str] = frozenset()
    rate_scopes: tuple[Scope, ...] = ()
    budget_scopes: tuple[BudgetScope, ...] = ()
    expires_at: float | None = None  # unix seconds: the earlier of key and team expiry
    active: bool = False  # not revoked, team neither blocked nor deleted
    max_in_flight: int | None = None  # the key's own cap on requests at once (None: the server's setting)

    def allows(self, model: str) -> bool:
        return (not self.key_models or model in self.key_models) and (not self.team_models or model in self.team_models)

    def valid_at(self, now: float) -> bool:
        return self.active and (self.expires_at is None or now < self.expires_at)


def _unix(value: datetime | None) -> float | None:
    return None if value is None else value.replace(tzinfo=UTC).timestamp()


def principal_of(key: ApiKey, team: Team, key_hash: str | None = None) -> KeyPrincipal:
    """The principal for `key`'s secret that hashes to `key_hash` (None: its current one). A previous
    secret (rotated away) expires at the end of its grace period, whatever the key's own expiry says;
    expiry is checked on every request, so a cached old secret can't outlive its grace."""
    grace_end = key.previous_key_expires_at if key_hash is not None and key_hash != key.key_hash else None
    times = (_unix(key.expires_at), _unix(team.expires_at), _unix(grace_end))
    expiries = [t for t in times if t is not None]
    return KeyPrincipal(
        key_id=key.id,
        key_prefix=key.key_prefix,
        key_name=key.name,
        team_id=team.id,
        team_name=team.name,
        key_models=frozenset(key.allowed_models or ()),
        team_models=frozenset(team.allowed_models or ()),
        rate_scopes=(
            Scope(f"key:{key.id}", key.rpm_limit, key.tpm_limit),
            Scope(f"team:{team.id}", team.rpm_limit, team.tpm_limit),
        ),
        budget_scopes=tuple(
            BudgetScope(kind, ident, budget, period)
            for kind, ident, budget, period in (
                ("key", key.id, key.max_budget_usd, key.budget_period),
                ("team", team.id, team.max_budget_usd, team.budget_period),
            )
            if budget is not None
        ),
        expires_at=min(expiries) if expiries else None,
        active=key.revoked_at is None and team.deleted_at is None and not team.blocked,
        team_weight=team.scheduling_weight if team.scheduling_weight is not None else 1.0,
        cache_group=team.cache_group,
        priority_floor=key.priority_floor if key.priority_floor is not None else 0,
        max_in_flight=key.max_in_flight,
    )


def load_principal(sessions: sessionmaker[Session], key_hash: str) -> KeyPrincipal | None:
    with sessions() as session:
        found = find_key(session, key_hash=key_hash)
    return None if found is None else principal_of(*found, key_hash)


def load_principals(sessions: sessionmaker[Session], key_hashes: list[str]) -> dict[str, KeyPrincipal | None]:
    """Many keys in one query per 500; a hash with no key maps to None."""
    found: dict[str, KeyPrincipal | None] = dict.fromkeys(key_hashes)
    with sessions() as session:
        for start in range(0, len(key_hashes), 500):
            chunk = key_hashes[start : start + 500]
            rows = session.execute(
                select(ApiKey, Team)
                .join(Team, Team.id == ApiKey.team_id)
                .where(or_(ApiKey.key_hash.in_(chunk), ApiKey.previous_key_hash.in_(chunk)))
            )
            for key, team in rows:
                for key_hash in (key.key_hash, key.previous_key_hash):
                    if key_hash in found:
                        found[key_hash] = principal_of(key, team, key_hash)
    return found


class _Entry:
    __slots__ = ("loaded_at", "principal", "used")

    def __init__(self, principal: KeyPrincipal | None, loaded_at: float) -> None:
        self.principal = principal
        self.loaded_at = loaded_at
        self.used = False  # looked up since it was loaded: worth reloading ahead of its TTL


class KeyCache:
    """hash -> KeyPrincipal | None (unknown keys too, so guessing doesn't hammer the database)."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        ttl_s: float = 5.0,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sessions = sessions
        self.ttl_s = ttl_s
        self.refresh_after_s = ttl_s / 2  # an entry in use this old is reloaded in the background
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()  # writers (worker threads); the event loop only reads
        self._generation = 0  # bumped by invalidate(): a load that started before it is not kept
        self.refreshes = RefreshRounds(self.refresh_due, "key")
        self.by_key_id: dict[int, KeyPrincipal] = {}  # the latest principal loaded per key, for tpm accounting

    @property
    def generation(self) -> int:
        """How many times the cache was invalidated (an admin change here): the batch runner reloads a
        running batch's key when it moves."""
        return self._generation

    def cached(self, key: str) -> tuple[bool, KeyPrincipal | None]:
        """(hit, principal). On the event loop, a hit that is due starts a background refresh."""
        entry = self._entries.get(hash_key(key))
        if entry is None:
            return False, None
        age = self.clock() - entry.loaded_at
        if age > self.ttl_s:
            return False, None
        entry.used = True
        if age > self.refresh_after_s:
            self.refreshes.soon()
        return True, entry.principal

    def last_known(self, key: str) -> tuple[bool, KeyPrincipal | None]:
        """The entry however old, for when the database can't be asked."""
        entry = self._entries.get(hash_key(key))
        return (False, None) if entry is None else (True, entry.principal)

    def load(self, key: str) -> KeyPrincipal | None:
        """Blocking: reads the database. Run it off the event loop."""
        key_hash = hash_key(key)
        generation, loaded_at = self._generation, self.clock()
        principal = load_principal(self.sessions, key_hash)
        self._store({key_hash: principal}, generation, loaded_at)
        return principal

    def refresh_due(self) -> int:
        """Blocking: reload, in one query, every entry in use that is past half its TTL (or nearly so,
        so that refreshes come in rounds, not one key at a time). Returns how many were reloaded."""
        generation, loaded_at = self._generation, self.clock()
        horizon = loaded_at - self.refresh_after_s / 2
        with self._lock:
            due = [key_hash for key_hash, entry in self._entries.items() if entry.used and entry.loaded_at < horizon]
        if due:
            self._store(load_principals(self.sessions, due), generation, loaded_at)
        return len(due)

    def invalidate(self, key_hashes: list[str] | None = None) -> None:
        with self._lock:
            self._generation += 1
            if key_hashes is None:
                self._entries.clear()
            for key_hash in key_hashes or ():
                self._entries.pop(key_hash, None)

    def _store(self, loaded: dict[str, KeyPrincipal | None], generation: int, loaded_at: float) -> None:
        with self._lock:
            if generation != self._generation:  # invalidated while we read: the next use loads again
                return
            for key_hash, principal in loaded.items():
                self._entries[key_hash] = _Entry(principal, loaded_at)
                self._entries.move_to_end(key_hash)
                if principal is not None:
                    self.by_key_id[principal.key_id] = principal
            while len(self._entries) > self.max_entries:
                _, evicted = self._entries.popitem(last=False)
                if evicted.principal is not None:
                    self.by_key_id.pop(evicted.principal.key_id, None)


class FailedAuthLimiter:
    """Failed authentications per subject (a client address, a presented key's prefix) in a sliding
    window. A subject past `limit` failures gets 429 instead of 401 for its next wrong keys, so keys
    can't be guessed at speed. It is asked only after a key failed: a valid key is never refused, so
    nobody behind the same NAT or proxy can lock a team or the admin out."""

    def __init__(
        self,
        limit: int = 10,
        *,
        window_s: float = 60.0,
        max_clients: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_clients = max_clients
        self.clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def retry_after(self, *subjects: str) -> float | None:
        """Seconds until every one of `subjects` may fail again without a 429, or None when all may now."""
        if self.limit <= 0:
            return None
        waits = [
            max(failures[0] + self.window_s - self.clock(), 0.0)
            for subject in subjects
            if (failures := self._recent(subject)) is not None and len(failures) >= self.limit
        ]
        return max(waits) if waits else None

    def failed(self, *subjects: str) -> None:
        if self.limit <= 0:
            return
        for subject in subjects:
            failures = self._recent(subject)
            if failures is None:
                failures = self._failures[subject] = deque(maxlen=self.limit)
            failures.append(self.clock())
            self._failures.move_to_end(subject)
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)

    def _recent(self, subject: str) -> deque[float] | None:
        failures = self._failures.get(subject)
        if failures is None:
            return None
        horizon = self.clock() - self.window_s
        while failures and failures[0] <= horizon:
            failures.popleft()
        if not failures:
            del self._failures[subject]
            return None
        return failures
