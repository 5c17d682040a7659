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

    async def acquire(self, team: str, weight: float) -> None:
        """Wait for a seat for one line of `team`; the caller must release() it."""
        self.ledger.set_weight(team, weight)
        if self.free > 0 and not self.waiting:
            self._seat(team)
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
            raise

    def release(self, team: str, *, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """A line of `team` left its seat, having been served these tokens."""
        self.ledger.charge(team, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
        self.ledger.leave(team)
        self.free += 1
        self._hand_out()

    def _seat(self, team: str) -> None:
        self.free -= 1
        self.ledger.join(team)

    def _hand_out(self) -> None:
        while self.free > 0 and self.waiting:
            team = min(self.waiting, key=self._standing)
            queue = self.waiting[team]
            granted = queue.popleft()
            if not queue:
                del self.waiting[team]
            self._seat(team)
            granted.set_result(None)

    def _standing(self, team: str) -> float:
        """The team's counter as it would be once seated: one with no line running joins level with the
        least-served team that has one (TeamLedger.join), so idle time earns no credit."""
        counts = self.ledger.teams.get(team)
        service = counts.service if counts is not None else 0.0
        if counts is not None and counts.active > 0:
            return service
        running = [c.service for c in self.ledger.teams.values() if c.active > 0]
        return max(service, min(running)) if running else service

    def _forget(self, team: str, granted: asyncio.Future[None]) -> None:
        queue = self.waiting.get(team)
        if queue is not None and granted in queue:
            queue.remove(granted)
            if not queue:
                del self.waiting[team]
