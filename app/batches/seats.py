"""The batch seats: how many batch lines are in the engine at once (all batches together), and which team
gets the next free one.

A free seat goes to the waiting team that has been served least, by the rule the engine uses for
interactive requests (engine.fair_share.TeamLedger: virtual counters of weighted tokens over the team's
scheduling weight, a returning team starting level with the least-served active one). So a team's 10
lines do not wait behind another team's 50,000, and a team of weight 3 gets three times the seats of a
team of weight 1 while both have lines waiting. Within a team, lines take seats in the order they asked.
"""

from __future__ import annotations

import asyncio
from collections import deque

from engine.fair_share import TeamLedger


class BatchSeats:
    def __init__(self, seats: int) -> None:
        self.free = seats
        self.ledger = TeamLedger()
        self.waiting: dict[str, deque[asyncio.Future[None]]] = {}
        # Lines waiting or seated, per team. A team is active in the ledger while it has any: one whose
        # line just ended but whose next line waits is backlogged, not idle, and keeps its counter.
        self.backlog: dict[str, int] = {}

    async def acquire(self, team: str, weight: float) -> None:
        """Wait for a seat for one line of `team`; the caller must release() it."""
        self.ledger.set_weight(team, weight)
        self._enter(team)
        if self.free > 0 and not self.waiting:
            self.free -= 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(team, deque()).append(granted)
        self._hand_out()
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # seated just as it was cancelled: give it back
                self.release(team)
            else:
                self._forget(team, granted)
                self._exit(team)
            raise

    def release(self, team: str, *, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """A line of `team` left its seat, having been served these tokens."""
        self.ledger.charge(team, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
        self.free += 1
        self._exit(team)
        self._hand_out()

    def _enter(self, team: str) -> None:
        if self.backlog.get(team, 0) == 0:
            self.ledger.join(team)  # lifted level with the least-served backlogged team: no credit for idling
        self.backlog[team] = self.backlog.get(team, 0) + 1

    def _exit(self, team: str) -> None:
        self.backlog[team] -= 1
        if self.backlog[team] == 0:
            del self.backlog[team]
            self.ledger.leave(team)

    def _hand_out(self) -> None:
        while self.free > 0 and self.waiting:
            team = min(self.waiting, key=self.ledger.service)
            queue = self.waiting[team]
            granted = queue.popleft()
            if not queue:
                del self.waiting[team]
            self.free -= 1
            granted.set_result(None)

    def _forget(self, team: str, granted: asyncio.Future[None]) -> None:
        queue = self.waiting.get(team)
        if queue is not None and granted in queue:
            queue.remove(granted)
            if not queue:
                del self.waiting[team]
