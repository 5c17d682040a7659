"""Holds: what admitted requests have set aside (nano USD against a budget, one seat of a key's in-flight
cap), counted where every replica sees them, so that N replicas together never admit past a limit.

An admission asks for items (a scope, the capacity left in it, the amount it wants) and gets them all
or none: the first item whose scope already holds its capacity, or would pass it with this amount,
refuses. The holds are kept per holder (one per process) so that a holder that dies without settling
lets go: its holds stop counting once it has missed its heartbeats for `alive_ttl_s`.

Where they live: `LocalHolds` in this process (one replica); `RedisHolds` when Redis is configured;
`DatabaseHolds` in the gateway's database otherwise (app/gateway/holds_store.py has both shared kinds).
Releases and settlements are queued and sent in one round trip, and always before this holder's next
admission, so a seat given back here is free for the next request here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("tokenmill.gateway.holds")

REFUSED_NONE = -1


@dataclass(frozen=True)
class HoldItem:
    scope: str  # "budget:key:12", "in_flight:key:12"
    capacity: int  # what the scope may hold in all (a budget: its limit less what is committed)
    amount: int  # what this request sets aside in it


def over(held: int, item: HoldItem) -> bool:
    """The one rule, wherever holds live (the Redis script and the SQL repeat it)."""
    return held >= item.capacity or held + item.amount > item.capacity


class Holds:
    """In this process only: the event loop and a lock are all it needs."""

    shared = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    async def acquire(self, items: Sequence[HoldItem]) -> int:
        """Take every item, or none: the index of the first that refuses, or REFUSED_NONE."""
        with self._lock:
            for index, item in enumerate(items):
                if over(self._held.get(item.scope, 0), item):
                    return index
            for item in items:
                self._held[item.scope] = self._held.get(item.scope, 0) + item.amount
        return REFUSED_NONE

    def adjust(self, deltas: Mapping[str, int], delay_s: float = 0.0) -> None:
        """Add each delta to this holder's hold on its scope (negative: give back), after `delay_s`.
        Any thread; never blocks on the store."""
        with self._lock:
            for scope, delta in deltas.items():
                left = self._held.get(scope, 0) + delta
                if left > 0:
                    self._held[scope] = left
                else:
                    self._held.pop(scope, None)

    async def close(self) -> None:
        pass


LocalHolds = Holds


class SharedHolds(Holds):
    """Holds kept in a store replicas share. Subclasses send the store one call per admission
    (`_take`, with the adjustments due), one per batch of other adjustments (`_apply`) and a
    heartbeat (`_beat`)."""

    shared = True

    def __init__(self, *, holder: str | None = None, alive_ttl_s: float = 15.0, tick_s: float = 0.05) -> None:
        super().__init__()
        # A fresh name per process: a restarted pod must not inherit the holds its last life left behind.
        self.holder = f"{holder or 'replica'}:{uuid.uuid4().hex[:12]}"
        self.alive_ttl_s = alive_ttl_s
        self.tick_s = tick_s
        self._unsent: dict[str, int] = {}
        self._later: list[tuple[float, dict[str, int]]] = []  # (monotonic due time, deltas)
        self._keeper: asyncio.Task[Any] | None = None
        self._wake = asyncio.Event()
        self._last_beat = 0.0
        self._last_outage_log = float("-inf")

    async def acquire(self, items: Sequence[HoldItem]) -> int:
        self._ensure_keeper()
        # What this holder gave back goes in the same call, ahead of the check: free before it takes again.
        deltas = self._take_due()
        try:
            return await self._take(items, deltas)
        except Exception:
            self._put_back(deltas)
            raise

    def adjust(self, deltas: Mapping[str, int], delay_s: float = 0.0) -> None:
        with self._lock:
            if delay_s > 0:
                self._later.append((time.monotonic() + delay_s, dict(deltas)))
                return
            for scope, delta in deltas.items():
                self._unsent[scope] = self._unsent.get(scope, 0) + delta
        with contextlib.suppress(RuntimeError):  # on the loop: send now rather than at the next tick
            asyncio.get_running_loop()
            self._wake.set()

    async def flush(self) -> None:
        """Send the adjustments that are due, in one call (sends may overlap: they only add)."""
        deltas = self._take_due()
        if not deltas:
            return
        try:
            await self._apply(deltas)
        except Exception:
            self._put_back(deltas)  # again next tick: a lost release would hold its seat until we die
            raise

    def _take_due(self) -> dict[str, int]:
        now = time.monotonic()
        with self._lock:
            due = [deltas for at, deltas in self._later if at <= now]
            self._later = [(at, deltas) for at, deltas in self._later if at > now]
            for deltas in due:
                for scope, delta in deltas.items():
                    self._unsent[scope] = self._unsent.get(scope, 0) + delta
            unsent, self._unsent = {s: d for s, d in self._unsent.items() if d}, {}
        return unsent

    def _put_back(self, deltas: Mapping[str, int]) -> None:
        with self._lock:
            for scope, delta in deltas.items():
                self._unsent[scope] = self._unsent.get(scope, 0) + delta

    def _ensure_keeper(self) -> None:
        loop = asyncio.get_running_loop()
        if self._keeper is None or self._keeper.done() or self._keeper.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._keeper = loop.create_task(self._keep())

    async def _keep(self) -> None:
        """Send adjustments as they come due, and tell the store we are alive."""
        while True:
            # asyncio.wait, not wait_for: Python 3.11's wait_for can swallow a cancellation that lands
            # as the event fires, and then close() would wait on this loop forever.
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({waiter}, timeout=self.tick_s)
            finally:
                waiter.cancel()
            self._wake.clear()
            try:
                await self.flush()
                if time.monotonic() - self._last_beat > self.alive_ttl_s / 3:
                    await self._beat()
                    self._last_beat = time.monotonic()
            except Exception as error:  # retried next tick; said at most every 10 s
                if time.monotonic() - self._last_outage_log > 10:
                    self._last_outage_log = time.monotonic()
                    log.warning(
                        "reservation holds unavailable: %s", str(error).splitlines()[0] if str(error) else error
                    )

    async def close(self) -> None:
        """Stop the heartbeat and give back everything this holder still holds."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(RuntimeError):  # a keeper of another loop (a test's) is not ours to wait on
                await asyncio.wait({self._keeper}, timeout=2.0)
            self._keeper = None
        with contextlib.suppress(Exception):
            await self._forget()

    # what a store implements

    async def _take(self, items: Sequence[HoldItem], deltas: dict[str, int]) -> int:
        """Apply `deltas` (whatever the answer), then take `items` or none. On failure, what is left in
        `deltas` was not applied (the caller puts it back)."""
        raise NotImplementedError

    async def _apply(self, deltas: Mapping[str, int]) -> None:
        raise NotImplementedError

    async def _beat(self) -> None:
        raise NotImplementedError

    async def _forget(self) -> None:
        raise NotImplementedError
