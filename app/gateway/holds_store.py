"""The two shared homes of holds (app/gateway/holds.py): Redis, one script per admission; the
gateway's database otherwise, one short transaction per admission serialized per scope (PostgreSQL
advisory locks; SQLite's single writer)."""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Delete, Engine, delete, func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from starlette.concurrency import run_in_threadpool

from app.gateway.holds import REFUSED_NONE, HoldItem, SharedHolds, over
from app.tables import ReservationHold

# KEYS: one hash per item (field: holder -> what it holds). ARGV: holder, alive-key prefix, alive TTL ms,
# then (capacity, amount) per item. A scope nobody has touched for a day is dropped. A field whose holder's alive key is gone is a dead replica's: dropped.
# Returns 0 (all taken) or the 1-based index of the first item that refuses.
_TAKE_LUA = """
local holder, alive, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
redis.call('SET', alive .. holder, '1', 'PX', ttl)
for i = 1, #KEYS do
  local fields = redis.call('HGETALL', KEYS[i])
  local held = 0
  for j = 1, #fields, 2 do
    if fields[j] == holder or redis.call('EXISTS', alive .. fields[j]) == 1 then
      held = held + tonumber(fields[j + 1])
    else
      redis.call('HDEL', KEYS[i], fields[j])
    end
  end
  local capacity, amount = tonumber(ARGV[2 + 2 * i]), tonumber(ARGV[3 + 2 * i])
  if held >= capacity or held + amount > capacity then return i end
end
for i = 1, #KEYS do
  redis.call('HINCRBY', KEYS[i], holder, ARGV[3 + 2 * i])
  redis.call('PEXPIRE', KEYS[i], 86400000)
end
return 0
"""

# KEYS: hashes; ARGV: holder, then one delta per key. A hold that reaches zero is removed.
_APPLY_LUA = """
for i = 1, #KEYS do
  if redis.call('HINCRBY', KEYS[i], ARGV[1], ARGV[i + 1]) <= 0 then redis.call('HDEL', KEYS[i], ARGV[1]) end
end
return 0
"""


class RedisHolds(SharedHolds):
    def __init__(self, url: str, *, prefix: str = "tokenmill:rl:", **options: Any) -> None:
        import redis.asyncio as redis

        super().__init__(**options)
        self._redis = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._prefix = prefix + "hold:"
        self._alive = prefix + "alive:"
        self._take_script = self._redis.register_script(_TAKE_LUA)
        self._apply_script = self._redis.register_script(_APPLY_LUA)

    async def _take(self, items: Sequence[HoldItem], deltas: dict[str, int]) -> int:
        if deltas:
            await self._apply(deltas)
            deltas.clear()  # sent: not to be put back if what follows fails
        args: list[Any] = [self.holder, self._alive, int(self.alive_ttl_s * 1000)]
        for item in items:
            args.extend((item.capacity, item.amount))
        refused = int(await self._take_script(keys=[self._prefix + item.scope for item in items], args=args))
        return refused - 1 if refused else REFUSED_NONE

    async def _apply(self, deltas: Mapping[str, int]) -> None:
        await self._apply_script(keys=[self._prefix + s for s in deltas], args=[self.holder, *deltas.values()])

    async def _beat(self) -> None:
        await self._redis.set(self._alive + self.holder, "1", px=int(self.alive_ttl_s * 1000))

    async def _forget(self) -> None:
        await self._redis.delete(self._alive + self.holder)  # every field of ours stops counting at once
        await self._redis.aclose()


HOLD_LOCK_SPACE = 0x746D6872  # "tmhr": advisory locks of holds, apart from every single-key lock


def scope_lock_id(scope: str) -> int:
    """A PostgreSQL advisory lock per scope (pg_advisory_xact_lock(space, id): a keyspace of its own)."""
    return zlib.crc32(scope.encode()) - 2**31  # a signed 32-bit integer


class DatabaseHolds(SharedHolds):
    """Holds as rows (scope, holder, amount, alive_until); a holder's heartbeat moves its alive_until.
    Every transaction takes its advisory locks, then its row locks, each in scope order: none deadlock."""

    def __init__(self, engine: Engine, **options: Any) -> None:
        super().__init__(**options)
        self.engine = engine
        self.postgres = engine.dialect.name == "postgresql"

    def _upsert(self, amounts: Mapping[str, int], now: float) -> postgresql.Insert | sqlite.Insert:
        insert = postgresql.insert(ReservationHold) if self.postgres else sqlite.insert(ReservationHold)
        rows = [
            {"scope": scope, "holder": self.holder, "amount": amounts[scope], "alive_until": now + self.alive_ttl_s}
            for scope in sorted(amounts)
        ]
        return insert.values(rows).on_conflict_do_update(
            index_elements=["scope", "holder"],
            set_={
                "amount": ReservationHold.amount + insert.excluded.amount,
                "alive_until": insert.excluded.alive_until,
            },
        )

    def _delete_spent(self, scopes: Iterable[str]) -> Delete:
        """Our rows of `scopes` that hold nothing any more (rows this transaction has locked already)."""
        return delete(ReservationHold).where(
            ReservationHold.holder == self.holder, ReservationHold.scope.in_(list(scopes)), ReservationHold.amount <= 0
        )

    def take_now(self, items: Sequence[HoldItem], deltas: Mapping[str, int] | None = None) -> int:
        """Blocking. Add ours (and the adjustments due) first, then read every live holder's total: in
        SQLite that first write takes the database's one write lock; in PostgreSQL each scope's advisory
        lock serializes. Refused: the items are taken out again, the adjustments stay."""
        now = time.time()
        wanted: dict[str, int] = {}
        for item in items:
            wanted[item.scope] = wanted.get(item.scope, 0) + item.amount
        added = dict(deltas or {})
        for scope, amount in wanted.items():
            added[scope] = added.get(scope, 0) + amount
        with self.engine.begin() as connection:
            if self.postgres:
                for lock in sorted({scope_lock_id(scope) for scope in wanted}):
                    connection.execute(
                        text("SELECT pg_advisory_xact_lock(:space, :k)"), {"space": HOLD_LOCK_SPACE, "k": lock}
                    )
            connection.execute(self._upsert(added, now))
            held = dict(
                connection.execute(
                    select(ReservationHold.scope, func.sum(ReservationHold.amount))
                    .where(ReservationHold.scope.in_(wanted), ReservationHold.alive_until > now)
                    .group_by(ReservationHold.scope)
                ).all()
            )
            refused = next(
                (i for i, item in enumerate(items) if over(int(held.get(item.scope) or 0) - wanted[item.scope], item)),
                REFUSED_NONE,
            )
            if refused != REFUSED_NONE:
                connection.execute(self._upsert({scope: -amount for scope, amount in wanted.items()}, now))
            if refused != REFUSED_NONE or deltas:
                connection.execute(self._delete_spent(added))
        return refused

    def apply_now(self, deltas: Mapping[str, int]) -> None:
        with self.engine.begin() as connection:
            connection.execute(self._upsert(deltas, time.time()))
            connection.execute(self._delete_spent(deltas))

    def beat_now(self) -> None:
        now = time.time()
        with self.engine.begin() as connection:
            mine = select(ReservationHold.scope).where(ReservationHold.holder == self.holder)
            scopes = list(connection.scalars(mine.order_by(ReservationHold.scope).with_for_update()))
            if scopes:
                connection.execute(
                    update(ReservationHold)
                    .where(ReservationHold.holder == self.holder, ReservationHold.scope.in_(scopes))
                    .values(alive_until=now + self.alive_ttl_s)
                )
        with self.engine.begin() as connection:
            # Dead holders' rows no longer count; remove them once they are well past it (rows another
            # replica's clean-up has locked are left to it).
            dead = select(ReservationHold.scope, ReservationHold.holder).where(ReservationHold.alive_until < now - 3600)
            for scope, holder in connection.execute(dead.limit(500).with_for_update(skip_locked=True)).all():
                connection.execute(
                    delete(ReservationHold).where(ReservationHold.scope == scope, ReservationHold.holder == holder)
                )

    async def _take(self, items: Sequence[HoldItem], deltas: dict[str, int]) -> int:
        return await run_in_threadpool(self.take_now, items, deltas)

    async def _apply(self, deltas: Mapping[str, int]) -> None:
        await run_in_threadpool(self.apply_now, dict(deltas))

    async def _beat(self) -> None:
        await run_in_threadpool(self.beat_now)

    async def _forget(self) -> None:
        def forget() -> None:
            with self.engine.begin() as connection:
                connection.execute(delete(ReservationHold).where(ReservationHold.holder == self.holder))

        await run_in_threadpool(forget)
