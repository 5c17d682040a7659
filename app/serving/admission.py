"""Fair turns for the admission work in front of the engine: chat template, tokenization and the gateway's
holds, which run in the worker-thread pool and against the store.

Without it, that work is first come, first served across teams: 160 requests of one key take the pool's
threads and its queue, and a quiet team's request waits behind all of them before the engine, whose fair
share would have let it straight in, ever sees it. Here at most `slots` requests do admission work at once;
the others wait in one queue per team, and a freed slot goes to the team whose turn is next, round robin. So
a quiet team's request waits for at most one turn of each other team, and a flood queues behind itself.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

# Most of the worker-thread pool's threads (anyio's default, 40): admission keeps nearly the concurrency it
# had, only the order of the queue behind it changes. Not all of them: a request's way to its turn (the key's
# lookup, the response store) runs in that pool too, and with every thread busy preparing the flood's
# requests, a quiet team's request queued first come, first served for a thread before it could even take
# its place in line (42 of a 120-response flood went first). Fewer slots spread a flood's admissions (CPU
# work that competes with the engine thread for the GIL) over a longer time: with 4, a tiny-model flood on a
# loaded machine was served half the tokens in its first seconds. The quiet team waits for the next slot to
# free, not for all of them.
ADMISSION_SLOTS = 32


class FairAdmission:
    """Per-team queues in front of `slots` admission slots, served round robin across teams; one event loop."""

    def __init__(self, slots: int = ADMISSION_SLOTS) -> None:
        if slots < 1:
            raise ValueError("admission needs at least one slot")
        self.slots = slots
        self.busy = 0
        # team -> its waiting requests, oldest first; the teams in the order their turns come
        self._queues: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def num_waiting(self) -> int:
        return sum(len(waiters) for waiters in self._queues.values())

    @asynccontextmanager
    async def turn(self, team: str) -> AsyncIterator[None]:
        """Holds one admission slot for `team` while the block runs."""
        await self._acquire(team)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, team: str) -> None:
        if self.busy < self.slots and not self._queues:
            self.busy += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(team, deque()).append(future)
        try:
            await future
        except asyncio.CancelledError:  # the client went away while it waited
            if future.cancelled():
                self._forget(team, future)
            else:  # the slot was handed over as it left: pass it on
                self._release()
            raise

    def _forget(self, team: str, future: asyncio.Future[None]) -> None:
        waiters = self._queues.get(team)
        if waiters is not None and future in waiters:
            waiters.remove(future)
            if not waiters:
                del self._queues[team]

    def _release(self) -> None:
        """Hand the slot to the next team's oldest waiter; that team goes to the back of the round."""
        while self._queues:
            team, waiters = next(iter(self._queues.items()))
            future = waiters.popleft()
            if waiters:
                self._queues.move_to_end(team)
            else:
                del self._queues[team]
            if not future.done():
                future.set_result(None)
                return
        self.busy -= 1
